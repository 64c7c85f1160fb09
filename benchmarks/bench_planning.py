"""A plan against the uniform format of the same size, on the shipped tiny Llama: held-out
perplexity over every window of the tiny-LM corpus's held-out 10 % (as ``bench_calibrated.py
--llama``), calibration 32 windows of the training split, gradient scores (next-byte
cross-entropy). A script, not a test: ``.venv/bin/python benchmarks/bench_planning.py``."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import surgery
from surgery.analysis.metrics import perplexity
from surgery.tasks.tinyllama import load_llama
from surgery.tasks.tinylm import token_batches

CHOICES = ["dense", "int8", "w4g128", "w3g128"]


def next_byte_loss(output: object, target: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of the logits against the next bytes."""
    logits = getattr(output, "logits", output)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def measured(model: torch.nn.Module, plan: surgery.Plan, calibration: list, held_out: list) -> float:
    """Held-out perplexity with ``plan`` applied (then restored)."""
    handle = plan.apply(model, calibration=calibration)
    try:
        return perplexity(model, held_out)
    finally:
        handle.restore()


def main() -> None:
    model = load_llama()
    held_out = token_batches("test", 16)
    pairs = token_batches("train", 8, limit_batches=4)
    inputs = [x for x, _ in pairs]
    print("| setting | bits per weight | held-out perplexity | choices |\n| --- | --- | --- | --- |")
    print(f"| dense (float) | 16 (as counted) | {perplexity(model, held_out):.3f} | |")
    for uniform in ("w3g128", "w4g128"):
        same = surgery.plan(model, "100bpw", [uniform], calibration=pairs, loss=next_byte_loss)
        print(f"| uniform {uniform} | {same.bits_per_weight:.3f} | {measured(model, same, inputs, held_out):.3f} | |")
        plan = surgery.plan(model, same.total_bytes, CHOICES, calibration=pairs, loss=next_byte_loss)
        counts = ", ".join(f"{k} {v}" for k, v in plan.counts().items())
        print(
            f"| plan, {uniform}'s bytes | {plan.bits_per_weight:.3f} | {measured(model, plan, inputs, held_out):.3f} | {counts} |"
        )
    for bpw in ("3.5bpw", "4.5bpw"):
        plan = surgery.plan(model, bpw, CHOICES, calibration=pairs, loss=next_byte_loss)
        counts = ", ".join(f"{k} {v}" for k, v in plan.counts().items())
        print(
            f"| plan at {bpw} | {plan.bits_per_weight:.3f} | {measured(model, plan, inputs, held_out):.3f} | {counts} |"
        )


if __name__ == "__main__":
    main()
