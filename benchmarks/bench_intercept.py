"""Build time with surgery.intercept rules vs plain construction, measured in one run.

Run: .venv/bin/python benchmarks/bench_intercept.py [--repeats N]
Each round builds every variant once, in rotating order; the table reports median times and
the ratio to the plain build of the same model. Target: <= 1.02x.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torchvision
from torch import nn
from tqdm import tqdm

import surgery
from surgery import rules


class Passthrough(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args):
        return self.inner(*args)


RULES = {
    "swap ReLU->SiLU": [rules.swap(nn.ReLU, lambda old: nn.SiLU())],
    "wrap Linear + freeze BN": [rules.wrap(nn.Linear, Passthrough), rules.on_parameter(nn.BatchNorm2d, rules.freeze())],
    "no-op rules (hooks only)": [rules.on_parameter(lambda m, n, v: False, lambda p: None)],
}


def models() -> dict[str, Callable[[], nn.Module]]:
    builds = {"resnet50": lambda: torchvision.models.resnet50(), "mobilenet_v3_large":
              lambda: torchvision.models.mobilenet_v3_large()}
    try:
        import timm

        builds["timm vit_small_patch16_224"] = lambda: timm.create_model("vit_small_patch16_224")
    except ImportError:
        print("timm not installed: skipping the timm model")
    return builds


def timed(build: Callable[[], nn.Module], rule_list: list) -> float:
    torch.manual_seed(0)
    start = time.perf_counter()
    if rule_list:
        with surgery.intercept(*rule_list):
            build()
    else:
        build()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    torch.set_num_threads(2)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, {args.repeats} rounds, median times")
    variants = {"plain": [], **RULES}
    rows = []
    for model_name, build in models().items():
        timed(build, [])  # warm-up
        samples: dict[str, list[float]] = {name: [] for name in variants}
        names = list(variants)
        for round_index in tqdm(range(args.repeats), desc=model_name, leave=False):
            order = names[round_index % len(names):] + names[: round_index % len(names)]
            for name in order:
                samples[name].append(timed(build, variants[name]))
        plain = statistics.median(samples["plain"])
        rows += [(model_name, name, statistics.median(s), statistics.median(s) / plain) for name, s in samples.items()]
    width = max(len(r[1]) for r in rows)
    print(f"{'model':<26} {'variant':<{width}} {'median s':>9} {'vs plain':>9}")
    for model_name, name, median, ratio in rows:
        print(f"{model_name:<26} {name:<{width}} {median:>9.3f} {ratio:>8.3f}x")
    print("target: <= 1.02x of plain construction")


if __name__ == "__main__":
    main()
