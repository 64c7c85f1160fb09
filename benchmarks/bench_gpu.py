"""Surgery on a GPU, for ``scripts/gpu_check.sh``: calibration seconds per block and the kernels
that make compressed weights pay, written as a JSON and a markdown table.

- ``calibration``: GPTQ (W4, groups of 128), AWQ and AutoRound on a random Llama at TinyLlama's
  width (hidden 2048, MLP 5632, 32 heads, 4 key/value heads; two blocks), 8 sequences of 512
  tokens, everything on the device: seconds per block, the device's peak memory; and
  llm-compressor's GPTQModifier on the same model in the same run, where a Python path holding
  it is given (``--peer-path``: llm-compressor 0.14 pins other versions than surgery's, so its
  wheels are installed apart).
- ``kernels``: one Linear 2048 -> 5632 in bfloat16, at a decode shape (1 token) and a prefill
  shape (2048 tokens): surgery's FP8 export (``format="fp8"``: ``torch._scaled_mm``, weights per
  tensor and per row), its 2:4 export run on torch's semi-structured sparse kernels, its int8
  weights in torchao's layout (``format="torchao"``), and its own 4-bit integers and scales (W4
  g128, symmetric) packed for torch's int4 weight-only kernel (tinygemm, the one torchao's
  ``Int4WeightOnlyConfig`` runs; on the CPU its CPU variant); each with its parity against the
  simulation and its latency against the dense bfloat16 Linear (median of paired, interleaved
  rounds, the device synchronized around each call). torchao's own int4 flow (its rounding) is
  the peer row.
- ``loaded``: surgery's W4A16 export (compressed-tensors) of the same Llama loaded by transformers
  on the device: its logits against the simulation, its forward's latency against the bfloat16
  model at both shapes, the class its Linears load as and the bytes its weights hold there
  (transformers dequantizes such a checkpoint; the int4 kernels for it are vLLM's).

``--dry-run``: the same code at toy sizes on this machine's device (the CPU where there is no
GPU), one round, every row that needs CUDA reported as skipped with its reason: what a test runs.

Usage::

    python benchmarks/bench_gpu.py --out DIR [--dry-run] [--peer-path DIR]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

import surgery
from surgery import GridSpec

HERE = Path(__file__).resolve().parent
PEER = HERE / "llmcompressor_gpu.py"


@dataclass(frozen=True)
class Sizes:
    hidden: int
    mlp: int
    heads: int
    kv_heads: int
    layers: int
    sequences: int
    length: int
    prefill: int
    rounds: int
    autoround_iterations: int
    group: int


FULL = Sizes(2048, 5632, 32, 4, 2, 8, 512, 2048, 20, 200, 128)
TOY = Sizes(64, 128, 4, 2, 2, 2, 16, 32, 1, 2, 32)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (torch {torch.__version__}, CUDA {torch.version.cuda})"
    return f"{platform.processor() or platform.machine()} CPU (torch {torch.__version__})"


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def llama(sizes: Sizes, device: torch.device) -> nn.Module:
    """A seeded random Llama at ``sizes``, in bfloat16 on ``device``, built as ``from_pretrained(dtype=...)``
    loads one (its rotary frequencies kept in float32)."""
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=sizes.hidden,
        intermediate_size=sizes.mlp,
        num_hidden_layers=sizes.layers,
        num_attention_heads=sizes.heads,
        num_key_value_heads=sizes.kv_heads,
        vocab_size=32000 if sizes is FULL else 256,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM._from_config(config, dtype=torch.bfloat16).to(device).eval()


def calibration_rows(sizes: Sizes, device: torch.device, peer_path: str | None) -> list[dict]:
    generator = torch.Generator().manual_seed(1)
    vocab = 32000 if sizes is FULL else 256
    batches = [torch.randint(0, vocab, (1, sizes.length), generator=generator) for _ in range(sizes.sequences)]
    on_device = [batch.to(device) for batch in batches]
    methods: dict[str, Callable[[nn.Module], object]] = {
        f"surgery GPTQ W4 g{sizes.group}": lambda m: surgery.quantize(
            m, weights=GridSpec(bits=4, group_size=sizes.group), method="gptq", calibration=on_device, exclude="lm_head"
        ),
        f"surgery AWQ W4 g{sizes.group}": lambda m: surgery.awq(
            m, weights=GridSpec(bits=4, group_size=sizes.group), calibration=on_device, progress=False
        ),
        f"surgery AutoRound W4 g{sizes.group}": lambda m: surgery.quantize(
            m,
            weights=GridSpec(bits=4, group_size=sizes.group),
            method={"name": "autoround", "iterations": sizes.autoround_iterations},
            calibration=on_device,
            exclude="lm_head",
        ),
    }
    rows = []
    for name, run in methods.items():
        model = llama(sizes, device)  # built (random weights, moved there) before the clock starts
        rows.append(_timed(name, lambda run=run, model=model: run(model), sizes.layers, device))
        del model
    rows.append(_peer_row(sizes, batches, device, peer_path))
    return rows


def _timed(name: str, work: Callable[[], object], layers: int, device: torch.device) -> dict:
    gc.collect()  # the rows before: their handles and models hold each other
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    try:
        synchronize(device)
        start = time.perf_counter()
        work()
        synchronize(device)
        seconds = time.perf_counter() - start
    except Exception as err:  # noqa: BLE001 - a row that failed says so; the others still run
        return {"name": name, "error": _one_line(err), "trace": traceback.format_exc()[-2000:]}
    row = {"name": name, "seconds_per_block": seconds / layers}
    if device.type == "cuda":
        row["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    return row


def _peer_row(sizes: Sizes, batches: list, device: torch.device, peer_path: str | None) -> dict:
    name = "llm-compressor GPTQModifier W4 g128"
    if device.type != "cuda":
        return {"name": name, "skipped": "runs on the GPU only here (its CPU figures are in bench_calibrated.py)"}
    if not peer_path:
        return {
            "name": name,
            "skipped": "no --peer-path holding llm-compressor 0.14 (scripts/gpu_wheels.sh carries it)",
        }
    with tempfile.TemporaryDirectory() as folder:
        llama(sizes, torch.device("cpu")).save_pretrained(folder)
        torch.save(torch.cat(batches), Path(folder) / "calibration.pt")
        environment = os.environ | {"PYTHONPATH": os.pathsep.join([peer_path, os.environ.get("PYTHONPATH", "")])}
        done = subprocess.run(
            [sys.executable, str(PEER), folder], capture_output=True, text=True, env=environment, check=False
        )
    if done.returncode != 0:  # the peer's own failure: said, not counted as surgery's
        return {"name": name, "skipped": "it failed: " + (done.stderr.strip().splitlines() or ["no output"])[-1][:300]}
    found = json.loads(done.stdout.strip().splitlines()[-1])
    return {"name": name, "seconds_per_block": found["seconds"] / sizes.layers, "peak_gib": found["peak_gib"]}


def kernel_rows(sizes: Sizes, device: torch.device) -> list[dict]:
    rows = []
    for shape, tokens in (("decode", 1), ("prefill", sizes.prefill)):
        for name, make in KERNELS.items():
            rows.append({"kernel": name, "shape": shape, **_kernel(make, sizes, tokens, device)})
    return rows


def _kernel(make: Callable, sizes: Sizes, tokens: int, device: torch.device) -> dict:
    torch.manual_seed(0)
    dense = nn.Sequential(nn.Linear(sizes.hidden, sizes.mlp, bias=False)).to(device=device, dtype=torch.bfloat16)
    x = torch.randn(tokens, sizes.hidden, device=device, dtype=torch.bfloat16)
    try:
        deployed, parity = make(dense, x, device)
    except Skipped as why:
        return {"skipped": str(why)}
    except Exception as err:  # noqa: BLE001 - a row that failed says so
        return {"error": _one_line(err), "trace": traceback.format_exc()[-2000:]}
    ratios = []
    with torch.no_grad():
        for _ in range(2):  # warm-up
            dense(x), deployed(x)
        for _ in range(sizes.rounds):
            first = _call_seconds(dense, x, device)
            second = _call_seconds(deployed, x, device)
            ratios.append(second / max(first, 1e-9))
    return {"cosine": parity.cosine, "max_abs": parity.max_abs, "latency_vs_bf16": statistics.median(ratios)}


def _call_seconds(module: nn.Module, x: torch.Tensor, device: torch.device) -> float:
    synchronize(device)
    start = time.perf_counter()
    module(x)
    synchronize(device)
    return time.perf_counter() - start


class Skipped(Exception):
    """A kernel this device does not have."""


def _fp8(per_row: bool) -> Callable:
    def make(model: nn.Module, x: torch.Tensor, device: torch.device) -> tuple:
        weights = GridSpec(format="fp8_e4m3", per_channel=per_row)
        activations = GridSpec(format="fp8_e4m3", dynamic="token" if per_row else None)
        with (
            tempfile.TemporaryDirectory() as folder,
            surgery.quantize(model, weights=weights, activations=activations, where="input", calibration=[x]) as handle,
        ):
            record = surgery.export(handle, Path(folder) / "m.pt", format="fp8", inputs=[x])
            return record.load().to(device), record.parity

    return make


def _two_four(model: nn.Module, x: torch.Tensor, device: torch.device) -> tuple:
    if device.type != "cuda":
        raise Skipped("torch's 2:4 semi-structured kernels need CUDA")
    from surgery.ops.export.formats.sparse_linear import semi_structured

    with tempfile.TemporaryDirectory() as folder, surgery.prune(model, 0.5, pattern="2:4") as handle:
        record = surgery.export(handle, Path(folder) / "m.pt", format="sparse", layout="2:4", inputs=[x])
        return semi_structured(record.load(), torch.bfloat16), record.parity


def _int8_weights(model: nn.Module, x: torch.Tensor, device: torch.device) -> tuple:
    if device.type != "cuda":
        raise Skipped("measured on CUDA here (its CPU figures: bench_deploy.py)")
    with tempfile.TemporaryDirectory() as folder, surgery.quantize(model, target="torchao") as handle:
        record = surgery.export(handle, Path(folder) / "m.pt", format="torchao", inputs=[x])
        return record.load().to(device), record.parity


class Int4WeightOnlyLinear(nn.Module):
    """A bias-free Linear computing with torch's int4 weight-only kernel (tinygemm) from given
    integers ``q`` (outputs x inputs, in [-8, 7]) and per-group ``scale`` (outputs x groups):
    the kernel computes ``(u - 8) * scale + zero`` from unsigned ``u = q + 8``, so ``zero`` is 0
    for a symmetric grid. Scales are bfloat16, as the kernel takes them."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, group_size: int, device: torch.device) -> None:
        super().__init__()
        unsigned = (q.to(torch.int32) + 8).to(device)
        if device.type == "cuda":  # two 4-bit values a byte, the high nibble first; 8 inner k-tiles
            pairs = (unsigned[:, ::2] << 4 | unsigned[:, 1::2]).to(torch.uint8)
            self.packed = torch.ops.aten._convert_weight_to_int4pack(pairs, 8)
            self.kernel = torch.ops.aten._weight_int4pack_mm
        else:
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(unsigned, 1)
            self.kernel = torch.ops.aten._weight_int4pack_mm_for_cpu
        scale = scale.to(device, torch.bfloat16)
        self.scales_and_zeros = torch.stack([scale, torch.zeros_like(scale)], dim=-1).transpose(0, 1).contiguous()
        self.group_size = group_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x, self.packed, self.group_size, self.scales_and_zeros)


