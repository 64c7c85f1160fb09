"""A written GGUF file run by llama.cpp itself, for ``report.json`` ``deploy``: its logits on the
export's token ids against the simulation's, and the task's metric (held-out perplexity) computed
from llama.cpp's logits.

llama.cpp comes from llama-cpp-python: imported where it is installed beside surgery, or run by
another Python that has it, named by ``SURGERY_LLAMA_CPP_PYTHON`` (it needs numpy and
llama_cpp only). Neither: the section says so in one line and nothing else changes.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import queue
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from surgery.core.errors import first_line
from surgery.ops.export.formats import llama_cpp_worker

PYTHON_VARIABLE = "SURGERY_LLAMA_CPP_PYTHON"
WORKER = Path(llama_cpp_worker.__file__)
# llama.cpp rounds each activation to 8 bits per block before its integer dot products and
# caches keys and values in F16, so it is not bit for bit. Measured on the shipped tiny Llama,
# Qwen3 and Qwen3-MoE and a width-256 Llama, every type from Q3_K to F32: mean cosine 0.9997 or
# more, the same next token at 95 % or more of positions. A wrong scale, block or row order
# falls far below both.
COSINE_BOUND = 0.999
AGREEMENT_BOUND = 0.93
WORKER_TIMEOUT = 600.0  # seconds for one answer: llama.cpp loading the file and running a batch


class LlamaCppError(RuntimeError):
    """llama.cpp was reached but did not run the file (it failed, hung or exited): one line."""


class LlamaCpp(nn.Module):
    """A GGUF file in llama.cpp seen as a causal LM: ``forward(ids)`` (batch, length) gives its
    logits (batch, length, vocabulary), float32, on the ids' device; in this process
    (``python=None``) or in a worker run by ``python``, each answer awaited at most ``timeout``
    seconds. Whatever stops it is a :class:`LlamaCppError`. Close it (or use ``with``): the
    worker ends (killed if it does not) and its folder goes."""

    def __init__(self, path: Path, python: str | None = None, timeout: float = WORKER_TIMEOUT) -> None:
        super().__init__()
        self.path, self.python, self.timeout = Path(path), python, timeout
        self.session = llama_cpp_worker.Session(str(path)) if python is None else None
        self.folder = tempfile.TemporaryDirectory(prefix="surgery-llama-cpp-")
        self.worker: subprocess.Popen | None = None
        self.answers: queue.Queue[str] = queue.Queue()
        self.log = Path(self.folder.name) / "stderr.txt"

    def forward(self, ids: Tensor) -> Tensor:
        if ids.numel() == 0:
            raise LlamaCppError(f"llama.cpp was given no token to run {self.path.name} on")
        sequences = ids.reshape(-1, ids.shape[-1]).tolist()
        try:
            found = self.session.logits(sequences) if self.session is not None else self._from_worker(sequences)
        except LlamaCppError:
            raise
        except Exception as err:  # llama_cpp's own (a file it cannot load), or the worker's pipes
            raise LlamaCppError(
                f"llama.cpp ({self.python or 'llama_cpp here'}) did not run {self.path.name}: "
                f"{type(err).__name__}: {first_line(err)}"
            ) from err
        return torch.from_numpy(found).reshape(*ids.shape, -1).to(ids.device)  # where the ids came from

    def _from_worker(self, sequences: list[list[int]]) -> np.ndarray:
        folder = Path(self.folder.name)
        if self.worker is None:
            with open(self.log, "w") as errors:
                self.worker = subprocess.Popen(
                    [self.python, str(WORKER), str(self.path)],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=errors,
                    text=True,
                )
            threading.Thread(target=_read_lines, args=(self.worker.stdout, self.answers), daemon=True).start()
        (folder / "out.npy").unlink(missing_ok=True)
        (folder / "ids.json").write_text(json.dumps(sequences))
        self.worker.stdin.write(json.dumps({"ids": str(folder / "ids.json"), "out": str(folder / "out.npy")}) + "\n")
        self.worker.stdin.flush()
        try:
            answer = self.answers.get(timeout=self.timeout).strip()
        except queue.Empty:
            raise LlamaCppError(
                f"llama.cpp ({self.python}) gave no answer on {self.path.name} within {self.timeout:.0f} s"
            ) from None
        if answer != "ok":
            said = answer or (self.log.read_text().strip().splitlines() or ["it exited"])[-1]
            raise LlamaCppError(f"llama.cpp ({self.python}) did not run {self.path.name}: {said}")
        if not (folder / "out.npy").is_file():
            raise LlamaCppError(f"llama.cpp ({self.python}) answered ok on {self.path.name} but wrote no logits")
        return np.load(folder / "out.npy")

    def close(self) -> None:
        worker, self.worker, self.session = self.worker, None, None
        try:
            if worker is not None:
                with contextlib.suppress(OSError):
                    worker.stdin.close()
                try:
                    worker.wait(timeout=min(10.0, self.timeout))
                except subprocess.TimeoutExpired:
                    worker.kill()
                    worker.wait()
        finally:
            self.folder.cleanup()

    def __enter__(self) -> LlamaCpp:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _read_lines(stream: Any, answers: queue.Queue) -> None:
    for line in stream:
        answers.put(line)
    answers.put("")  # the worker ended: an empty answer


def llama_cpp_python() -> str | None:
    """How llama.cpp is reached: None in this process; else the Python named by
    ``SURGERY_LLAMA_CPP_PYTHON``. Not installed, none named: :class:`LookupError` (not asked
    for); named but no file: :class:`LlamaCppError` (asked for, and failed)."""
    named = os.environ.get(PYTHON_VARIABLE)
    if named:
        if not Path(named).is_file():
            raise LlamaCppError(f"{PYTHON_VARIABLE}={named} is not a file")
        return named
    if importlib.util.find_spec("llama_cpp") is not None:
        return None
    raise LookupError(f"llama-cpp-python is not installed here (pip install llama-cpp-python, or {PYTHON_VARIABLE})")


def llama_cpp_summary(
    path: Path, simulation: nn.Module, inputs: list, metric: tuple[str, Callable[[nn.Module], float], bool] | None
) -> dict[str, Any]:
    """``deploy.llama_cpp``: llama.cpp's logits on the first batch of ``inputs`` against
    ``simulation``'s (cosine per position, mean and smallest; the share of equal next tokens),
    whether they keep :data:`COSINE_BOUND` and :data:`AGREEMENT_BOUND` (``holds``), and the
    task's ``metric`` from llama.cpp's logits; a one-line ``skipped`` where llama.cpp is not
    there, ``error`` (and ``holds: False``) where it is but does not run the file."""
    try:
        python = llama_cpp_python()
    except LookupError as err:
        return {"skipped": str(err)}
    except LlamaCppError as err:
        return {"holds": False, "error": str(err), "expected": "llama.cpp runs the file"}
    ids = _token_ids(inputs[0]) if inputs else None
    if ids is None:
        return {"skipped": "the export's inputs are not token ids (a tensor or input_ids without padding)"}
    try:
        with LlamaCpp(path, python) as runtime, torch.no_grad():
            return _compared(runtime, simulation, ids, metric)
    except LlamaCppError as err:  # asked for (a Python named, or llama_cpp installed) and failed: a failed check
        return {"holds": False, "error": str(err), "expected": "llama.cpp runs the file"}


def _compared(runtime: LlamaCpp, simulation: nn.Module, ids: Tensor, metric: Any) -> dict[str, Any]:
    found = runtime(ids).double().cpu()
    expected = simulation(ids)
    expected = getattr(expected, "logits", expected).double().cpu()
    cosine = torch.nn.functional.cosine_similarity(found, expected, dim=-1)
    agreement = (found.argmax(-1) == expected.argmax(-1)).double().mean().item()
    figures = {
        "cosine_mean": cosine.mean().item(),
        "cosine_min": cosine.min().item(),
        "top1_agreement": agreement,
        "holds": bool(cosine.mean().item() >= COSINE_BOUND and agreement >= AGREEMENT_BOUND),  # NaN fails
        "expected": f"cosine mean>={COSINE_BOUND}, top-1 agreement>={AGREEMENT_BOUND}",
    }
    if metric is not None:
        figures[metric[0]] = metric[1](runtime)
    return figures


def _token_ids(batch: Any) -> Tensor | None:
    if isinstance(batch, dict):
        mask = batch.get("attention_mask")
        if mask is not None and not bool(torch.as_tensor(mask).all()):
            return None
        batch = batch.get("input_ids")
    if isinstance(batch, (tuple, list)) and batch:
        batch = batch[0]
    if not isinstance(batch, Tensor) or batch.is_floating_point() or batch.dim() not in (1, 2):
        return None
    return batch if batch.dim() == 2 else batch[None]
