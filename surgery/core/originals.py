"""Where the values kept for ``restore()`` live: once, in memory or spilled to disk.

A verb that rewrites weights must keep their original values to undo itself. An
:class:`Originals` store keeps each parameter's values once, before the first change: as a
tensor in memory (``where="memory"``, the default), or written to a temporary safetensors
file and read back only by ``restore()`` (``where="disk"``: the model's memory stays about
one copy of its weights, at the cost of a write per weight). The files are deleted once no
undo record needs them. Within :func:`read_again_from`, a parameter whose values can be read
again from where they came (an offloaded model's weights: their files) is kept as that read,
nothing held.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import weakref
from collections.abc import Callable, Container, Iterator
from contextvars import ContextVar
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor, nn

from surgery.core.errors import ConfigError
from surgery.core.transforms import Saved, SavedTensor

PLACES = ("memory", "disk")
Reader = Callable[[Tensor], "Callable[[], Tensor] | None"]  # a parameter -> how to read its values again, or None
_READ_AGAIN: ContextVar[Reader | None] = ContextVar("surgery_originals_read_again", default=None)


@contextlib.contextmanager
def read_again_from(reader: Reader) -> Iterator[None]:
    """Within the block, a store keeps no copy of a parameter for which ``reader(param)`` gives a
    way to read its values again (an offloaded stage's weights: the files they were read from);
    ``restore()`` reads them from there."""
    token = _READ_AGAIN.set(reader)
    try:
        yield
    finally:
        _READ_AGAIN.reset(token)


def check_place(where: object, field: str) -> str:
    """``where`` as a store place, or a one-line error naming ``field`` and the allowed values."""
    if where not in PLACES:
        raise ConfigError(field, where, f"must be one of {', '.join(PLACES)}")
    return str(where)


class SpilledTensor:
    """Original values read back from a safetensors file on restore (nothing held in memory)."""

    def __init__(self, store: Originals, path: Path) -> None:
        self.store, self.path = store, path  # the store keeps its folder alive

    def put_back(self, param: Tensor) -> None:
        with safe_open(str(self.path), framework="pt") as spilled:
            param.copy_(spilled.get_tensor("value").to(param.device, param.dtype))

    def tensors(self) -> list[Tensor]:
        return []


class ReadAgain:
    """Original values read again from where they came on restore (nothing held in memory)."""

    def __init__(self, read: Callable[[], Tensor]) -> None:
        self.read = read

    def put_back(self, param: Tensor) -> None:
        param.copy_(self.read().to(param.device, param.dtype))

    def tensors(self) -> list[Tensor]:
        return []


class Originals:
    """The values parameters held before a verb changed them, each kept once (see the module
    docstring). ``keep(name, param)`` before the first change; ``saved(name)`` is the undo
    record a transform returns from ``save``; ``put_back()`` undoes every change at once."""

    def __init__(self, where: str = "memory") -> None:
        self.where = check_place(where, "originals")
        self._kept: dict[str, tuple[nn.Parameter | Tensor, Saved]] = {}
        self.folder: Path | None = None
        if self.where == "disk":
            self.folder = Path(tempfile.mkdtemp(prefix="surgery-originals-"))
            weakref.finalize(self, shutil.rmtree, self.folder, True)

    def __contains__(self, name: str) -> bool:
        return name in self._kept

    def __len__(self) -> int:
        return len(self._kept)

    @contextlib.contextmanager
    def originals_in(self) -> Iterator[None]:
        """For the block, every kept parameter holds its original values again (the new ones after)."""
        with torch.no_grad():
            current = [(param, param.detach().clone()) for param, _ in self._kept.values()]
            for param, saved in self._kept.values():
                saved.put_back(param)
            try:
                yield
            finally:
                for param, value in current:
                    param.copy_(value)

    def keep(self, name: str, param: Tensor) -> None:
        """Keep ``param``'s current values under ``name`` (a second call keeps the first values)."""
        if name in self._kept:
            return
        value = param.detach()
        reader = _READ_AGAIN.get()
        read = reader(param) if reader is not None else None
        if read is not None:
            self._kept[name] = (param, ReadAgain(read))
            return
        if self.folder is None:
            self._kept[name] = (param, SavedTensor(value))
            return
        path = self.folder / f"{len(self._kept)}.safetensors"
        save_file({"value": value.contiguous().cpu()}, str(path))
        self._kept[name] = (param, SpilledTensor(self, path))

    def saved(self, name: str) -> Saved:
        """The undo record of ``name`` (kept earlier)."""
        return self._kept[name][1]

    def put_back(self, skip: Container[str] = ()) -> None:
        """Every kept parameter (but those named in ``skip``) gets its original values back."""
        with torch.no_grad():
            for name, (param, saved) in self._kept.items():
                if name not in skip:
                    saved.put_back(param)

    def nbytes(self) -> int:
        """Bytes held in memory (0 when spilled)."""
        return sum(t.numel() * t.element_size() for _, saved in self._kept.values() for t in saved.tensors())
