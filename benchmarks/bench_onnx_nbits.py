"""4-bit Linear weights in ONNX Runtime's MatMulNBits: surgery's exports (RTN, GPTQ) against ONNX
Runtime's own ``MatMulNBitsQuantizer`` (its default blockwise round to nearest, and its GPTQ, both
``is_symmetric=True``) on the same float graph, at the same block size, one thread. Surgery's
rows are its symmetric grid (``max |w| / 7.5``) and the full-range grid ONNX Runtime's symmetric
blocks use (``observer="full_range"``).

Two models: the shipped tiny Llama's four MLP blocks (gate, up, down; its real weights), each
exported alone and run on the hidden states it sees on held-out windows, its error the output's
relative squared error against the float block (summed over the blocks), calibration on the
training windows' hidden states; and a wide random MLP (2048 -> 8192 -> 2048) for speed alone.
Latency is the median of interleaved rounds of one batch, as a ratio to the float graph.

Usage::

    .venv/bin/python benchmarks/bench_onnx_nbits.py [--block 32]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnxruntime.quantization import matmul_nbits_quantizer as nbits
from torch import nn

import surgery
from surgery import GridSpec
from surgery.tasks.tinyllama import load_llama
from surgery.tasks.tinylm import token_batches


def session(path: Path) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def float_graph(module: nn.Module, example: torch.Tensor, path: Path) -> Path:
    torch.onnx.export(
        module, (example,), str(path), dynamo=True, dynamic_shapes=({0: "batch", 1: "tokens"},), external_data=False
    )
    return path


def theirs(source: Path, target: Path, block: int, calibration: list[np.ndarray] | None) -> Path:
    """ONNX Runtime's own quantizer on the float graph: default RTN, or GPTQ given calibration."""
    config = None
    if calibration is not None:
        reader = Reader(onnx.load(str(source)).graph.input[0].name, calibration)
        config = nbits.GPTQWeightOnlyQuantConfig(calibration_data_reader=reader, block_size=block, perchannel=False)
    quantizer = nbits.MatMulNBitsQuantizer(str(source), block_size=block, is_symmetric=True, algo_config=config)
    quantizer.process()
    quantizer.model.save_model_to_file(str(target))
    return target


class Reader(nbits.CalibrationDataReader):
    def __init__(self, name: str, batches: list[np.ndarray]) -> None:
        self.items = iter([{name: b} for b in batches])

    def get_next(self) -> dict | None:
        return next(self.items, None)


def ours(
    module: nn.Module,
    method: str,
    block: int,
    calibration: list[torch.Tensor],
    example: torch.Tensor,
    path: Path,
    full_range: bool = False,
) -> Path:
    """Surgery's ``method`` exported; ``full_range``: the grid ONNX Runtime's symmetric blocks use
    (``max |w| / 8``, the extra level on the larger side, a zero point of 8 or 7 stored)."""
    grid = {"symmetric": False, "observer": "full_range"} if full_range else {"symmetric": True}
    spec = GridSpec(bits=4, group_size=block, **grid)
    with surgery.quantize(
        module, weights=spec, method=method, calibration=calibration if method != "rtn" else None, progress=False
    ) as handle:
        surgery.export(handle, path, format="onnx", inputs=[example])
    return path


def error(path: Path, float_outputs: list[np.ndarray], inputs: list[np.ndarray]) -> float:
    run = session(path)
    name = run.get_inputs()[0].name
    found = [run.run(None, {name: x})[0] for x in inputs]
    return float(
        sum(((a - b) ** 2).sum() for a, b in zip(found, float_outputs)) / sum((b**2).sum() for b in float_outputs)
    )


def latency(paths: dict[str, Path], x: np.ndarray, rounds: int = 7) -> dict[str, float]:
    runs = {key: session(path) for key, path in paths.items()}
    times: dict[str, list[float]] = {key: [] for key in paths}
    for _ in range(rounds):
        for key, run in runs.items():
            feed = {run.get_inputs()[0].name: x}
            run.run(None, feed)
            start = time.perf_counter()
            for _ in range(5):
                run.run(None, feed)
            times[key].append((time.perf_counter() - start) / 5)
    return {key: float(np.median(found)) for key, found in times.items()}


