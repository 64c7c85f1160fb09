"""A written GGUF file run by llama.cpp itself, for ``report.json`` ``deploy``: its logits on the
export's token ids against the simulation's, and the task's metric (held-out perplexity) computed
from llama.cpp's logits.

llama.cpp comes from llama-cpp-python: imported where it is installed beside surgery, or run by
another Python that has it, named by ``SURGERY_LLAMA_CPP_PYTHON`` (it needs numpy and
llama_cpp only). Neither: the section says so in one line and nothing else changes.
``SURGERY_LLAMA_CPP_TIMEOUT`` bounds the whole measurement (seconds; 300 by default).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import queue
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from surgery.core.errors import first_line
from surgery.core.interrupts import raise_pending
from surgery.ops.export.formats.gguf import llama_cpp_worker

PYTHON_VARIABLE = "SURGERY_LLAMA_CPP_PYTHON"
WORKER = Path(llama_cpp_worker.__file__)
# llama.cpp rounds each activation to 8 bits per block before its integer dot products and
# caches keys and values in F16, so it is not bit for bit. Measured on the shipped tiny Llama,
# Qwen3 and Qwen3-MoE and a width-256 Llama, every type from Q3_K to F32: mean cosine 0.9997 or
# more, the same next token at 95 % or more of positions. A wrong scale, block or row order
# falls far below both.
COSINE_BOUND = 0.999
AGREEMENT_BOUND = 0.93
TIMEOUT_VARIABLE = "SURGERY_LLAMA_CPP_TIMEOUT"
MEASUREMENT_TIMEOUT = 300.0  # seconds for the whole measurement: loading, the comparison, the perplexity pass


class LlamaCppError(RuntimeError):
    """llama.cpp was reached but did not run the file (it failed, hung, exited, ran out of time or
    answered what logits cannot be): one line."""


class LlamaCppTimeout(LlamaCppError):
    """The whole llama.cpp measurement ran past its bound (:data:`TIMEOUT_VARIABLE`)."""


class LlamaCppAnswerError(LlamaCppError):
    """llama.cpp (or the worker standing for it) answered with something that is not the logits
    asked for: another shape, a dtype that is not floating point, NaN or Inf."""


class LlamaCpp(nn.Module):
    """A GGUF file in llama.cpp seen as a causal LM: ``forward(ids)`` (batch, length) gives its
    logits (batch, length, vocabulary), float32, on the ids' device; in this process
    (``python=None``) or in a worker run by ``python``. ``timeout`` bounds every answer together,
    from the moment it is made (one deadline for the whole measurement); ``vocabulary``, once
    set, is the last axis every answer must have. Every answer is checked (shape, dtype, finite).
    Whatever stops it is a :class:`LlamaCppError`. Close it (or use ``with``): the worker ends
    (killed if it does not, at once past the deadline) and its folder goes."""

    def __init__(self, path: Path, python: str | None = None, timeout: float = MEASUREMENT_TIMEOUT) -> None:
        super().__init__()
        self.path, self.python, self.timeout = Path(path), python, timeout
        self.deadline = time.monotonic() + timeout
        self.doing = "loading"  # what the measurement is at, for the line that says the bound ran out
        self.vocabulary: int | None = None
        self.session = llama_cpp_worker.Session(str(path)) if python is None else None
        self.folder = tempfile.TemporaryDirectory(prefix="surgery-llama-cpp-")
        self.worker: subprocess.Popen | None = None
        self.answers: queue.Queue[str] = queue.Queue()
        self.log = Path(self.folder.name) / "stderr.txt"

    def forward(self, ids: Tensor) -> Tensor:
        if ids.numel() == 0:
            raise LlamaCppError(f"llama.cpp was given no token to run {self.path.name} on")
        sequences = ids.reshape(-1, ids.shape[-1]).tolist()
        if time.monotonic() >= self.deadline:  # in this process an answer cannot be cut short: checked between
            raise self._ran_out()
        try:
            found = self.session.logits(sequences) if self.session is not None else self._from_worker(sequences)
        except LlamaCppError:
            raise
        except Exception as err:  # llama_cpp's own (a file it cannot load), or the worker's pipes
            raise LlamaCppError(
                f"llama.cpp ({self.python or 'llama_cpp here'}) did not run {self.path.name}: {first_line(err)}"
            ) from err
        found = self._checked(found, (len(sequences), ids.shape[-1]))
        return torch.from_numpy(found).reshape(*ids.shape, -1).to(ids.device)  # where the ids came from

    def _checked(self, found: Any, asked: tuple[int, int]) -> np.ndarray:
        """``found`` as float32 logits of ``asked`` (sequences, length) and the vocabulary, or a
        :class:`LlamaCppAnswerError` saying what it is instead."""
        said = f"llama.cpp ({self.python or 'llama_cpp here'}) answered on {self.path.name} with"
        if not isinstance(found, np.ndarray) or found.dtype.kind != "f":
            kind = found.dtype if isinstance(found, np.ndarray) else type(found).__name__
            raise LlamaCppAnswerError(f"{said} {kind} values, not floating-point logits")
        vocabulary = self.vocabulary or (found.shape[-1] if found.ndim == 3 else 0)
        if found.shape != (*asked, vocabulary) or vocabulary < 1:
            wanted = f"({asked[0]}, {asked[1]}, {self.vocabulary or 'vocabulary'})"
            raise LlamaCppAnswerError(f"{said} logits of shape {tuple(found.shape)}, not {wanted}")
        finite = np.isfinite(found)
        if not finite.all():
            sequence, position, _ = np.argwhere(~finite)[0]
            raise LlamaCppAnswerError(
                f"{said} {int((~finite).sum())} NaN or Inf logits of {found.size} "
                f"(first at sequence {sequence}, position {position})"
            )
        return found.astype(np.float32, copy=False)

    def _ran_out(self) -> LlamaCppTimeout:
        return LlamaCppTimeout(
            f"llama.cpp ({self.python or 'llama_cpp here'}) gave no answer on {self.path.name} within "
            f"{self.timeout:g} s ({TIMEOUT_VARIABLE}, the bound of the whole llama.cpp measurement, ran out "
            f"in the {self.doing})"
        )

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
        answer = self._answer().strip()
        if answer != "ok":
            said = answer or self._exited()
            raise LlamaCppError(f"llama.cpp ({self.python}) did not run {self.path.name}: {said}")
        if not (folder / "out.npy").is_file():
            raise LlamaCppError(f"llama.cpp ({self.python}) answered ok on {self.path.name} but wrote no logits")
        return np.load(folder / "out.npy", allow_pickle=False)

    def _answer(self) -> str:
        """The worker's next line, awaited until the deadline (in short waits, so that an interrupt
        is taken at once)."""
        while True:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise self._ran_out()
            try:
                return self.answers.get(timeout=min(left, 0.5))
            except queue.Empty:
                raise_pending()

    def _exited(self) -> str:
        """What an ended worker left: its exit code and its last line on stderr."""
        code = self.worker.poll() if self.worker is not None else None
        last = (self.log.read_text(errors="replace").strip().splitlines() or [""])[-1]
        ended = "it closed its output (still running)" if code is None else f"it exited (code {code})"
        return ended + (f": {last}" if last else "")

    def close(self) -> None:
        worker, self.worker, self.session = self.worker, None, None
        try:
            if worker is not None:
                with contextlib.suppress(OSError):
                    worker.stdin.close()
                try:
                    worker.wait(timeout=min(10.0, max(self.deadline - time.monotonic(), 0.0)))
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


def llama_cpp_timeout() -> float:
    """The bound of the whole llama.cpp measurement in seconds: ``SURGERY_LLAMA_CPP_TIMEOUT``, or
    :data:`MEASUREMENT_TIMEOUT`; anything but a positive number is a :class:`LlamaCppError`."""
    named = os.environ.get(TIMEOUT_VARIABLE)
    if not named:
        return MEASUREMENT_TIMEOUT
    try:
        seconds = float(named)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or seconds <= 0:
        raise LlamaCppError(f"{TIMEOUT_VARIABLE}={named} must be a positive number of seconds")
    return seconds


def llama_cpp_summary(
    path: Path, simulation: nn.Module, inputs: list, metric: tuple[str, Callable[[nn.Module], float], bool] | None
) -> dict[str, Any]:
    """``deploy.llama_cpp``: llama.cpp's logits on the first batch of ``inputs`` against
    ``simulation``'s (cosine per position, mean and smallest; the share of equal next tokens),
    whether they keep :data:`COSINE_BOUND` and :data:`AGREEMENT_BOUND` (``holds``), and the
    task's ``metric`` from llama.cpp's logits, all within ``SURGERY_LLAMA_CPP_TIMEOUT`` seconds;
    a one-line ``skipped`` where llama.cpp is not there, ``error`` (and ``holds: False``) where it
    is but does not run the file, runs out of time or answers what logits cannot be."""
    try:
        python = llama_cpp_python()
        timeout = llama_cpp_timeout()
    except LookupError as err:
        return {"skipped": str(err)}
    except LlamaCppError as err:
        return {"holds": False, "error": str(err), "expected": "llama.cpp runs the file"}
    ids = _token_ids(inputs[0]) if inputs else None
    if ids is None:
        return {"skipped": "the export's inputs are not token ids (a tensor or input_ids without padding)"}
    try:
        with LlamaCpp(path, python, timeout) as runtime, torch.no_grad():
            return _compared(runtime, simulation, ids, metric)
    except LlamaCppError as err:  # asked for (a Python named, or llama_cpp installed) and failed: a failed check
        return {"holds": False, "error": str(err), "expected": _expected(err, timeout)}


def _expected(err: LlamaCppError, timeout: float) -> str:
    if isinstance(err, LlamaCppTimeout):
        return f"llama.cpp measures the file within {TIMEOUT_VARIABLE}={timeout:g} s"
    if isinstance(err, LlamaCppAnswerError):
        return "llama.cpp answers finite floating-point logits of (sequences, length, vocabulary)"
    return "llama.cpp runs the file"


def _compared(runtime: LlamaCpp, simulation: nn.Module, ids: Tensor, metric: Any) -> dict[str, Any]:
    expected = simulation(ids)
    expected = getattr(expected, "logits", expected).double().cpu()
    runtime.vocabulary, runtime.doing = expected.shape[-1], "comparison"
    found = runtime(ids).double().cpu()
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
        runtime.doing = "perplexity pass"
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