def _int4_from_our_scales(model: nn.Module, x: torch.Tensor, device: torch.device) -> tuple:
    """surgery's W4 grid (symmetric, groups of ``group``), its integers and bfloat16 scales packed
    for the int4 kernel; parity against the simulation (the fake-quantized Linear)."""
    from surgery.ops.export.parity import Parity

    linear = model[0]
    group = 128 if linear.in_features % 128 == 0 else 32
    spec = GridSpec(bits=4, group_size=group, symmetric=True, scale_dtype="bfloat16")
    with surgery.quantize(model, weights=spec) as handle, torch.no_grad():
        want = model(x).float()
        grid = handle.weights["0.weight"]
        scale = grid.scale.float()
        weight = linear.weight.float().view(linear.out_features, -1, group)
        q = torch.round(weight / scale.unsqueeze(-1)).clamp(-8, 7).view_as(linear.weight)
    deployed = Int4WeightOnlyLinear(q, scale, group, device)
    with torch.no_grad():
        got = deployed(x).float()
    cosine = float(torch.nn.functional.cosine_similarity(want.flatten(), got.flatten(), dim=0))
    return deployed, Parity(float((want - got).abs().max()), cosine, bool(torch.equal(want, got)), "simulation")


def _torchao_int4(model: nn.Module, x: torch.Tensor, device: torch.device) -> tuple:
    """torchao's own int4 weight-only flow (its rounding, not our scales: surgery writes no int4
    torchao tensor yet), as the peer row: its parity against the dense bfloat16 Linear."""
    if device.type != "cuda":
        raise Skipped("torchao's int4 weight-only kernel runs on CUDA")
    import copy

    from torchao.quantization import Int4WeightOnlyConfig, quantize_

    from surgery.ops.export.parity import Parity

    quantized = copy.deepcopy(model)
    quantize_(quantized, Int4WeightOnlyConfig(group_size=128))
    with torch.no_grad():
        want, got = model(x).float(), quantized(x).float()
    cosine = float(torch.nn.functional.cosine_similarity(want.flatten(), got.flatten(), dim=0))
    return quantized, Parity(float((want - got).abs().max()), cosine, bool(torch.equal(want, got)), "peer")


