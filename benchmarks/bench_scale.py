"""Peak memory and time of GPTQ W4 g128 on a random Llama at TinyLlama width, against llm-compressor.

Usage::

    .venv/bin/python benchmarks/bench_scale.py             # 2 and 6 layers, about 10 minutes
    .venv/bin/python benchmarks/bench_scale.py --full      # and 22 layers (the 1.1B model)
    .venv/bin/python benchmarks/bench_scale.py --json /tmp/scale.json
    .venv/bin/python benchmarks/bench_scale.py --rows offloaded --hidden 1024 --depths 2 8 16

Every row runs in a fresh child process on one torch thread, with the same seeded model (hidden
2048, MLP 5632, 32 heads, 4 key/value heads, vocabulary 32000, float32) and the same 4
calibration sequences of 64 tokens. Peak memory is the child's resident high-water mark
(``VmHWM``) beyond its resident memory once the model is built, shown as a multiple of the
model's bytes; everything a row imports is imported before that baseline. Between two depths the
whole resident cost (the peak, plus the weights where the model is in memory) is a line: what
each layer adds, as a multiple of one layer's bytes, and its fixed part (the line at 0 layers).
Rows:

- surgery, in memory: ``quantize(weights=GridSpec(bits=4, group_size=128, method="gptq"))``,
  its originals for ``restore()`` kept in memory (the default) or spilled to disk
  (``originals="disk"``);
- surgery, offloaded: the model saved as a Hugging Face folder first (by another process), then
  ``surgery.offloaded(folder)`` and the same ``quantize``, block by block, the model never in
  memory: its peak is beyond the process before it, and per layer it is the peak's growth alone;
- llm-compressor's ``oneshot`` with ``GPTQModifier(scheme="W4A16")`` and its sequential
  pipeline. llm-compressor pins torch <= 2.14.0, so it runs in its own virtual environment,
  made on first use in ``benchmarks/.venv-llmcompressor`` (torch 2.13.0+cpu from the PyTorch
  CPU index).

With ``--attach``, the rows of :mod:`attach_memory` instead: what a verb's attach holds beyond
the model (dense and a 64-expert MoE, RTN and GPTQ, originals in memory and on disk) beside
llm-compressor, in children without the command line's allocator setting.

A script, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import attach_memory  # beside this script
from peer_venvs import peer_python

HERE = Path(__file__).resolve().parent
HIDDEN = 2048  # TinyLlama's; --hidden measures another width (MLP 2.75x, heads of 64, 8 per key/value head)


def width(hidden: int) -> dict[str, int]:
    return {
        "hidden_size": hidden,
        "intermediate_size": hidden * 11 // 4,
        "num_attention_heads": hidden // 64,
        "num_key_value_heads": max(1, hidden // 512),
    }


ROWS = {
    "surgery, originals in memory": "memory",
    "surgery, originals on disk": "disk",
    "surgery, offloaded": "offloaded",
    "llm-compressor 0.14 (sequential)": "llmcompressor",
}


def memory(field: str) -> int:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def build(layers: int, hidden: int = HIDDEN):
    import torch
    import transformers

    config = transformers.LlamaConfig(
        **width(hidden), num_hidden_layers=layers, vocab_size=32000, max_position_embeddings=256
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def token_ids():
    import torch

    return torch.randint(0, 32000, (4, 64), generator=torch.Generator().manual_seed(1))


def imports(kind: str) -> None:
    """Everything the row imports, before its baseline: the peak is the work's alone (transformers'
    Llama code and torchao, which it pulls in, are 260 MB of resident memory by themselves)."""
    import transformers.models.llama.modeling_llama  # noqa: F401

    if kind == "llmcompressor":
        import datasets  # noqa: F401
        import llmcompressor  # noqa: F401
        import llmcompressor.modifiers.quantization  # noqa: F401
    else:
        import surgery  # noqa: F401


def run_row(kind: str, layers: int, hidden: int = HIDDEN) -> dict:
    """One row, in this (child) process."""
    import torch

    torch.set_num_threads(1)
    imports(kind)
    if kind == "offloaded":
        return _offloaded_row(layers, hidden)
    model = build(layers, hidden)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    layer_bytes = sum(p.numel() * p.element_size() for p in model.model.layers[0].parameters())
    ids = token_ids()
    base = memory("VmRSS")
    start = time.perf_counter()
    if kind == "llmcompressor":
        _llm_compressor(model, ids)
    else:
        _surgery(model, ids, kind)
    seconds = time.perf_counter() - start
    peak = memory("VmHWM") - base
    return {"peak": peak, "model": model_bytes, "layer": layer_bytes, "seconds": seconds, "layers": layers}


def _offloaded_row(layers: int, hidden: int) -> dict:
    import surgery
    from surgery import GridSpec

    with tempfile.TemporaryDirectory() as folder:
        script = f"import sys; sys.path.insert(0, {str(HERE)!r}); import bench_scale; "
        script += f"bench_scale.build({layers}, {hidden}).save_pretrained({folder!r})"
        subprocess.run([sys.executable, "-c", script], check=True)
        ids = token_ids()
        calibration = [{"input_ids": ids[i : i + 1]} for i in range(len(ids))]
        from surgery.ops.offload.offloading import return_freed_memory

        return_freed_memory()  # as the command line does for an offloaded run
        base = memory("VmRSS")
        start = time.perf_counter()
        handle = surgery.offloaded(folder)
        spec = GridSpec(bits=4, group_size=128, symmetric=True)
        surgery.quantize(
            handle, weights=spec, method="gptq", calibration=calibration, exclude="lm_head", progress=False
        )
        seconds = time.perf_counter() - start
        peak = memory("VmHWM") - base
        model = handle.model
        model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        layer_bytes = sum(p.numel() * p.element_size() for p in model.model.layers[0].parameters())
    return {"peak": peak, "model": model_bytes, "layer": layer_bytes, "seconds": seconds, "layers": layers}


def _surgery(model, ids, originals: str) -> None:
    import surgery
    from surgery import GridSpec

    calibration = [{"input_ids": ids[i : i + 1]} for i in range(len(ids))]
    spec = GridSpec(bits=4, group_size=128, symmetric=True)
    surgery.quantize(
        model,
        weights=spec,
        method="gptq",
        calibration=calibration,
        exclude="lm_head",
        originals=originals,
        progress=False,
    )


def _llm_compressor(model, ids) -> None:
    from llmcompressor.modifiers.quantization import GPTQModifier

    recipe = GPTQModifier(targets="Linear", scheme="W4A16", ignore=["lm_head"])
    attach_memory.oneshot_on(model, ids, recipe, "sequential")


def measure(kind: str, layers: int, hidden: int = HIDDEN) -> dict:
    python = peer_python("llmcompressor") if kind == "llmcompressor" else Path(sys.executable)
    found = subprocess.run(
        [str(python), __file__, "--row", kind, "--layers", str(layers), "--hidden", str(hidden)],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(HERE.parent), "MALLOC_MMAP_THRESHOLD_": "65536", "PATH": "/usr/bin:/bin"},
        check=False,
    )
    if found.returncode != 0:
        raise RuntimeError(f"{kind} at {layers} layers failed:\n{found.stderr[-2000:]}")
    return json.loads(found.stdout.strip().splitlines()[-1])


ATTACH_ROWS = {
    "surgery RTN, originals in memory": ("rtn", "memory"),
    "surgery RTN, originals on disk": ("rtn", "disk"),
    "llm-compressor 0.14 RTN (QuantizationModifier)": ("rtn", "llmcompressor"),
    "surgery GPTQ, originals in memory": ("gptq", "memory"),
    "surgery GPTQ, originals on disk": ("gptq", "disk"),
    "llm-compressor 0.14 GPTQ (sequential)": ("gptq", "llmcompressor"),
}


def measure_attach(model: str, method: str, originals: str) -> dict:
    """One attach row in a child (llm-compressor's in its venv), the C library's allocator as it comes."""
    python = peer_python("llmcompressor") if originals == "llmcompressor" else Path(sys.executable)
    found = subprocess.run(
        [str(python), __file__, "--attach-row", model, method, originals],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": f"{HERE.parent}:{HERE}", "PATH": "/usr/bin:/bin"},
        check=False,
    )
    if found.returncode != 0:
        raise RuntimeError(f"{model} {method} {originals} failed:\n{found.stderr[-2000:]}")
    return json.loads(found.stdout.strip().splitlines()[-1])


def attach_rows(json_path: Path | None) -> None:
    results: dict[str, dict] = {}
    for name, (method, originals) in ATTACH_ROWS.items():
        results[name] = {}
        for model in attach_memory.MODELS:
            try:
                results[name][model] = row = measure_attach(model, method, originals)
            except RuntimeError as err:  # a peer that cannot run a row: said, and the table goes on
                print(f"{name}, {model}: {str(err).splitlines()[-1]}", flush=True)
                continue
            ratio = row["grown"] / row["changed"]
            print(f"{name}, {model}: grew {row['grown'] / 1e6:.0f} MB = {ratio:.2f}x the changed bytes", flush=True)
    print(attach_memory.table(results))
    if json_path:
        json_path.write_text(json.dumps(results, indent=2))


def table(results: dict[str, dict[int, dict]], depths: list[int]) -> str:
    """Per depth: the peak beyond the built model ÷ the model's bytes, and seconds per block; then
    the whole resident cost (the peak, plus the model's weights where it is in memory) as a line
    in depth: what each added layer adds ÷ one layer's bytes, and the fixed part (the line at 0
    layers) in MB and in layers' bytes."""
    head = "| | " + " | ".join(f"{d} layers: peak beyond the model ÷ model | s per block" for d in depths)
    head += f" | added per layer ({depths[0]}→{depths[-1]}) ÷ layer bytes | fixed part |"
    lines = [head, "|" + " --- |" * (2 * len(depths) + 3)]
    for name, rows in results.items():
        rows = {int(depth): row for depth, row in rows.items()}  # keys are strings once read back from JSON
        cells = [f"{rows[d]['peak'] / rows[d]['model']:.2f}× | {rows[d]['seconds'] / d:.1f}" for d in depths]
        slope, fixed = line_in_depth(rows, depths, in_memory="offloaded" not in name)
        layer = rows[depths[0]]["layer"]
        lines.append(
            f"| {name} | "
            + " | ".join(cells)
            + f" | {slope / layer:.2f}× | {fixed / 1e6:.0f} MB ({fixed / layer:.1f} layers) |"
        )
    return "\n".join(lines)


def line_in_depth(rows: dict[int, dict], depths: list[int], in_memory: bool) -> tuple[float, float]:
    """(bytes each added layer adds, bytes at 0 layers) of the whole resident cost, through the
    shallowest and deepest runs."""
    whole = {d: rows[d]["peak"] + (rows[d]["model"] if in_memory else 0) for d in (depths[0], depths[-1])}
    slope = (whole[depths[-1]] - whole[depths[0]]) / (depths[-1] - depths[0])
    return slope, whole[depths[0]] - slope * depths[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--full", action="store_true", help="also 22 layers (the 1.1B model)")
    parser.add_argument("--json", type=Path, help="write the measurements here")
    parser.add_argument("--rows", nargs="*", default=list(ROWS.values()), help="memory, disk, offloaded, llmcompressor")
    parser.add_argument("--table", type=Path, help="print the table of a --json file and stop")
    parser.add_argument("--attach", action="store_true", help="what attaching holds beyond the model (dense, MoE)")
    parser.add_argument("--attach-row", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--row", help=argparse.SUPPRESS)
    parser.add_argument("--layers", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--hidden", type=int, default=HIDDEN, help="the model's width (2048: TinyLlama's)")
    parser.add_argument("--depths", type=int, nargs="*", help="layer counts to measure (default 2 6, --full: 2 6 22)")
    args = parser.parse_args()
    if args.attach_row:
        print(json.dumps(attach_memory.run(*args.attach_row)))
        return
    if args.attach:
        attach_rows(args.json)
        return
    if args.row:
        print(json.dumps(run_row(args.row, args.layers, args.hidden)))
        return
    if args.table:
        results = json.loads(args.table.read_text())
        print(table(results, sorted({int(d) for rows in results.values() for d in rows})))
        return
    depths = args.depths or ([2, 6, 22] if args.full else [2, 6])
    results: dict[str, dict[int, dict]] = {}
    for name, kind in ROWS.items():
        if kind not in args.rows:
            continue
        results[name] = {}
        for layers in depths:
            results[name][layers] = measure(kind, layers, args.hidden)
            row = results[name][layers]
            print(f"{name}, {layers} layers: peak {row['peak'] / 1e9:.2f} GB, {row['seconds']:.0f} s", flush=True)
    print(table(results, depths))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
