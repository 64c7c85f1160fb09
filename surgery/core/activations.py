"""One block's calibration activations, held in memory up to a budget and spilled to disk beyond it.

A sequential pass (:mod:`surgery.core.sequential`, and the offloaded one) keeps, for every
calibration batch, the call one block receives, and makes the next block's from its outputs.
With many long sequences these caches outgrow memory (512 sequences of 2,048 tokens at width
4,096 are 17 GB a block). :class:`BlockCalls` holds them batch by batch: in memory while the
pass's *ledger* has room, and beyond that in a file per batch under a temporary folder, read
back one batch at a time when the block runs. The pass's two caches (a block's inputs, the next
block's as they are made) draw on the same ledger.

The budget is :func:`activation_budget`'s, or by default a quarter of the memory available when
the pass starts. Spilled files go to ``folder`` (default: the system's temporary folder) and are
removed once the cache that wrote them, and every call read from it, are gone.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from surgery.core.errors import ConfigError
from surgery.core.inputs import Call

Args = tuple[tuple, dict]


@dataclass
class Ledger:
    """The bytes of cached activations a pass may hold in memory, and those it holds."""

    limit: int
    folder: Path | None = None
    held: int = 0
    spilled: int = 0  # bytes written to disk so far in the pass
    peak_held: int = 0
    cleanups: list[weakref.finalize] = field(default_factory=list, repr=False)  # run when the pass ends

    def take(self, nbytes: int) -> bool:
        """Reserve ``nbytes`` if they fit under the limit."""
        if self.held + nbytes > self.limit:
            return False
        self.held += nbytes
        self.peak_held = max(self.peak_held, self.held)
        return True

    def give_back(self, nbytes: int) -> None:
        self.held -= nbytes


_active: ContextVar[Ledger | None] = ContextVar("surgery_activation_budget", default=None)


@contextmanager
def activation_budget(max_bytes: int | None = None, *, folder: str | Path | None = None) -> Iterator[Ledger]:
    """Within the block, sequential passes hold at most ``max_bytes`` of calibration
    activations in memory and write the rest to files under ``folder`` (``0``: every batch to
    disk; ``None``: a quarter of the memory available now). Yields the :class:`Ledger`, whose
    ``spilled`` and ``peak_held`` say what the passes did.

    Example:
        >>> with surgery.activation_budget(2 * 1024**3, folder="/scratch"):
        ...     surgery.quantize(model, weights=GridSpec(bits=4), method="gptq", calibration=batches)
    """
    if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0):
        raise ConfigError("activation_budget.max_bytes", max_bytes, "must be null or an integer number of bytes >= 0")
    place = None if folder is None else Path(folder)
    if place is not None and not place.is_dir():
        raise ConfigError("activation_budget.folder", str(folder), "must be an existing folder")
    ledger = Ledger(available_memory() // 4 if max_bytes is None else max_bytes, place)
    token = _active.set(ledger)
    try:
        yield ledger
    finally:
        _active.reset(token)
        for cleanup in ledger.cleanups:  # the block's caches are over: their bytes back, their files gone
            cleanup()
        ledger.cleanups.clear()


def _room_on_gpu(tensors: list[Tensor], nbytes: int) -> bool:
    """Whether a batch held on a GPU fits a quarter of its free memory (the budget counts the
    host's): one that does not is written to disk as the budget's overflow is."""
    device = next((t.device for t in tensors if t.is_cuda), None)
    return device is None or nbytes <= torch.cuda.mem_get_info(device)[0] // 4


@contextmanager
def pass_ledger() -> Iterator[Ledger]:
    """The budget a pass draws on: the enclosing :func:`activation_budget`'s, or a default one.
    When the pass ends, however it ends, the caches it made give their bytes back and their
    spilled files are removed."""
    outer = _active.get()
    with nullcontext(outer) if outer is not None else activation_budget() as ledger:
        first = len(ledger.cleanups)
        try:
            yield ledger
        finally:
            for cleanup in ledger.cleanups[first:]:
                cleanup()
            del ledger.cleanups[first:]


def current_ledger() -> Ledger:
    """The enclosing pass's ledger (outside any: no limit)."""
    return _active.get() or Ledger(limit=1 << 62)


def available_memory() -> int:
    """Bytes of memory available to new allocations (``MemAvailable``; physical pages elsewhere)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 1 << 62  # unknown: never spill unless told to


def _amount(nbytes: int) -> str:
    """A number of bytes as people read it: ``512 bytes``, ``12.3 kB``, ``45 MB``."""
    if nbytes < 1000:
        return f"{nbytes} bytes"
    if nbytes < 1_000_000:
        return f"{nbytes / 1e3:.1f} kB"
    return f"{nbytes / 1e6:.0f} MB"


class _SpillFolder:
    """A temporary folder of spilled batches, removed when the last user lets go of it."""

    def __init__(self, parent: Path | None) -> None:
        self.path = Path(tempfile.mkdtemp(prefix="surgery-activations-", dir=parent))
        self.cleanup = weakref.finalize(self, shutil.rmtree, self.path, True)


@dataclass(frozen=True)
class _Slot:
    index: int


def _hollow(value: Any, tensors: list[Tensor], seen: dict[int, int]) -> Any:
    """``value`` with each tensor replaced by a slot numbering it in ``tensors`` (shared ones once)."""
    if isinstance(value, Tensor):
        if id(value) not in seen:
            seen[id(value)] = len(tensors)
            tensors.append(value)
        return _Slot(seen[id(value)])
    if isinstance(value, tuple):
        items = [_hollow(v, tensors, seen) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)  # a namedtuple too
    if isinstance(value, list):
        return [_hollow(v, tensors, seen) for v in value]
    if isinstance(value, dict):
        return type(value)((k, _hollow(v, tensors, seen)) for k, v in value.items())  # an OrderedDict too
    return value


def _fill(value: Any, tensors: list[Tensor]) -> Any:
    if isinstance(value, _Slot):
        return tensors[value.index]
    if isinstance(value, tuple):
        items = [_fill(v, tensors) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, list):
        return [_fill(v, tensors) for v in value]
    if isinstance(value, dict):
        return type(value)((k, _fill(v, tensors)) for k, v in value.items())
    return value


class SpilledCall(Call):
    """One batch's call whose tensors wait in a file: read back on every use (``args``,
    ``kwargs``, calling it), dropped after."""

    def __init__(self, folder: _SpillFolder, path: Path, hollow: Args, nbytes: int) -> None:  # noqa: D107
        for name, value in (("_folder", folder), ("path", path), ("_hollow", hollow), ("nbytes", nbytes)):
            object.__setattr__(self, name, value)

    def load(self) -> Call:
        """The call with its tensors read back into memory."""
        args, kwargs = _fill(self._hollow, torch.load(self.path, weights_only=True))
        return Call(args, kwargs)

    @property
    def args(self) -> tuple:  # type: ignore[override]
        return self.load().args

    @property
    def kwargs(self) -> dict:  # type: ignore[override]
        return dict(self.load().kwargs)

    def __call__(self, model: torch.nn.Module) -> Any:
        return self.load()(model)

    def tensors(self) -> list[Tensor]:
        return self.load().tensors()

    def __repr__(self) -> str:
        return f"SpilledCall({str(self.path)!r}, {self.nbytes} bytes)"


def _give_back(ledger: Ledger, held: list[int]) -> None:
    ledger.give_back(held[0])
    held[0] = 0


def loaded(call: Call | SpilledCall) -> Call:
    """The call with its tensors in memory."""
    return call.load() if isinstance(call, SpilledCall) else call


@dataclass
class BlockCalls:
    """A block's calls, one per calibration batch, in memory while the pass's ledger has room
    and spilled to disk beyond it. Iterating yields ``(args, kwargs)`` with the tensors loaded,
    one batch at a time."""

    ledger: Ledger
    entries: list[Call | SpilledCall] = field(default_factory=list)
    memory_bytes: int = 0
    spilled_bytes: int = 0
    _folder: _SpillFolder | None = None

    def __post_init__(self) -> None:
        self._held = [0]  # what this cache holds of the ledger, given back when it is gone
        self._release = weakref.finalize(self, _give_back, self.ledger, self._held)
        self.ledger.cleanups.append(self._release)

    def add(self, args: tuple, kwargs: dict) -> None:
        """Keep one batch's call (in memory if it fits the budget, else in a file)."""
        tensors: list[Tensor] = []
        hollow = _hollow((tuple(args), dict(kwargs)), tensors, {})
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        if _room_on_gpu(tensors, nbytes) and self.ledger.take(nbytes):
            self.entries.append(Call(tuple(args), dict(kwargs)))
            self.memory_bytes += nbytes
            self._held[0] += nbytes
            return
        self.entries.append(self._spill(hollow, tensors, nbytes))

    def adopt(self, call: Call | SpilledCall) -> None:
        """Keep a call that is already held elsewhere (in memory or in its file) as it is."""
        self.entries.append(call)

    def _spill(self, hollow: Args, tensors: list[Tensor], nbytes: int) -> SpilledCall:
        path = None
        try:
            if self._folder is None:
                self._folder = _SpillFolder(self.ledger.folder)
                self.ledger.cleanups.append(self._folder.cleanup)
            path = self._folder.path / f"batch-{len(self.entries)}.pt"
            torch.save([t.detach().contiguous() for t in tensors], path)
        except (OSError, RuntimeError) as err:
            if path is not None:
                path.unlink(missing_ok=True)
            where = self.ledger.folder if self.ledger.folder is not None else Path(tempfile.gettempdir())
            raise ConfigError(
                "activation_budget.folder",
                str(where),
                f"could not hold {_amount(nbytes)} of spilled calibration activations "
                f"({' '.join(str(err).split())[:100]}); free space or name another folder",
            ) from None
        self.spilled_bytes += nbytes
        self.ledger.spilled += nbytes
        return SpilledCall(self._folder, path, hollow, nbytes)

    def close(self) -> None:
        """Let go of every batch (the ledger gets their bytes back; spilled files go with the
        last call read from them)."""
        self.entries.clear()
        self._release()

    def calls(self) -> list[Call | SpilledCall]:
        return list(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def __iter__(self) -> Iterator[Args]:
        for entry in self.entries:
            call = loaded(entry)
            yield call.args, dict(call.kwargs)
