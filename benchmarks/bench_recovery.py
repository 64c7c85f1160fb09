"""Recovery after compression: no recovery, plain fine-tuning and distillation from the
uncompressed model, at equal steps, on the shipped models (digits CNN, tiny LM).

    .venv/bin/python benchmarks/bench_recovery.py [--json out.json]

Each row compresses a fresh copy of the shipped model, then trains it the same number of
steps with the same learning rate, order and seed: on the task loss alone (fine-tune), or
mixed with the teacher's logits (distill), or also matching two layers' features (distill +
features). One thread; a few minutes.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

import surgery
from surgery.analysis.metrics import accuracy, perplexity
from surgery.core.checkpoints import load_checkpoint
from surgery.tasks import digits, tinylm

MODES: dict[str, dict | None] = {
    "no recovery": None,
    "fine-tune": {},
    "distill (logits)": {"temperature": 2.0, "weight": 0.5},
    "distill (logits + features)": {"temperature": 2.0, "weight": 0.5, "features": None},
}


def _lm_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))


def _digits_rows() -> list[dict]:
    train = digits.digits_batches("train", 32)
    test = digits.digits_batches("test", 256)

    def fresh() -> nn.Module:
        return load_checkpoint(digits.DigitsCNN(), digits.CHECKPOINT).eval()

    compressions: dict[str, Callable[[nn.Module], object]] = {
        "digits CNN, pruned 90 % (global magnitude)": lambda m: surgery.prune(m, 0.9, scope="global"),
        "digits CNN, shrunk to half its channels": lambda m: surgery.shrink(m, 0.5, calibration=train[0][0]),
    }
    features = ["conv2", "fc1"]
    return [
        _row(name, fresh, compress, train, lambda m: accuracy(m, test), "accuracy", features, None)
        for name, compress in compressions.items()
    ]


def _lm_row() -> dict:
    held_out = tinylm.token_batches("test", 16, limit_batches=8)
    train = tinylm.token_batches("train", 16, limit_batches=40)
    calibration = [x for x, _ in tinylm.token_batches("train", 16, limit_batches=4)]

    def fresh() -> nn.Module:
        return load_checkpoint(tinylm.TinyLM(), tinylm.CHECKPOINT).eval()

    def compress(m: nn.Module) -> object:
        return surgery.prune(m, 0.7, method="sparsegpt", calibration=calibration, exclude="head", progress=False)

    features = ["blocks.1", "blocks.3"]
    name = "tiny LM, SparseGPT 70 %"
    return _row(name, fresh, compress, train, lambda m: perplexity(m, held_out), "perplexity", features, _lm_loss)


def _row(name, fresh, compress, train, evaluate, metric, features, loss) -> dict:
    row: dict = {"row": name, "metric": metric, "dense": evaluate(fresh()), "steps": len(train)}
    for mode, distill in MODES.items():
        student, teacher = fresh(), fresh()
        compress(student)
        started = time.perf_counter()
        if distill is not None:
            settings = {**distill, "features": features} if "features" in distill else distill
            kwargs: dict = {"teacher": teacher, "distill": settings} if settings else {}
            if loss is not None:
                kwargs["loss"] = loss
            surgery.finetune(student, calibration=train, epochs=1, lr=1e-3 if loss else 3e-3, progress=False, **kwargs)
        row[mode] = {"value": evaluate(student), "seconds": time.perf_counter() - started}
        print(f"{name:45s} {mode:30s} {row[mode]['value']:.4f}", flush=True)
    return row


def table(rows: list[dict]) -> str:
    head = f"| compressed model (steps) | dense | {' | '.join(MODES)} |\n|{' --- |' * (len(MODES) + 2)}"
    lines = [
        f"| {r['row']} ({r['steps']}) | {r['dense']:.3f} | " + " | ".join(f"{r[m]['value']:.3f}" for m in MODES) + " |"
        for r in rows
    ]
    return "\n".join([head, *lines])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = [*_digits_rows(), _lm_row()]
    print(table(rows))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"rows": rows, "torch": torch.__version__}, handle, indent=2)


if __name__ == "__main__":
    main()
