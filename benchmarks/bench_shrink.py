"""Benchmark ``surgery.shrink`` against Torch-Pruning: latency and MACs at equal MACs, time to shrink, zoo coverage.

Usage::

    .venv/bin/python benchmarks/bench_shrink.py                  # four models, about 5 minutes
    .venv/bin/python benchmarks/bench_shrink.py --zoo            # also every torchvision classifier <= 40M
    .venv/bin/python benchmarks/bench_shrink.py --zoo-only --zoo-cache /tmp/zoo.jsonl   # resumable, ~40 min
    .venv/bin/python benchmarks/bench_shrink.py --models resnet18 --json /tmp/shrink.json

For resnet50, resnet18, mobilenet_v3_large and vit_b_16 (random weights, 224 px, one torch
thread): ``surgery.shrink(model, 0.5)`` and Torch-Pruning's ``MagnitudePruner`` (L2, the
classifier kept) with its ratio bisected until its MACs match ours within 3 %; then latency
at batch 1 and 8, timed in interleaved rounds (dense, surgery, Torch-Pruning, in an order
that alternates), as the median of per-round ratios to dense. ``--zoo`` runs shrink 0.3 on
every torchvision classification model up to 40 M parameters (inception_v3 and googlenet
aside) and counts, for each tool, the models whose output shape holds (and, for surgery, whose
restore is bit-exact and whose bake -> rebuild -> strict load gives identical outputs;
Torch-Pruning has no restore or rebuild) and >= 10 % of parameters removed; each model and
tool runs in its own process, limited to ``ZOO_TIMEOUT`` seconds (Torch-Pruning on MaxViT grew
past 17 GB here). Torch-Pruning is the ``bench`` extra. A script, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch
import torchvision
from torch import nn

import surgery
from surgery.testing import snapshot, snapshot_differences

MODELS = ("resnet50", "resnet18", "mobilenet_v3_large", "vit_b_16")


def macs_of(model: nn.Module, x: torch.Tensor) -> int:
    total = [0]

    def count(module, args, output):
        if isinstance(module, nn.Linear):
            total[0] += output.numel() * module.in_features
        elif isinstance(module, nn.Conv2d):
            total[0] += (
                output.numel() * module.in_channels // module.groups * module.kernel_size[0] * module.kernel_size[1]
            )

    hooks = [m.register_forward_hook(count) for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv2d))]
    with torch.no_grad():
        model(x)
    for hook in hooks:
        hook.remove()
    return total[0]


def torch_pruning(model: nn.Module, x: torch.Tensor, ratio: float) -> nn.Module:
    import torch_pruning as tp

    classes = {m.out_features for m in model.modules() if isinstance(m, nn.Linear)} | {1000}
    classifier = [
        m
        for m in model.modules()
        if isinstance(m, (nn.Linear, nn.Conv2d))
        and getattr(m, "out_features", getattr(m, "out_channels", None)) in classes
    ][-1]  # squeezenet: a conv
    pruner = tp.pruner.MagnitudePruner(
        model, x, importance=tp.importance.MagnitudeImportance(p=2), pruning_ratio=ratio, ignored_layers=[classifier]
    )
    pruner.step()
    return model


def matched_torch_pruning(base: nn.Module, x: torch.Tensor, target: int) -> tuple[nn.Module, float, float]:
    """Torch-Pruning with its ratio bisected to reach ``target`` MACs (within 3 %)."""
    low, high, best = 0.05, 0.95, None
    for _ in range(7):
        ratio = (low + high) / 2
        start = time.perf_counter()
        pruned = torch_pruning(copy.deepcopy(base), x, ratio)
        seconds = time.perf_counter() - start
        macs = macs_of(pruned, x)
        best = (
            (pruned, ratio, seconds) if best is None or abs(macs - target) < abs(macs_of(best[0], x) - target) else best
        )
        if abs(macs - target) <= 0.03 * target:
            break
        low, high = (ratio, high) if macs > target else (low, ratio)
    return best


def latency(models: dict[str, nn.Module], x: torch.Tensor, rounds: int = 9) -> dict[str, float]:
    """Median per-round ratio of each model's forward time to the dense model's."""
    times: dict[str, list[float]] = {name: [] for name in models}
    order = list(models)
    with torch.no_grad():
        for model in models.values():
            model(x)  # warm up
        for round_ in range(rounds):
            for name in order if round_ % 2 else order[::-1]:
                start = time.perf_counter()
                models[name](x)
                times[name].append(time.perf_counter() - start)
    dense = times["dense"]
    return {name: statistics.median(t / d for t, d in zip(times[name], dense)) for name in models} | {
        "dense_ms": 1000 * statistics.median(dense)
    }


def compare(name: str) -> dict:
    torch.manual_seed(0)
    base = torchvision.models.get_model(name, weights=None).eval()
    x = torch.randn(1, 3, 224, 224)
    ours = copy.deepcopy(base)
    start = time.perf_counter()
    handle = surgery.shrink(ours, 0.5, calibration=x)
    shrink_seconds = time.perf_counter() - start
    dense_macs, our_macs = macs_of(base, x), macs_of(ours, x)
    row = {
        "model": name,
        "dense_macs": dense_macs,
        "surgery_macs": our_macs,
        "surgery_seconds": shrink_seconds,
        "surgery_params": handle.params()["after"],
        "dense_params": handle.params()["before"],
    }
    try:
        theirs, ratio, their_seconds = matched_torch_pruning(base, x, our_macs)
        row |= {
            "tp_macs": macs_of(theirs, x),
            "tp_ratio": ratio,
            "tp_seconds": their_seconds,
            "tp_params": sum(p.numel() for p in theirs.parameters()),
        }
        variants = {"dense": base, "surgery": ours, "Torch-Pruning": theirs}
    except Exception as err:  # e.g. a stale attribute after removing channels: reported, not hidden
        row["tp_error"] = f"{type(err).__name__}: {' '.join(str(err).split())[:160]}"
        variants = {"dense": base, "surgery": ours}
    for size in (1, 8):
        row[f"batch{size}"] = latency(variants, torch.randn(size, 3, 224, 224))
    return row


ZOO_TIMEOUT = 300  # seconds per model and tool: a tool that takes longer (or runs out of memory) fails it


def _zoo_child(name: str, tool: str) -> dict:
    """``zoo_one`` in its own process, with a time limit."""
    try:
        done = subprocess.run(
            [sys.executable, __file__, "--zoo-one", name, tool], capture_output=True, text=True, timeout=ZOO_TIMEOUT
        )
    except subprocess.TimeoutExpired:
        return {"error": f"no result within {ZOO_TIMEOUT} s"}
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or ["killed"])[-1][:100]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def zoo_one(name: str, tool: str) -> dict:
    """One zoo model with one tool (run in a child process): what held, and the share removed."""
    torch.set_num_threads(1)
    model = torchvision.models.get_model(name, weights=None).eval()
    dense = sum(p.numel() for p in model.parameters())
    size = 224 if any(k in name for k in ("vit", "swin", "maxvit")) else 64
    x = torch.randn(1, 3, size, size)
    with torch.no_grad():
        reference = model(x)
    if tool == "Torch-Pruning":
        theirs = torch_pruning(model, x, 0.3)
        with torch.no_grad():
            shape = theirs(x).shape == reference.shape
        return {"shape": shape, "removed": 1 - sum(p.numel() for p in theirs.parameters()) / dense}
    before = snapshot(model)
    handle = surgery.shrink(model, 0.3, calibration=x)
    with torch.no_grad():
        shape = model(x).shape == reference.shape
    removed = 1 - handle.params()["after"] / dense
    handle.restore()
    with torch.no_grad():
        restore = snapshot_differences(before, snapshot(model)) == [] and torch.equal(model(x), reference)
    handle = surgery.shrink(model, 0.3, calibration=x)
    plan = json.loads(json.dumps(handle.plan()))
    baked = handle.bake()
    fresh = surgery.rebuild(lambda: torchvision.models.get_model(name, weights=None), plan).eval()
    fresh.load_state_dict(baked.state_dict(), strict=True)
    with torch.no_grad():
        rebuild = torch.equal(fresh(x), baked(x))
    return {
        "shape": shape,
        "removed": removed,
        "restore": restore,
        "rebuild": rebuild,
        "kept_whole": sum("kept whole" in op for op in handle.frozen_ops),
    }


def _dense_params(name: str) -> int:
    try:
        with torch.device("meta"):  # no memory, when the constructor allows it
            model = torchvision.models.get_model(name, weights=None)
    except (NotImplementedError, RuntimeError):  # regnet computes widths with tensors: build it for real
        model = torchvision.models.get_model(name, weights=None)
    return sum(p.numel() for p in model.parameters())


def zoo(cache: Path | None = None) -> dict[str, dict[str, int]]:
    """Shrink 0.3 on every torchvision classifier <= 40M parameters (inception_v3/googlenet aside),
    each model and tool in its own process (``ZOO_TIMEOUT``). surgery: output shape kept, >= 10 %
    of parameters removed, restore bit-exact, bake -> rebuild -> strict load bit-identical.
    Torch-Pruning (no restore, no rebuild): output shape kept and >= 10 % removed."""
    counts = {
        "surgery": {"models": 0, "shape": 0, "removed_10pct": 0, "restore": 0, "rebuild": 0},
        "Torch-Pruning": {"models": 0, "shape": 0, "removed_10pct": 0},
    }
    cached = {}  # (model, tool) -> result, from an earlier, interrupted sweep with the same cache file
    if cache is not None and cache.exists():
        for line in cache.read_text().splitlines():
            entry = json.loads(line)
            cached[(entry.pop("model"), entry.pop("tool"))] = entry
    for name in torchvision.models.list_models(module=torchvision.models):
        if name in ("inception_v3", "googlenet"):
            continue
        if _dense_params(name) > 40e6:
            continue
        line = f"{name:<24}"
        for tool, row in counts.items():
            row["models"] += 1
            result = cached.get((name, tool))
            if result is None:
                result = _zoo_child(name, tool)
                if cache is not None:
                    with cache.open("a") as handle:
                        handle.write(json.dumps({"model": name, "tool": tool, **result}) + "\n")
            if "error" in result:
                line += f"  {tool} FAILED {result['error']}"
                continue
            for key in ("shape", "restore", "rebuild"):
                if key in row:
                    row[key] += bool(result[key])
            row["removed_10pct"] += result["removed"] >= 0.10
            line += f"  {tool} -{result['removed']:.0%}" + (
                "" if all(result.get(k, True) for k in ("shape", "restore", "rebuild")) else f" {result}"
            )
        print(line, flush=True)
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    parser.add_argument("--zoo", action="store_true", help="also the zoo coverage sweep (about 15 minutes)")
    parser.add_argument("--zoo-only", action="store_true", help="only the zoo coverage sweep")
    parser.add_argument("--zoo-one", nargs=2, metavar=("MODEL", "TOOL"), help=argparse.SUPPRESS)
    parser.add_argument(
        "--zoo-cache",
        type=Path,
        help="JSON lines of finished (model, tool) results: an interrupted zoo sweep resumes from it",
    )
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.zoo_one:
        warnings.simplefilter("ignore")
        print(json.dumps(zoo_one(*args.zoo_one)))
        return
    rows = []
    print(
        f"{'model':<20} {'MACs surgery/TP vs dense':<26} {'b1 surgery':>11} {'b1 TP':>8} {'b8 surgery':>11} "
        f"{'b8 TP':>8} {'shrink s':>9} {'TP s':>6}"
    )
    for name in [] if args.zoo_only else args.models:
        row = compare(name)
        rows.append(row)
        tp = lambda key: f"{row[key]['Torch-Pruning']:>7.3f}x" if "Torch-Pruning" in row[key] else f"{'failed':>8}"
        their_macs = f"{row['tp_macs'] / row['dense_macs']:.3f}" if "tp_macs" in row else "failed"
        print(
            f"{name:<20} {row['surgery_macs'] / row['dense_macs']:.3f} / {their_macs:<6}{'':<14} "
            f"{row['batch1']['surgery']:>10.3f}x {tp('batch1')} {row['batch8']['surgery']:>10.3f}x {tp('batch8')} "
            f"{row['surgery_seconds']:>9.2f} {row.get('tp_seconds', float('nan')):>6.2f}",
            flush=True,
        )
        if "tp_error" in row:
            print(f"  Torch-Pruning on {name}: {row['tp_error']}")
    result = {"rows": rows}
    if args.zoo or args.zoo_only:
        result["zoo"] = zoo(args.zoo_cache)
        print(json.dumps(result["zoo"], indent=2))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=2)


if __name__ == "__main__":
    main()