KERNELS: dict[str, Callable] = {
    "FP8 per tensor (format=fp8)": _fp8(per_row=False),
    "FP8 per row, dynamic per token (format=fp8)": _fp8(per_row=True),
    "2:4 sparse (format=sparse, layout=2:4)": _two_four,
    "int8 weight-only per row (format=torchao)": _int8_weights,
    "int4 weight-only g128 from surgery's scales (torch's tinygemm kernel)": _int4_from_our_scales,
    "peer: torchao Int4WeightOnlyConfig g128 (its own rounding)": _torchao_int4,
}


def loaded_rows(sizes: Sizes, device: torch.device) -> list[dict]:
    """:func:`_loaded_rows`, or one row saying why it failed (the calibration part still runs)."""
    try:
        return _loaded_rows(sizes, device)
    except Exception as err:  # noqa: BLE001 - a row that failed says so
        return [{"name": "compressed-tensors W4A16", "error": _one_line(err), "trace": traceback.format_exc()[-2000:]}]


def _loaded_rows(sizes: Sizes, device: torch.device) -> list[dict]:
    """surgery's W4A16 export (W4 g``group`` symmetric, the lm_head left in bfloat16) in the
    compressed-tensors format, loaded by transformers onto ``device`` as a user loads it: its logits
    against the simulation's, its forward's latency against the bfloat16 model at the decode and
    prefill shapes, the class its Linears load as and the bytes its weights hold there."""
    import transformers

    generator = torch.Generator().manual_seed(2)
    vocab = 32000 if sizes is FULL else 256
    shapes = {"decode": 1, "prefill": sizes.prefill}
    inputs = {shape: torch.randint(0, vocab, (1, n), generator=generator).to(device) for shape, n in shapes.items()}
    dense = llama(sizes, device)
    spec = GridSpec(bits=4, group_size=sizes.group, symmetric=True)
    with tempfile.TemporaryDirectory() as folder:
        simulated = llama(sizes, device)
        with surgery.quantize(simulated, weights=spec, exclude="lm_head") as handle, torch.no_grad():
            want = simulated(inputs["prefill"]).logits.float()
            surgery.export(handle, Path(folder) / "w4a16", format="compressed-tensors", inputs=[inputs["decode"]])
        del simulated, handle
        loaded = transformers.AutoModelForCausalLM.from_pretrained(Path(folder) / "w4a16", dtype=torch.bfloat16)
        loaded = loaded.to(device).eval()
    with torch.no_grad():
        got = loaded(inputs["prefill"]).logits.float()
    cosine = float(torch.nn.functional.cosine_similarity(want.flatten(), got.flatten(), dim=0))
    found = {
        "name": f"surgery W4A16 g{sizes.group} (format=compressed-tensors) loaded by transformers {transformers.__version__}",
        "cosine": cosine,
        "max_abs": float((want - got).abs().max()),
        "linear_loads_as": type(loaded.model.layers[0].mlp.down_proj).__name__,
        "weight_bytes_vs_bf16": _held_bytes(loaded) / _held_bytes(dense),
    }
    rows = []
    for shape, ids in inputs.items():
        ratios = []
        with torch.no_grad():
            for _ in range(2):  # warm-up (compressed-tensors may decompress on the first call)
                dense(ids), loaded(ids)
            for _ in range(sizes.rounds):
                first = _call_seconds(dense, ids, device)
                second = _call_seconds(loaded, ids, device)
                ratios.append(second / max(first, 1e-9))
        rows.append({**found, "shape": shape, "tokens": shapes[shape], "latency_vs_bf16": statistics.median(ratios)})
    return rows


