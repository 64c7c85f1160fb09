"""A plan against the uniform format of the same size, on the shipped tiny Llama: held-out
perplexity over every window of the tiny-LM corpus's held-out 10 % (as ``bench_calibrated.py
--llama``), calibration 32 windows of the training split, gradient scores (next-byte
cross-entropy). A second table plans the weights and the KV cache under one bytes budget, the
cache counted at ``KV_TOKENS`` tokens (16 sequences of the model's 128-byte context), against
uniform pairs of a weight format and a cache dtype. A script, not a test:
``.venv/bin/python benchmarks/bench_planning.py``."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import surgery
from surgery.analysis.metrics import perplexity
from surgery.tasks.tinyllama import load_llama
from surgery.tasks.tinylm import token_batches

CHOICES = ["dense", "int8", "w4g128", "w3g128"]
KV_CHOICES = ["kv16", "kv_int8", "kv_fp8", "kv_int4"]
KV_TOKENS = 16 * 128


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

    print(kv_table(model, pairs, inputs, held_out))


def kv_table(model: torch.nn.Module, pairs: list, inputs: list, held_out: list) -> str:
    """Weights and KV cache in one budget: uniform (weight format, cache dtype) pairs, and the
    plan at each pair's bytes choosing among every weight format and cache dtype."""
    lines = [
        f"\n| setting (cache at {KV_TOKENS} tokens) | weight bpw | cache bytes | total bytes | held-out perplexity "
        "| choices |\n| --- | --- | --- | --- | --- | --- |"
    ]

    def row(name: str, plan: surgery.Plan, counts: str = "") -> None:
        lines.append(
            f"| {name} | {plan.bits_per_weight:.3f} | {plan.kv_cache_bytes:,} | {plan.total_bytes:,} "
            f"| {measured(model, plan, inputs, held_out):.3f} | {counts} |"
        )

    for weights, cache in (("w4g128", "kv16"), ("w4g128", "kv_int8"), ("w3g128", "kv_int8"), ("w4g128", "kv_int4")):
        same = surgery.plan(model, 10**9, [weights, cache], calibration=pairs, loss=next_byte_loss, kv_tokens=KV_TOKENS)
        row(f"uniform {weights} + {cache}", same)
        plan = surgery.plan(
            model, same.total_bytes, CHOICES + KV_CHOICES, calibration=pairs, loss=next_byte_loss, kv_tokens=KV_TOKENS
        )
        row("plan, their bytes", plan, ", ".join(f"{k} {v}" for k, v in plan.counts().items()))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
