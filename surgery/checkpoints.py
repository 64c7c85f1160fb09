"""Checkpoint files and other outputs: safe loading with clear errors, atomic writing of one
file (:func:`write_atomically`) or of a set published together (:class:`Staging`), and the
never-overwrite-silently check (:func:`refuse_existing`)."""

from __future__ import annotations

import os
import pickle
import shutil
import tempfile
import zipfile
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from surgery.errors import CheckpointError, OutputExistsError

STATE_KEYS = ("state_dict", "model_state_dict", "model")


def read_state_dict(path: str | Path, *, field: str = "checkpoint") -> dict[str, Tensor]:
    """Read a state dict from a ``.safetensors`` file or a ``torch.save`` file.

    ``torch.save`` files are read with ``weights_only=True``: a file carrying code is refused.
    A dict wrapping the weights under ``state_dict``/``model_state_dict``/``model`` is unwrapped.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{field}={str(path)!r}: no such file")
    try:
        if path.suffix == ".safetensors":
            state = load_file(str(path))
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else "unsafe content"
        raise CheckpointError(f"{field}={str(path)!r}: refused by weights_only=True, the file carries "
                              f"more than tensors ({first[:160]})") from None
    except (RuntimeError, EOFError, OSError, SafetensorError, zipfile.BadZipFile, ValueError) as err:
        raise CheckpointError(f"{field}={str(path)!r}: corrupted or truncated checkpoint "
                              f"({type(err).__name__}: {str(err).splitlines()[0][:160] if str(err) else ''})") from None
    for key in STATE_KEYS:
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
    if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
        raise CheckpointError(f"{field}={str(path)!r}: holds no state dict of tensors")
    return state


def check_fits(model: nn.Module, state: dict[str, Tensor], *, field: str = "checkpoint") -> None:
    """Raise :class:`CheckpointError` unless ``state`` has exactly the model's keys and shapes."""
    expected = model.state_dict()
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    shapes = [f"{k}: {tuple(state[k].shape)} vs model {tuple(v.shape)}"
              for k, v in expected.items() if k in state and state[k].shape != v.shape]
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing key(s), e.g. {missing[0]}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected key(s), e.g. {unexpected[0]}")
    if shapes:
        problems.append(f"{len(shapes)} shape mismatch(es), e.g. {shapes[0]}")
    if problems:
        raise CheckpointError(f"{field}: does not fit {type(model).__name__}: {'; '.join(problems)}")


def load_checkpoint(model: nn.Module, path: str | Path, *, field: str = "checkpoint") -> nn.Module:
    """Load a checkpoint into ``model`` strictly; on any problem the model is left untouched.

    The file is read and checked against the model before anything is copied; if copying
    still fails part-way (or is interrupted), the tensors already overwritten are put back.
    """
    state = read_state_dict(path, field=field)
    check_fits(model, state, field=f"{field}={str(path)!r}")
    backup = {k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items()}
    try:
        model.load_state_dict(state, strict=True)
    except BaseException:
        model.load_state_dict(backup, strict=True)
        raise
    return model


def save_checkpoint(model: nn.Module, path: str | Path, *, overwrite: bool = False) -> Path:
    """Write ``model.state_dict()`` atomically (``.safetensors`` or ``torch.save`` by suffix).

    Every tensor is saved under each of its keys (tied weights included), so the file loads
    with ``strict=True`` into a fresh instance. An existing file is never replaced unless
    ``overwrite`` is true.
    """
    path = Path(path)
    refuse_existing([path], overwrite)
    state = {k: v.detach().cpu().contiguous().clone() for k, v in model.state_dict().items()}
    if path.suffix == ".safetensors":
        write_atomically(path, lambda tmp: save_file(state, str(tmp)))
    else:
        write_atomically(path, lambda tmp: torch.save(state, tmp))
    return path


def save_tensors(tensors: dict[str, Tensor], path: str | Path, metadata: dict[str, str] | None = None) -> Path:
    """Write named tensors to a ``.safetensors`` file atomically."""
    path = Path(path)
    state = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    write_atomically(path, lambda tmp: save_file(state, str(tmp), metadata=metadata))
    return path


def refuse_existing(paths: Iterable[Path], overwrite: bool) -> None:
    """Raise :class:`~surgery.errors.OutputExistsError` for the first of ``paths`` that exists,
    unless ``overwrite``: call it before writing anything, so a refusal writes nothing."""
    for path in paths:
        if not overwrite and Path(path).exists():
            raise OutputExistsError(str(path))


def write_atomically(path: Path, write: Callable[[Path], None]) -> None:
    """Call ``write`` on a temporary file beside ``path``, flush it to disk, rename it into place.

    Readers see the previous file or the complete new one, never a part of it: the temporary
    file is in the same folder (the rename is atomic), its data is fsynced before the rename and
    the folder after it. On any failure — ``KeyboardInterrupt`` included — the temporary file
    is removed and ``path`` is left as it was.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    tmp = Path(tmp_name)
    try:
        os.close(handle)
        write(tmp)
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; outputs are ordinary files
        _fsync(tmp)
        os.replace(tmp, path)
        fsync_folder(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


class Staging:
    """Outputs that belong together, published only once every one of them is complete.

    Inside ``with Staging(folder) as stage:`` write each output to ``stage / name`` (they land
    in a hidden temporary folder inside ``folder``), then call :meth:`publish` to move them all
    into ``folder``. Leaving the block removes the hidden folder and whatever is still in it, so
    an error or an interrupt before :meth:`publish` leaves ``folder`` as it found it (a
    ``folder`` the block had to create is removed again if it is still empty).

    Example:
        >>> with Staging(out_dir) as stage:
        ...     save_checkpoint(model, stage / "model.safetensors")
        ...     write_atomically(stage / "report.json", lambda tmp: tmp.write_text(text))
        ...     stage.publish(overwrite=False, last="report.json")
    """

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.path = self.folder  # the hidden folder, once entered
        self._created = False

    def __enter__(self) -> Staging:
        self._created = not self.folder.exists()
        self.folder.mkdir(parents=True, exist_ok=True)
        self.path = Path(tempfile.mkdtemp(prefix=".staging-", dir=self.folder))
        return self

    def __exit__(self, *exc_info: object) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        if self._created and self.folder.is_dir() and not any(self.folder.iterdir()):
            self.folder.rmdir()

    def __truediv__(self, name: str) -> Path:
        return self.path / name

    def publish(self, *, overwrite: bool, last: str | None = None, replaces: Iterable[str] = ()) -> list[Path]:
        """Move every staged file into the folder, ``last`` after the others (its presence then
        marks a complete set); return the published paths.

        Without ``overwrite``, an existing target raises before anything moves. With it, the
        files named in ``replaces`` that this set does not include are removed first (what an
        earlier set left, e.g. a plot this run does not draw).
        """
        staged = sorted((p for p in self.path.iterdir() if p.is_file()), key=lambda p: p.name == last)
        targets = [self.folder / p.name for p in staged]
        refuse_existing(targets, overwrite)
        if overwrite:
            for name in set(replaces) - {p.name for p in staged}:
                (self.folder / name).unlink(missing_ok=True)
        for source, target in zip(staged, targets):
            os.replace(source, target)
        fsync_folder(self.folder)
        return targets


def _fsync(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def fsync_folder(folder: Path) -> None:
    """Make the renames in ``folder`` durable (skipped where a folder cannot be opened)."""
    try:
        descriptor = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)
