"""llama.cpp through llama-cpp-python, in its own virtual environment (made by ``peer_venvs.py``):
run by the GGUF tests and ``bench_gguf.py``, as ``autoround_quality.py`` runs auto-round.

Usage::

    PY=benchmarks/.venv-llama_cpp/bin/python
    $PY benchmarks/llama_cpp_runner.py logits MODEL.gguf IDS.json OUT.npy
    $PY benchmarks/llama_cpp_runner.py quantize F32.gguf OUT.gguf TYPE
    $PY benchmarks/llama_cpp_runner.py measure WINDOWS.npy ROUNDS MODEL.gguf [MODEL.gguf ...]
    $PY benchmarks/llama_cpp_runner.py tokenize MODEL.gguf TEXTS.json OUT.json

- ``logits``: every position's logits of each sequence in ``IDS.json`` (one length), each
  evaluated from an empty cache, saved as (sequences, length, vocabulary) float32.
- ``quantize``: llama.cpp's own quantization (``llama_model_quantize``, its ``llama-quantize``
  without an importance matrix: round to nearest) of a float GGUF to ``TYPE`` (``Q4_0``,
  ``Q5_0``, ``Q8_0``), every tensor of that type (``pure``) but the embeddings and the output
  head, which stay F32 as surgery's exports keep them, so the two files hold the same tensors.
- ``measure``: for each file, held-out perplexity over the windows (``WINDOWS.npy``: int64
  (windows, length + 1), each window's inputs and its next token), prefill tokens/s (one window
  at once) and decode tokens/s (one token at a time after a one-token prompt, ``length``
  steps), one thread (``LLAMA_CPP_THREADS``: more), the files' timing rounds interleaved; the last
  line printed is a JSON list.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "surgery" / "ops" / "export" / "formats" / "gguf"))
import llama_cpp_worker  # noqa: E402 - surgery's own llama.cpp calls, without importing surgery (no torch here)

THREADS = int(os.environ.get("LLAMA_CPP_THREADS", "1"))  # bench_gguf.py --threads sets it


def open_model(path: str, length: int, logits_all: bool) -> object:
    return llama_cpp_worker.open_model(path, length, THREADS, logits_all)


def tokenize(model_path: str, texts_file: str, out_file: str) -> None:
    """The ids llama.cpp's tokenizer gives each text of ``TEXTS.json`` (no bos added, special
    tokens parsed as text), from the file's vocabulary alone."""
    from llama_cpp import Llama

    llama_cpp_worker.plain_buffers()
    llm = Llama(model_path=model_path, vocab_only=True, verbose=False)
    texts = json.loads(Path(texts_file).read_text())
    found = [llm.tokenize(text.encode(), add_bos=False, special=False) for text in texts]
    Path(out_file).write_text(json.dumps(found))


def logits(model_path: str, ids_file: str, out_file: str) -> None:
    sequences = json.loads(Path(ids_file).read_text())
    np.save(out_file, llama_cpp_worker.logits(open_model(model_path, len(sequences[0]), True), sequences))


FTYPES = {
    "Q3_K": "Q3_K_S",
    "Q4_K": "Q4_K_S",
    "Q5_K": "Q5_K_S",
}  # the file type whose tensors are all that type (with pure)


def quantize(source: str, target: str, kind: str) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{FTYPES.get(kind, kind)}")
    params.pure = True
    params.output_tensor_type = llama_cpp.GGML_TYPE_F32
    params.token_embedding_type = llama_cpp.GGML_TYPE_F32
    params.nthread = THREADS
    failed = llama_cpp.llama_model_quantize(source.encode(), target.encode(), params)
    if failed:
        raise SystemExit(f"llama_model_quantize failed ({failed}) on {source}")


def perplexity(llm: object, windows: np.ndarray) -> float:
    total, count = 0.0, 0
    for window in windows:
        llm.reset()
        llm.eval(window[:-1].tolist())
        scores = np.array(llm.scores[: llm.n_tokens], dtype=np.float64)
        shifted = scores - scores.max(-1, keepdims=True)
        log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
        total -= log_probs[np.arange(len(window) - 1), window[1:]].sum()
        count += len(window) - 1
    return float(np.exp(total / count))


def prefill_seconds(llm: object, window: np.ndarray) -> float:
    llm.reset()
    start = time.perf_counter()
    llm.eval(window.tolist())
    return time.perf_counter() - start


def decode_seconds(llm: object, window: np.ndarray) -> float:
    """Seconds for ``len(window) - 1`` single-token steps after a one-token prompt (greedy)."""
    llm.reset()
    llm.eval([int(window[0])])
    start = time.perf_counter()
    for _ in range(len(window) - 1):
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        llm.eval([token])
    return time.perf_counter() - start


def measure(windows_file: str, rounds: int, paths: list[str]) -> None:
    windows = np.load(windows_file)
    length = windows.shape[1] - 1
    found = []
    for path in paths:  # perplexity: every position's logits kept
        llm = open_model(path, length, True)
        found.append(
            {"file": os.path.basename(path), "bytes": os.path.getsize(path), "perplexity": perplexity(llm, windows)}
        )
        del llm
    timers = [open_model(path, length, False) for path in paths]
    prefill = [[] for _ in paths]
    decode = [[] for _ in paths]
    for _ in range(rounds):  # interleaved: each round times every file once
        for index, llm in enumerate(timers):
            prefill[index].append(prefill_seconds(llm, windows[0, :-1]))
            decode[index].append(decode_seconds(llm, windows[0, :-1]))
    for row, first, step in zip(found, prefill, decode):
        row["prefill_tokens_per_s"] = length / float(np.median(first))
        row["decode_tokens_per_s"] = (length - 1) / float(np.median(step))
    print(json.dumps(found))


def main() -> None:
    command, *args = sys.argv[1:]
    if command == "logits":
        logits(*args)
    elif command == "quantize":
        quantize(*args)
    elif command == "tokenize":
        tokenize(*args)
    elif command == "measure":
        measure(args[0], int(args[1]), args[2:])
    else:
        raise SystemExit(f"unknown command {command!r}: logits, quantize or measure")


if __name__ == "__main__":
    main()
