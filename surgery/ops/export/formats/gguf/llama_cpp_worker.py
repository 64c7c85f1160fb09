"""llama.cpp's logits for token ids, through llama-cpp-python: imported by surgery where
``llama_cpp`` is installed beside it, or run as a script by another Python that has it
(``SURGERY_LLAMA_CPP_PYTHON``). It imports numpy and llama_cpp only, so that Python needs
neither torch nor surgery.

As a script: ``python llama_cpp_worker.py MODEL.gguf``, then one request a line on stdin,
``{"ids": IDS.json, "out": OUT.npy}``; each answered ``ok`` (or ``error: ...``) on stdout once
the logits, float32 (sequences, length, vocabulary), are saved.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np


def plain_buffers() -> None:
    """Every weight in llama.cpp's plain CPU buffer: its extra buffer types (AMX tiles, repacked
    Q4_0/Q8_0 layouts) off. llama.cpp 0c1e570, built for an AVX-512 VM, crashed in the first
    decode of any Q4_0 or Q8_0 file with them on (its own quantization's included); F32 and Q5_0
    files ran either way. The plain buffers run the same kernels as the file type's own."""
    import llama_cpp.llama_cpp as raw  # the bindings module Llama reads its defaults from

    default = raw.llama_model_default_params
    if getattr(default, "plain", False):
        return

    def params() -> object:
        found = default()
        found.use_extra_bufts = False
        return found

    params.plain = True
    raw.llama_model_default_params = params


def open_model(path: str, length: int, threads: int | None = None, logits_all: bool = True) -> Any:
    """``path`` in llama.cpp, with room for ``length`` tokens (every position's logits kept)."""
    from llama_cpp import Llama

    plain_buffers()
    return Llama(model_path=path, n_ctx=length, n_batch=length, logits_all=logits_all, n_threads=threads, verbose=False)


def logits(llm: Any, sequences: list[list[int]]) -> np.ndarray:
    """Every position's logits of each sequence (one length), each evaluated from an empty cache."""
    found = []
    for ids in sequences:
        llm.reset()
        llm.eval(ids)
        found.append(np.array(llm.scores[: llm.n_tokens], dtype=np.float32))
    return np.stack(found)


class Session:
    """One GGUF file kept open in llama.cpp, reopened when a longer sequence comes."""

    def __init__(self, path: str, threads: int | None = None) -> None:
        self.path, self.threads, self.llm, self.length = path, threads, None, 0

    def logits(self, sequences: list[list[int]]) -> np.ndarray:
        length = len(sequences[0])
        if self.llm is None or length > self.length:
            self.llm, self.length = open_model(self.path, length, self.threads), length
        return logits(self.llm, sequences)


def serve(model_path: str) -> None:
    session = Session(model_path)
    for line in sys.stdin:
        try:
            request = json.loads(line)
            np.save(request["out"], session.logits(json.loads(Path(request["ids"]).read_text())))
            answer = "ok"
        except Exception as err:  # noqa: BLE001 - the caller reports it in one line
            answer = f"error: {type(err).__name__}: {err}".splitlines()[0]
        print(answer, flush=True)


if __name__ == "__main__":
    serve(sys.argv[1])