def _held_bytes(model: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


def _one_line(err: BaseException) -> str:
    return f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"


def markdown(found: dict) -> str:
    lines = [f"# gpu_check on {found['device']}", "", f"{found['when']}; dry run: {found['dry_run']}", ""]
    lines += ["| calibration | s / block | peak GiB |", "| --- | --- | --- |"]
    for row in found["calibration"]:
        told = _told(row)
        peak = f"{row['peak_gib']:.2f}" if "peak_gib" in row else "–"
        figures = f"{row['seconds_per_block']:.2f} | {peak}" if told is None else told
        lines.append(f"| {row['name']} | {figures} |")
    lines += ["", "| kernel | shape | cosine | latency vs bf16 |", "| --- | --- | --- | --- |"]
    for row in found["kernels"]:
        told = _told(row)
        figures = f"{row['cosine']:.5f} | {row['latency_vs_bf16']:.2f}x" if told is None else told
        lines.append(f"| {row['kernel']} | {row['shape']} | {figures} |")
    lines += ["", "| loaded model | shape | cosine | latency vs bf16 | Linear loads as | weight bytes vs bf16 |"]
    lines += ["| --- | --- | --- | --- | --- | --- |"]
    for row in found["loaded"]:
        told = _told(row)
        figures = (
            f"{row['cosine']:.5f} | {row['latency_vs_bf16']:.2f}x | {row['linear_loads_as']} | "
            f"{row['weight_bytes_vs_bf16']:.2f}"
            if told is None
            else told + " | | |"
        )
        lines.append(f"| {row['name']} | {row.get('shape', '–')} | {figures} |")
    return "\n".join(lines) + "\n"


def _told(row: dict) -> str | None:
    if "skipped" in row:
        return f"skipped: {row['skipped']} |"
    if "error" in row:
        return f"FAILED: {row['error']} |"
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dry-run", action="store_true", help="toy sizes, one round, on whatever device is here")
    parser.add_argument("--peer-path", default=None, help="a folder of packages holding llm-compressor 0.14")
    options = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sizes = TOY if options.dry_run else FULL
    if not options.dry_run and device.type != "cuda":
        raise SystemExit("bench_gpu: no CUDA GPU here (torch.cuda.is_available() is False); use --dry-run")
    found = {
        "device": device_name(device),
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "dry_run": options.dry_run,
        "calibration": [],
        "kernels": [],
        "loaded": [],
    }
    options.out.mkdir(parents=True, exist_ok=True)

    def save() -> None:  # after each part: a run cut short keeps what it measured
        (options.out / "gpu_check.json").write_text(json.dumps(found, indent=1) + "\n")
        (options.out / "gpu_check.md").write_text(markdown(found))

    found["kernels"] = kernel_rows(sizes, device)  # the quick parts first
    save()
    found["loaded"] = loaded_rows(sizes, device)
    save()
    found["calibration"] = calibration_rows(sizes, device, options.peer_path)
    save()
    print(markdown(found))
    failed = [row for part in ("calibration", "kernels", "loaded") for row in found[part] if "error" in row]
    if failed:
        raise SystemExit(f"bench_gpu: {len(failed)} row(s) failed; the JSON holds their traces")


if __name__ == "__main__":
    main()
