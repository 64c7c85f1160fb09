"""Benchmark the calibrated methods on real data offline: MNIST-1D accuracy and tiny-LM perplexity.

Usage::

    .venv/bin/python benchmarks/bench_calibrated.py              # about 2 minutes
    .venv/bin/python benchmarks/bench_calibrated.py --json /tmp/calibrated.json
    .venv/bin/python benchmarks/bench_calibrated.py --llama   # the tiny Llama beside llm-compressor
    .venv/bin/python benchmarks/bench_calibrated.py --llama --model tinyqwen3   # the tiny dense Qwen3

For the shipped MNIST-1D CNN (1000 test signals) and the shipped tiny byte-level language model
(the held-out 10 % of its corpus), every method is applied to the dense model, measured and
restored (the script checks the restore is bit-exact): pruning by magnitude, Wanda and
SparseGPT at 50 %, 70 % and 2:4 (the CNN's first layer, with one input channel, stays dense for
2:4; the LM's output layer always stays dense), and weight quantization by round to nearest and
GPTQ at 4, 3 and 2 bits with a scale per 32 inputs. ``torch.nn.utils.prune``'s
``l1_unstructured`` is measured in the same run as the peer of the magnitude rows (the same
criterion: its figures should equal ours; its time includes copying the model, since its
``remove()`` cannot undo). Time is the wall time of the call, calibration included, on one
torch thread. The sequential pass's cached activations (one block's inputs
and outputs) are printed beside the size of every block's inputs together. A script, not a
test: it asserts nothing but the restores.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from copy import deepcopy

import torch
from torch import nn
from torch.nn.utils import prune as torch_prune

import surgery
from surgery import GridSpec
from surgery.analysis import metrics
from surgery.core.checkpoints import load_checkpoint
from surgery.tasks import mnist1d, tinylm
from surgery.testing import snapshot, snapshot_differences

PRUNING = [
    ("magnitude", "l1_unstructured"),
    ("Wanda", "wanda"),
    ("Wanda, layer-wide", "wanda_layer"),
    ("SparseGPT", "sparsegpt"),
]
SPARSITY = [("50%", 0.5, None), ("70%", 0.7, None), ("2:4", 0.5, "2:4")]
QUANTIZING = [("RTN", "rtn"), ("GPTQ", "gptq")]
BITS = (4, 3, 2)


def timed(fn: Callable[[], object]) -> tuple[object, float]:
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def torch_magnitude(model: nn.Module, amount: float, exclude: set[str]) -> nn.Module:
    """``torch.nn.utils.prune.l1_unstructured`` on each Linear/Conv weight of a copy (its
    ``remove()`` keeps the zeros, so it never touches the model measured by the others)."""
    copy = deepcopy(model)
    for name, layer in copy.named_modules():
        if isinstance(layer, (nn.Linear, nn.Conv1d)) and name not in exclude:
            torch_prune.l1_unstructured(layer, "weight", amount)
    return copy


def measure(
    task: str,
    model: nn.Module,
    score: Callable[[nn.Module], float],
    calibration: list,
    head: str | None,
    first: str | None,
) -> list[dict]:
    before = snapshot(model)
    rows = [{"task": task, "method": "dense", "setting": "", "score": score(model), "seconds": 0.0}]
    for label, amount, pattern in SPARSITY:
        for name, method in PRUNING:
            exclude = [x for x in (head, first if pattern else None) if x]
            handle, seconds = timed(
                lambda: surgery.prune(
                    model,
                    amount,
                    method=method,
                    pattern=pattern,
                    exclude=exclude or None,
                    progress=False,
                    calibration=None if method == "l1_unstructured" else calibration,
                )
            )
            rows.append({"task": task, "method": name, "setting": label, "score": score(model), "seconds": seconds})
            if handle.sequential is not None:
                rows[-1]["peak_cached_bytes"] = handle.sequential.peak_cached_bytes
            handle.restore()
        if pattern is None:
            pruned, seconds = timed(lambda: torch_magnitude(model, amount, {x for x in (head,) if x}))
            rows.append(
                {
                    "task": task,
                    "method": "torch prune (peer)",
                    "setting": label,
                    "score": score(pruned),
                    "seconds": seconds,
                }
            )
    for bits in BITS:
        for name, method in QUANTIZING:
            spec = GridSpec(bits=bits, symmetric=False, per_channel=True, group_size=32)
            handle, seconds = timed(
                lambda: surgery.quantize(
                    model, weights=spec, method=method, calibration=calibration, exclude=head, progress=False
                )
            )
            rows.append(
                {"task": task, "method": name, "setting": f"W{bits} g32", "score": score(model), "seconds": seconds}
            )
            handle.restore()
    problems = snapshot_differences(before, snapshot(model))
    if problems:
        raise SystemExit(f"{task}: the model is not as it was after restore: {problems[:3]}")
    return rows


def print_table(rows: list[dict], metric: str) -> None:
    task = rows[0]["task"]
    print(f"\n{task}: {metric} (dense {rows[0]['score']:.4g})")
    print(f"  {'method':<20} {'setting':<8} {metric:>11} {'time':>8}")
    for row in rows[1:]:
        print(f"  {row['method']:<20} {row['setting']:<8} {row['score']:>11.4g} {row['seconds']:>7.2f}s")


def block_memory(model: tinylm.TinyLM, calibration: list) -> dict[str, int]:
    """What the sequential pass holds at once vs. every block's inputs together."""
    handle = surgery.prune(model, 0.5, method="sparsegpt", calibration=calibration, exclude="head", progress=False)
    peak = handle.sequential.peak_cached_bytes
    handle.restore()
    sizes = []
    hooks = [
        block.register_forward_pre_hook(lambda m, a: sizes.append(a[0].numel() * a[0].element_size()))
        for block in model.blocks
    ]
    with torch.no_grad():
        for batch in calibration:
            model(batch)
    for hook in hooks:
        hook.remove()
    return {"sequential_peak_bytes": peak, "all_block_inputs_bytes": sum(sizes), "blocks": len(model.blocks)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--llama", action="store_true", help="the shipped tiny Llama beside llm-compressor instead")
    parser.add_argument("--no-peer", action="store_true", help="with --llama: our rows only")
    parser.add_argument(
        "--model", choices=("tinyllama", "tinyqwen3"), default="tinyllama", help="with --llama: which shipped model"
    )
    parser.add_argument(
        "--rows", help="with --llama: only rows whose name holds one of these comma-separated texts (W4A,GPTQ)"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.llama:
        from llama_quality import run, table

        rows = run(not args.no_peer, args.rows, args.model)
        print(table(rows, args.model))
        if args.json:
            with open(args.json, "w") as handle:
                json.dump({"rows": rows, "torch": torch.__version__}, handle, indent=2)
        return

    cnn = load_checkpoint(mnist1d.MNIST1DCNN(), mnist1d.CHECKPOINT).eval()
    test = mnist1d.mnist1d_batches("test", 500)
    calibration = [x for x, _ in mnist1d.mnist1d_batches("train", 100, limit_batches=8)]
    cnn_rows = measure("MNIST-1D CNN", cnn, lambda m: metrics.accuracy(m, test), calibration, None, "conv1")
    print_table(cnn_rows, "accuracy")

    lm = load_checkpoint(tinylm.TinyLM(), tinylm.CHECKPOINT).eval()
    held_out = tinylm.token_batches("test", 16)
    lm_calibration = [x for x, _ in tinylm.token_batches("train", 16, limit_batches=8)]
    lm_rows = measure("tiny LM", lm, lambda m: metrics.perplexity(m, held_out), lm_calibration, "head", None)
    print_table(lm_rows, "perplexity")
    memory = block_memory(lm, lm_calibration)
    print(
        f"\nsequential calibration of the tiny LM ({memory['blocks']} blocks, 8 batches of 16x128 bytes): "
        f"{memory['sequential_peak_bytes'] / 2**20:.2f} MiB of block activations held at once, against "
        f"{memory['all_block_inputs_bytes'] / 2**20:.2f} MiB for every block's inputs together"
    )
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"rows": cnn_rows + lm_rows, "memory": memory, "torch": torch.__version__}, handle, indent=2)


if __name__ == "__main__":
    main()