def mlp_inputs(model: nn.Module, split: str, batches: int) -> list[list[torch.Tensor]]:
    """The hidden states each MLP block reads on ``split``'s windows: [block][batch]."""
    found: list[list[torch.Tensor]] = [[] for _ in model.model.layers]
    hooks = [
        layer.mlp.register_forward_pre_hook(lambda m, args, i=i: found[i].append(args[0].detach()))
        for i, layer in enumerate(model.model.layers)
    ]
    with torch.no_grad():
        for x, _ in token_batches(split, 8, limit_batches=batches):
            model(x)
    for hook in hooks:
        hook.remove()
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--block", type=int, default=32)
    block = parser.parse_args().block
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="bench_nbits_"))
    model = load_llama()
    calibration, held_out = mlp_inputs(model, "train", 4), mlp_inputs(model, "test", 4)
    totals: dict[str, list[float]] = {}
    speeds: dict[str, list[float]] = {}
    for index, layer in enumerate(model.model.layers):
        mlp = layer.mlp
        example = held_out[index][0]
        base = float_graph(mlp, example, work / f"float{index}.onnx")
        inputs = [x.numpy() for x in held_out[index]]
        reference = [session(base).run(None, {session(base).get_inputs()[0].name: x})[0] for x in inputs]
        cal = [x.numpy() for x in calibration[index]]
        paths = {
            "float": base,
            "ONNX Runtime RTN": theirs(base, work / f"ort_rtn{index}.onnx", block, None),
            "ONNX Runtime GPTQ": theirs(base, work / f"ort_gptq{index}.onnx", block, cal),
            "surgery RTN": ours(mlp, "rtn", block, calibration[index], example, work / f"rtn{index}.onnx"),
            "surgery GPTQ": ours(mlp, "gptq", block, calibration[index], example, work / f"gptq{index}.onnx"),
            "surgery RTN, full range": ours(
                mlp, "rtn", block, calibration[index], example, work / f"rtn_full{index}.onnx", True
            ),
            "surgery GPTQ, full range": ours(
                mlp, "gptq", block, calibration[index], example, work / f"gptq_full{index}.onnx", True
            ),
        }
        for key, path in paths.items():
            totals.setdefault(key, []).append(0.0 if key == "float" else error(path, reference, inputs))
        timed = latency(paths, inputs[0])
        for key, seconds in timed.items():
            speeds.setdefault(key, []).append(seconds / timed["float"])
    wide = nn.Sequential(nn.Linear(2048, 8192), nn.GELU(), nn.Linear(8192, 2048)).eval()
    example = torch.randn(1, 16, 2048)
    base = float_graph(wide, example, work / "wide.onnx")
    wide_paths = {
        "float": base,
        "ONNX Runtime RTN": theirs(base, work / "wide_ort.onnx", block, None),
        "surgery RTN": ours(wide, "rtn", block, [example], example, work / "wide_rtn.onnx"),
        "surgery RTN, full range": ours(wide, "rtn", block, [example], example, work / "wide_full.onnx", True),
    }
    wide_times = latency(wide_paths, example.numpy())
    print(f"\nMatMulNBits, 4-bit symmetric, blocks of {block}, one thread")
    print(
        "| weights | tiny Llama MLP blocks: relative squared error | latency vs float (MLP blocks) | wide MLP latency vs float |"
    )
    print("| --- | --- | --- | --- |")
    for key in paths:
        wide_ratio = f"{wide_times[key] / wide_times['float']:.2f}" if key in wide_times else "–"
        print(f"| {key} | {sum(totals[key]):.3e} | {np.median(speeds[key]):.2f} | {wide_ratio} |")


if __name__ == "__main__":
    main()
