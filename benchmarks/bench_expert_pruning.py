"""Expert pruning on the shipped tiny MoE (:mod:`surgery.tasks.tinymoe`, 2 layers of 8 experts,
top-2): held-out perplexity over every window of the tiny-LM corpus's held-out 10 % after removing
25 % and 50 % of each layer's experts, chosen by REAP, by routed-token frequency and at random
(the mean and range over seeds), calibrated on 8 batches of 16 training windows.

Each row is applied to the shipped model, measured and restored (bit-exact, checked). A script,
not a test; ``--markdown`` prints the table docs/models.md quotes.
"""

from __future__ import annotations

import argparse
import time

import torch

import surgery
from surgery.analysis.metrics import perplexity
from surgery.tasks.tinylm import token_batches
from surgery.tasks.tinymoe import load_moe
from surgery.testing import snapshot, snapshot_differences

AMOUNTS = (0.25, 0.5)
SEEDS = (0, 1, 2, 3, 4)


def measure(
    model: torch.nn.Module, held_out: list, calibration: list, criterion: str, amount: float, seed: int
) -> float:
    """Held-out perplexity with ``amount`` of each layer's experts removed by ``criterion``; the
    model is restored (and checked bit for bit) afterwards."""
    before = snapshot(model)
    handle = surgery.prune_experts(model, amount, calibration=calibration, criterion=criterion, seed=seed)
    try:
        return perplexity(model, held_out)
    finally:
        handle.restore()
        assert snapshot_differences(before, snapshot(model)) == [], "restore() changed the model"


def table(calibration_batches: int = 8) -> list[str]:
    """The markdown table: one row per criterion, one column per amount."""
    model = load_moe()
    held_out = token_batches("test", 16)
    calibration = [inputs for inputs, _ in token_batches("train", 16, limit_batches=calibration_batches)]
    dense = perplexity(model, held_out)
    rows = ["| experts removed per layer | " + " | ".join(f"{a:.0%} ({round(a * 8)} of 8)" for a in AMOUNTS) + " |"]
    rows.append("| --- |" + " --- |" * len(AMOUNTS))
    rows.append("| none (dense) | " + " | ".join(f"{dense:.3f}" for _ in AMOUNTS) + " |")
    for criterion in ("reap", "frequency"):
        cells = [f"{measure(model, held_out, calibration, criterion, a, 0):.3f}" for a in AMOUNTS]
        rows.append(f"| {criterion} | " + " | ".join(cells) + " |")
    cells = []
    for amount in AMOUNTS:
        found = [measure(model, held_out, calibration, "random", amount, seed) for seed in SEEDS]
        cells.append(f"{sum(found) / len(found):.3f} ({min(found):.3f}–{max(found):.3f})")
    rows.append(f"| random, seeds {SEEDS[0]}–{SEEDS[-1]}: mean (range) | " + " | ".join(cells) + " |")
    return rows


def main(argv: list[str] | None = None) -> None:
    """Print the table (about a minute on two cores)."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calibration-batches", type=int, default=8, help="batches of 16 training windows")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    torch.manual_seed(0)
    print("\n".join(table(args.calibration_batches)))
    print(f"\n({time.perf_counter() - start:.0f} s; held-out perplexity over bytes, lower is better)")


if __name__ == "__main__":
    main()
