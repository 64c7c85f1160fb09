"""GGUF files run by llama.cpp: llama.cpp's own quantization of the float model (``llama-quantize``,
without and with an importance matrix that ``llama-imatrix`` collects from the same calibration
text surgery calibrates on) against surgery's RTN, GPTQ and AutoRound exports to the same types, the same tensors quantized (every Linear but the head; embeddings and head F32 in
both), so the files have equal bytes. One run, one thread (``--threads 2``: both cores): held-out
perplexity computed from llama.cpp's logits over every held-out window of the tiny-LM corpus,
prefill and decode tokens/s (median of interleaved rounds), file bytes; beside the float file
and, for surgery's rows, the perplexity the simulation computed in PyTorch; and the same model in
PyTorch, float32 eager and torchao's ``quantize_`` int8 dynamic (every Linear but the head), with
the same figures by the same protocol (decode through the KV cache), timed interleaved in this
process.

llama.cpp comes from llama-cpp-python built from its source distribution in
``benchmarks/.venv-llama_cpp``, its ``llama-imatrix`` and ``llama-quantize`` built with cmake from
the llama.cpp inside that distribution (both made on first use by ``peer_venvs.py``; the build
times are printed). ``--model tinyllama_wide`` (the tiny Llama at width 256, trained on first use)
is the model whose rows are whole K-quant super-blocks.

Usage::

    .venv/bin/python benchmarks/bench_gguf.py [--model tinyllama|tinyqwen3|tinyllama_wide]
        [--methods RTN,GPTQ,AutoRound] [--types Q4_0,Q5_0,Q8_0] [--threads 1]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

import surgery
from surgery import GridSpec
from surgery.analysis.metrics import perplexity
from surgery.ops.export.formats.gguf.file import write_gguf
from surgery.ops.numerics.deployment import ExportParts
from surgery.tasks.tinyllama import SHAPE, load_llama
from surgery.tasks.tinylm import token_batches, train_on_corpus
from surgery.tasks.tinyqwen3 import load_qwen3

HERE = Path(__file__).resolve().parent
RUNNER = HERE / "llama_cpp_runner.py"
WIDE = HERE / ".cache" / "tinyllama_wide"  # trained on first use, kept (gitignored)
WIDE_SHAPE = {**SHAPE, "hidden_size": 256, "intermediate_size": 768}  # every row a multiple of 256: K-quants


def load_wide_llama() -> torch.nn.Module:
    """The tiny Llama's recipe at twice its width, so every weight's rows are whole K-quant
    super-blocks of 256 (the shipped model's 128 are not): trained on the same corpus on first
    use, 600 steps of 16 windows (a fifth of the shipped model's training, about ten minutes on
    two cores; the time is printed), and kept in ``benchmarks/.cache``."""
    import transformers

    if not (WIDE / "model.safetensors").exists():
        config = transformers.LlamaConfig(**WIDE_SHAPE, architectures=["LlamaForCausalLM"])
        start = time.perf_counter()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = train_on_corpus(lambda: transformers.LlamaForCausalLM(config), 0, 600, batch_size=16, lr=3e-3)
        print(f"trained the wide tiny Llama in {time.perf_counter() - start:.0f} s", flush=True)
        model.save_pretrained(WIDE)
    return transformers.LlamaForCausalLM.from_pretrained(WIDE).eval()


MODELS = {"tinyllama": load_llama, "tinyqwen3": load_qwen3, "tinyllama_wide": load_wide_llama}
TYPES = ("Q4_0", "Q5_0", "Q8_0")
METHODS = {  # bits and grid are the target's; the method is ours
    "RTN": "rtn",
    "GPTQ": "gptq",
    "AutoRound": surgery.AutoRoundSettings(iterations=200),
}


def runner(python: Path, *args: str) -> str:
    result = subprocess.run([str(python), str(RUNNER), *args], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"llama_cpp_runner {args[0]} failed ({result.returncode}): {result.stderr[-2000:]}")
    return result.stdout


def ours(load: object, method: str, kind: str, calibration: list, path: Path) -> tuple[float, float]:
    """Surgery's ``method`` on ``kind``'s grid, exported to ``path``: (seconds, simulated held-out perplexity)."""
    model = load()
    samples = [w[None] for b in calibration for w in b] if method == "AutoRound" else calibration
    start = time.perf_counter()
    handle = surgery.quantize(
        model,
        weights=GridSpec(bits=4),
        method=METHODS[method],
        target=f"gguf:{kind}",
        calibration=samples,
        exclude="lm_head",
        progress=False,
    )
    seconds = time.perf_counter() - start
    surgery.export(handle, path, format="gguf")
    return seconds, perplexity(model, token_batches("test", 16))


def pytorch_rows(load: object, windows: np.ndarray, held_out: list, rounds: int) -> list[dict]:
    """The model in PyTorch, float32 eager and torchao's int8 dynamic (``quantize_``, every Linear
    but the head): bytes, held-out perplexity, prefill and decode tokens/s by llama.cpp's protocol
    (one window at once; one token after a one-token prompt, through the KV cache), interleaved."""
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_

    eager, int8 = load(), load()
    quantize_(
        int8,
        Int8DynamicActivationInt8WeightConfig(),
        filter_fn=lambda m, name: isinstance(m, nn.Linear) and name != "lm_head",
    )
    models = {"PyTorch float32, eager": eager, "torchao quantize_ int8 dynamic (PyTorch)": int8}
    window = torch.from_numpy(windows[0, :-1]).long()
    prefill: dict[str, list[float]] = {name: [] for name in models}
    decode: dict[str, list[float]] = {name: [] for name in models}
    with torch.no_grad():
        for _ in range(rounds + 1):  # the first round warms up
            for name, model in models.items():
                prefill[name].append(_seconds(lambda: model(window[None])))
                decode[name].append(_decode_seconds(model, window))
    rows = []
    for name, model in models.items():
        buffer = io.BytesIO()
        torch.save(model.state_dict(), buffer)
        rows.append(
            {
                "setting": name,
                "bytes": buffer.getbuffer().nbytes,
                "perplexity": perplexity(model, held_out),
                "prefill_tokens_per_s": len(window) / statistics.median(prefill[name][1:]),
                "decode_tokens_per_s": (len(window) - 1) / statistics.median(decode[name][1:]),
            }
        )
    return rows


def _seconds(work: object) -> float:
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


def _decode_seconds(model: nn.Module, window: torch.Tensor) -> float:
    """Seconds for ``len(window) - 1`` greedy single-token steps after a one-token prompt."""
    out = model(window[None, :1], use_cache=True)
    start = time.perf_counter()
    for _ in range(len(window) - 1):
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        out = model(token, cache=out.cache, use_cache=True)
    return time.perf_counter() - start


def importance_matrix(tools: Path, work: Path, calibration: list) -> Path:
    """``llama-imatrix`` over the float file on surgery's calibration windows (their bytes as the
    text, which the byte vocabulary tokenizes back to the same ids), one chunk a window."""
    text = work / "calibration.txt"
    text.write_bytes(bytes(torch.cat([batch.reshape(-1) for batch in calibration]).tolist()))
    found = work / "imatrix.gguf"
    context = str(calibration[0].shape[1])
    command = [str(tools / "llama-imatrix"), "-m", str(work / "float.gguf"), "-f", str(text), "-o", str(found)]
    tool(*command, "-c", context, "-b", context, "-t", "1")
    return found


def quantize_with_imatrix(tools: Path, source: Path, target: Path, kind: str, imatrix: Path) -> None:
    """``llama-quantize`` with the importance matrix: every Linear but the head as ``kind`` (as the
    binding's ``pure`` run), the head and embeddings F32."""
    ftype = {"Q3_K": "Q3_K_S", "Q4_K": "Q4_K_S", "Q5_K": "Q5_K_S"}.get(kind, kind)
    flags = ["--imatrix", str(imatrix), "--pure", "--output-tensor-type", "f32", "--token-embedding-type", "f32"]
    tool(str(tools / "llama-quantize"), *flags, str(source), str(target), ftype, "1")


def tool(*command: str) -> None:
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"{Path(command[0]).name} failed ({result.returncode}): {result.stderr[-2000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=list(MODELS), default="tinyllama")
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated: RTN,GPTQ,AutoRound")
    parser.add_argument("--types", default=",".join(TYPES))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="llama.cpp's and PyTorch's threads")
    options = parser.parse_args()
    torch.set_num_threads(options.threads)
    os.environ["LLAMA_CPP_THREADS"] = str(options.threads)  # the runner's
    from peer_venvs import llama_cpp_tools, peer_python  # beside this script

    python = peer_python("llama_cpp")
    tools = llama_cpp_tools()
    load = MODELS[options.model]
    held_out = token_batches("test", 16)
    windows = np.concatenate([np.concatenate([x, y[:, -1:]], axis=1) for x, y in held_out])
    calibration = [x for x, _ in token_batches("train", 8, limit_batches=4)]
    work = Path(tempfile.mkdtemp(prefix="bench_gguf_"))
    np.save(work / "windows.npy", windows.astype(np.int64))
    rows: dict[str, dict] = {}
    write_gguf(ExportParts(load()), work / "float.gguf", {})
    rows["float.gguf"] = {"setting": "float32 (F32 tensors)", "simulated": perplexity(load(), held_out)}
    imatrix = importance_matrix(tools, work, calibration)
    for kind in options.types.split(","):
        name = f"llama.cpp-{kind}.gguf"
        runner(python, "quantize", str(work / "float.gguf"), str(work / name), kind)
        rows[name] = {"setting": f"llama.cpp's quantize, {kind}"}
        name = f"llama.cpp-imatrix-{kind}.gguf"
        quantize_with_imatrix(tools, work / "float.gguf", work / name, kind, imatrix)
        rows[name] = {"setting": f"llama.cpp's quantize with its imatrix, {kind}"}
        for method in options.methods.split(","):
            name = f"surgery-{method}-{kind}.gguf"
            seconds, simulated = ours(load, method, kind, calibration, work / name)
            rows[name] = {"setting": f"surgery {method}, {kind}", "simulated": simulated, "seconds": seconds}
    measured = json.loads(
        runner(
            python, "measure", str(work / "windows.npy"), str(options.rounds), *[str(work / name) for name in rows]
        ).splitlines()[-1]
    )
    pytorch = pytorch_rows(load, windows, held_out, options.rounds)
    threads = "one thread" if options.threads == 1 else f"{options.threads} threads"
    print(f"\n{options.model}: {len(windows)} held-out windows of {windows.shape[1] - 1} tokens, {threads}")
    print("| file | bytes | perplexity (llama.cpp) | simulated (PyTorch) | prefill tok/s | decode tok/s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for found in measured:
        row = rows[found["file"]]
        simulated = f"{row['simulated']:.3f}" if "simulated" in row else "–"
        print(
            f"| {row['setting']} | {found['bytes']:,} | {found['perplexity']:.3f} | {simulated} "
            f"| {found['prefill_tokens_per_s']:,.0f} | {found['decode_tokens_per_s']:,.0f} |"
        )
    for found in pytorch:
        print(
            f"| {found['setting']} | {found['bytes']:,} | {found['perplexity']:.3f} | – "
            f"| {found['prefill_tokens_per_s']:,.0f} | {found['decode_tokens_per_s']:,.0f} |"
        )


if __name__ == "__main__":
    main()
