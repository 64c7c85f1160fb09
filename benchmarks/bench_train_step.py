"""What masks attached cost a training step: forward + backward + fused AdamW step.

    python benchmarks/bench_train_step.py                      # resnet18, batch 16, 224 px
    python benchmarks/bench_train_step.py --rounds 5 --image-size 112   # quicker

Three copies of the same randomly initialised model, each with its own fused AdamW:

- ``plain``: no surgery;
- ``surgery``: ``surgery.prune(model, 0.5)``: tensor hooks mask the gradients, a global
  optimizer step post-hook re-applies the masks after each (fused) step, forward-pre hooks
  check the versions before each forward;
- ``torch.nn.utils.prune``: ``l1_unstructured`` 0.5 on the same layers (``weight_orig * mask``
  recomputed in a forward-pre hook, gradients flowing through the product).

One thread. Paired, interleaved rounds: each round times one step of every variant, in a
shuffled order, and divides by the plain step of the same round; the median ratio and a
bootstrap 95 % interval are printed. After the rounds, each variant's pruned entries are
checked to be zero (masks that hold) — a timing of a model that lost its masks would be void.
"""

from __future__ import annotations

import argparse
import copy
import json
import time

import numpy as np
import torch
import torchvision
from torch import nn
from torch.nn import functional as F
from torch.nn.utils import prune as torch_prune

import surgery
from surgery.core.targets import default_layer


def build(args: argparse.Namespace) -> dict[str, tuple[nn.Module, torch.optim.Optimizer, object]]:
    torch.manual_seed(0)
    base = getattr(torchvision.models, args.model)(num_classes=10)
    variants = {
        "plain": copy.deepcopy(base),
        "surgery": copy.deepcopy(base),
        "torch.nn.utils.prune": copy.deepcopy(base),
    }
    handle = surgery.prune(variants["surgery"], args.amount, progress=False)
    layers = [m for name, m in variants["torch.nn.utils.prune"].named_modules() if default_layer(m, name)]
    for layer in layers:
        torch_prune.l1_unstructured(layer, "weight", amount=args.amount)
    return {
        name: (
            model.train(),
            torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True),
            handle if name == "surgery" else layers if name != "plain" else None,
        )
        for name, model in variants.items()
    }


def step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> float:
    started = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()
    optimizer.step()
    return time.perf_counter() - started


def masks_hold(name: str, model: nn.Module, owner: object) -> bool:
    """Pruned entries are zero right after the last step, before any forward."""
    if name == "surgery":
        return all(not model.get_parameter(n).detach()[~m].any() for n, m in owner.masks().items())
    if name == "torch.nn.utils.prune":  # its effective weight is recomputed in the forward: check that product
        return all(
            not (layer.weight_orig * layer.weight_mask).detach()[layer.weight_mask == 0].any() for layer in owner
        )
    return True


def bootstrap(ratios: np.ndarray, rng: np.random.Generator, draws: int = 2000) -> tuple[float, float]:
    medians = np.median(rng.choice(ratios, size=(draws, len(ratios))), axis=1)
    return float(np.percentile(medians, 2.5)), float(np.percentile(medians, 97.5))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--amount", type=float, default=0.5)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    variants = build(args)
    x = torch.randn(args.batch, 3, args.image_size, args.image_size, generator=torch.Generator().manual_seed(0))
    y = torch.randint(0, 10, (args.batch,), generator=torch.Generator().manual_seed(1))
    names = list(variants)
    times = {name: [] for name in names}
    for round_ in range(args.warmup + args.rounds):
        for name in rng.permutation(names):
            model, optimizer, _ = variants[name]
            elapsed = step(model, optimizer, x, y)
            if round_ >= args.warmup:
                times[name].append(elapsed)
    plain = np.array(times["plain"])
    print(
        f"{args.model}, batch {args.batch}, {args.image_size} px, prune {args.amount}, fused AdamW, 1 thread, "
        f"{args.rounds} paired rounds (torch {torch.__version__})"
    )
    print(f"{'variant':<24} {'median step':>12} {'ratio vs plain (median, 95% CI)':>34} {'masks hold':>11}")
    results = {}
    for name in names:
        ratios = np.array(times[name]) / plain
        low, high = bootstrap(ratios, rng)
        model, _, owner = variants[name]
        holds = masks_hold(name, model, owner)
        results[name] = {
            "median_s": float(np.median(times[name])),
            "ratio": float(np.median(ratios)),
            "ci": [low, high],
            "masks_hold": holds,
        }
        print(
            f"{name:<24} {np.median(times[name]) * 1e3:>10.1f} ms {np.median(ratios):>20.3f}× [{low:.3f}, {high:.3f}]"
            f" {'yes' if holds else 'NO':>11}"
        )
    variants["surgery"][2].restore()
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"args": vars(args), "results": results}, handle, indent=2)


if __name__ == "__main__":
    main()
