"""Checkpoint files and other outputs: safe loading with clear errors, atomic writing of one
file (:func:`write_atomically`) or of a set published together (:class:`Staging`), and the
never-overwrite-silently check (:func:`refuse_existing`)."""

from __future__ import annotations

import errno
import json
import logging
import os
import pickle
import re
import shutil
import socket
import tempfile
import warnings
import zipfile
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from surgery.core.errors import CheckpointError, ConfigTypeError, OutputExistsError
from surgery.core.folders import deferred_interrupts

log = logging.getLogger("surgery")

STATE_KEYS = ("state_dict", "model_state_dict", "model")


def read_state_dict(path: str | Path, *, field: str = "checkpoint") -> dict[str, Tensor]:
    """Read a state dict from a ``.safetensors`` file or a ``torch.save`` file.

    ``torch.save`` files are read with ``weights_only=True``: a file carrying code is refused.
    A dict wrapping the weights under ``state_dict``/``model_state_dict``/``model`` is unwrapped.
    """
    path = Path(path)
    if not path.is_file():
        what = (
            "no such file"
            if not path.exists()
            else "is a folder, not a checkpoint file"
            if path.is_dir()
            else "is not a regular file (a device or a pipe), not a checkpoint"
        )
        raise CheckpointError(f"{field}={str(path)!r}: {what}")
    try:
        with warnings.catch_warnings():  # torch's notes on quantized or sparse storage: the checks below speak
            warnings.simplefilter("ignore")
            if path.suffix == ".safetensors":
                state = load_file(str(path))
            else:
                state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        text = " ".join(str(err).split())
        if _is_safetensors(path):
            raise CheckpointError(
                f"{field}={str(path)!r}: is a safetensors file; name it with the .safetensors suffix"
            ) from None
        found = re.search(r"Unsupported (global|operand)[^.]*", text)
        if found is None or found.group(1) != "global":
            raise CheckpointError(
                f"{field}={str(path)!r}: corrupted or truncated checkpoint, or not a torch.save "
                f"or safetensors file ({found.group(0)[:120] if found else 'not a pickle'})"
            ) from None
        reason = found.group(0)[:160]
        raise CheckpointError(
            f"{field}={str(path)!r}: refused by weights_only=True, the file carries more than tensors ({reason})"
        ) from None
    except (RuntimeError, EOFError, OSError, SafetensorError, zipfile.BadZipFile, ValueError) as err:
        raise CheckpointError(
            f"{field}={str(path)!r}: corrupted or truncated checkpoint "
            f"({type(err).__name__}: {str(err).splitlines()[0][:160] if str(err) else ''})"
        ) from None
    for key in STATE_KEYS:
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
    if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
        raise CheckpointError(f"{field}={str(path)!r}: holds no state dict of tensors")
    return state


def _is_safetensors(path: Path) -> bool:
    """Whether the file starts as safetensors does: an 8-byte header length, then JSON."""
    try:
        with open(path, "rb") as handle:
            head = handle.read(9)
    except OSError:
        return False
    return len(head) == 9 and head[8:9] == b"{" and int.from_bytes(head[:8], "little") < 100_000_000


def check_fits(model: nn.Module, state: dict[str, Tensor], *, field: str = "checkpoint") -> None:
    """Raise :class:`CheckpointError` unless ``state`` has exactly the model's keys and shapes."""
    expected = model.state_dict()
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    shapes = [
        f"{k}: {tuple(state[k].shape)} vs model {tuple(v.shape)}"
        for k, v in expected.items()
        if k in state and state[k].shape != v.shape
    ]
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing key(s), e.g. {missing[0]}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected key(s), e.g. {unexpected[0]}")
    if shapes:
        problems.append(f"{len(shapes)} shape mismatch(es), e.g. {shapes[0]}")
    if problems:
        raise CheckpointError(f"{field}: does not fit {type(model).__name__}: {'; '.join(problems)}")
    for key, value in expected.items():
        _check_kind(key, state[key], value, field)


def _kind(tensor: Tensor) -> str:
    if tensor.dtype == torch.bool:
        return "boolean"
    if tensor.is_complex():
        return "complex"
    return "floating" if tensor.is_floating_point() else "integer"


def _check_kind(key: str, stored: Tensor, expected: Tensor, field: str) -> None:
    """A stored tensor must be a plain (strided, not quantized) tensor of the same kind of dtype
    as the model's: loading int32 or bool into a float weight would silently truncate it."""
    if stored.is_meta:
        raise CheckpointError(f"{field}: key {key!r} is a meta tensor and holds no values; save the real weights")
    if stored.layout != torch.strided or stored.is_quantized:
        what = f"layout {stored.layout}" if stored.layout != torch.strided else f"quantized dtype {stored.dtype}"
        raise CheckpointError(
            f"{field}: key {key!r} is a tensor of {what}; the model expects a dense "
            f"{expected.dtype} tensor (dequantize or densify it before saving)"
        )
    if _kind(stored) != _kind(expected):
        raise CheckpointError(
            f"{field}: key {key!r} has dtype {stored.dtype}; the model expects {expected.dtype} "
            f"({_kind(stored)} values cannot stand for {_kind(expected)} ones)"
        )
    if stored.is_floating_point() and expected.is_floating_point() and stored.dtype != expected.dtype:
        wide = stored.float() if stored.element_size() == 1 else stored  # float8 has no isfinite kernel
        finite = wide[torch.isfinite(wide)]
        limit = torch.finfo(expected.dtype).max
        if finite.numel() and finite.abs().max().item() > limit:
            raise CheckpointError(
                f"{field}: key {key!r} holds {finite.abs().max().item():.3g}, beyond the range of "
                f"the model's {expected.dtype} (max {limit:.3g}); loading would turn it into inf"
            )


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
    state = cpu_state(model)
    if path.suffix == ".safetensors":
        write_atomically(path, lambda tmp: save_file(state, str(tmp)))
    else:
        write_atomically(path, lambda tmp: torch.save(state, tmp))
    return path


def cpu_state(model: nn.Module) -> dict[str, Tensor]:
    """``model.state_dict()`` as contiguous CPU copies, every tensor under each of its keys."""
    return {k: v.detach().cpu().contiguous().clone() for k, v in model.state_dict().items()}


def save_tensors(tensors: dict[str, Tensor], path: str | Path, metadata: dict[str, str] | None = None) -> Path:
    """Write named tensors to a ``.safetensors`` file atomically."""
    path = Path(path)
    state = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    write_atomically(path, lambda tmp: save_file(state, str(tmp), metadata=metadata))
    return path


def refuse_existing(paths: Iterable[Path], overwrite: bool) -> None:
    """Raise :class:`~surgery.core.errors.OutputExistsError` for the first of ``paths`` that exists
    (a dangling symlink counts), unless ``overwrite``: call it before writing anything, so a
    refusal writes nothing."""
    if not isinstance(overwrite, bool):  # "no" would read as true
        raise ConfigTypeError("overwrite", overwrite, "must be True or False")
    for path in paths:
        if not overwrite and os.path.lexists(path):
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
        _written(write, tmp)
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; outputs are ordinary files
        _fsync(tmp)
        os.replace(tmp, path)
        fsync_folder(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


def _written(write: Callable[[Path], None], tmp: Path) -> None:
    """``write(tmp)``, a failed write of torch's stream writer (a full disk: ``torch.save``
    raises ``RuntimeError``) raised as the ``OSError`` it is."""
    try:
        write(tmp)
    except RuntimeError as err:
        if "PytorchStreamWriter" not in str(err) and "inline_container" not in str(err):
            raise
        full = shutil.disk_usage(tmp.parent).free < 1 << 20
        code = errno.ENOSPC if full else errno.EIO
        raise OSError(code, f"{os.strerror(code)}: {str(err).splitlines()[0]}", str(tmp)) from err


def write_folder_atomically(path: Path, write: Callable[[Path], None]) -> None:
    """:func:`write_atomically` for a folder: ``write`` fills a hidden temporary folder beside
    ``path``, which is then renamed into place (an earlier ``path`` is moved aside first and
    removed once the new one is in). On any failure the temporary folder is removed and
    ``path`` is left as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    aside = path.parent / f"{tmp.name}.previous"
    try:
        _written(write, tmp)
        for file in tmp.rglob("*"):
            if file.is_file():
                _fsync(file)
        with deferred_interrupts():
            if os.path.lexists(path):
                os.replace(path, aside)
            try:
                os.replace(tmp, path)
            except BaseException:
                if os.path.lexists(aside):
                    os.replace(aside, path)
                raise
            fsync_folder(path.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        remove_path(aside)


def remove_path(path: Path) -> None:
    """Remove a file, a link or a whole folder; nothing if it is not there."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        Path(path).unlink(missing_ok=True)


STAGING_PREFIX, BACKUP_PREFIX, MANIFEST = ".staging-", ".previous-", "MANIFEST.json"


class Staging:
    """Outputs that belong together, published only once every one of them is complete.

    Inside ``with Staging(folder) as stage:`` write each output to ``stage / name`` (they land
    in a hidden temporary folder inside ``folder``), then call :meth:`publish` to move them all
    into ``folder``. Leaving the block removes the hidden folder and whatever is still in it, so
    an error or an interrupt before :meth:`publish` leaves ``folder`` as it found it (a
    ``folder`` the block had to create is removed again if it is still empty). Hidden folders
    left by runs on this host whose process is dead (killed with SIGKILL, say) are removed on
    entry.

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
        self.published: list[Path] = []  # what publish() moved into place

    def __enter__(self) -> Staging:
        self._created = not self.folder.exists()
        self.folder.mkdir(parents=True, exist_ok=True)
        sweep_dead_staging(self.folder)
        self.path = Path(tempfile.mkdtemp(prefix=_owned(STAGING_PREFIX), dir=self.folder))
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
        earlier set — the staged names and those in ``replaces`` that exist, ``last`` first —
        is first moved aside, then the new set moved in; if any move fails (or is interrupted)
        the new files are removed and the earlier set put back, so the folder holds either the
        whole earlier set or the whole new one. An interrupt (SIGINT, SIGTERM) that arrives
        while files move takes effect once they have all moved and the aside folder is gone;
        :attr:`published` then says the new set is in place.
        """
        staged = sorted((p for p in self.path.iterdir() if p.is_file() or p.is_dir()), key=lambda p: p.name == last)
        targets = [self.folder / p.name for p in staged]
        refuse_existing(targets, overwrite)
        names = dict.fromkeys([*(p.name for p in staged), *(replaces if overwrite else ())])
        earlier = sorted((n for n in names if os.path.lexists(self.folder / n)), key=lambda n: n != last)
        backup = Path(tempfile.mkdtemp(prefix=_owned(BACKUP_PREFIX), dir=self.folder))
        # What a later run needs to put the earlier set back if this process dies half-way.
        manifest = json.dumps({"moved_aside": earlier, "publishing": [p.name for p in staged]})
        moved_aside: list[str] = []
        published: list[Path] = []
        with deferred_interrupts():
            try:
                write_atomically(backup / MANIFEST, lambda tmp: tmp.write_text(manifest))
                for name in earlier:
                    os.replace(self.folder / name, backup / name)
                    moved_aside.append(name)
                for source, target in zip(staged, targets):
                    os.replace(source, target)
                    published.append(target)
            except BaseException:
                for target in reversed(published):
                    remove_path(target)
                for name in reversed(moved_aside):
                    os.replace(backup / name, self.folder / name)
                raise
            finally:
                if published == targets or not any(p.name != MANIFEST for p in backup.iterdir()):
                    shutil.rmtree(backup, ignore_errors=True)
            fsync_folder(self.folder)
            self.published = targets
        return targets


def _owned(prefix: str) -> str:
    """A hidden-folder prefix naming this host and process, so a later run can tell a dead one's."""
    return f"{prefix}{socket.gethostname()}-{os.getpid()}-"


def sweep_dead_staging(folder: Path) -> list[Path]:
    """Clean up after runs of this host whose process died in ``folder`` (killed outright): their
    staging folders are removed, and a set they were publishing is undone — files already moved
    in are removed and the earlier set, kept aside, is put back. Returns the hidden folders
    removed."""
    host = socket.gethostname()
    removed = []
    for prefix in (BACKUP_PREFIX, STAGING_PREFIX):  # undo a half-published set first
        for path in folder.glob(f"{prefix}*"):
            owner = path.name[len(prefix) :].rsplit("-", 2)  # host (may hold '-'), pid, random part
            if len(owner) == 3 and owner[0] == host and owner[1].isdigit() and not _alive(int(owner[1])):
                if prefix == BACKUP_PREFIX:
                    _put_back(folder, path)
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
    return removed


def _put_back(folder: Path, backup: Path) -> None:
    """Undo a publication that died half-way, from the manifest its backup folder holds."""
    try:
        manifest = json.loads((backup / MANIFEST).read_text())
    except (OSError, ValueError):
        return  # died before the manifest was complete: nothing had moved yet
    publishing, moved_aside = (
        _plain_names(manifest, "publishing", backup),
        _plain_names(manifest, "moved_aside", backup),
    )
    for name in publishing:
        if (backup / name).exists() or name not in moved_aside:
            remove_path(folder / name)  # a new file, or one whose earlier version is kept aside
    for name in moved_aside:
        if (backup / name).exists():
            os.replace(backup / name, folder / name)
    fsync_folder(folder)


def _plain_names(manifest: object, key: str, backup: Path) -> list[str]:
    """The manifest's list under ``key``, keeping only plain file names (no folder part, no
    ``..``): a planted entry never reaches a file outside the output folder."""
    names = manifest.get(key) if isinstance(manifest, dict) else None
    kept = []
    for name in names if isinstance(names, list) else []:
        if (
            isinstance(name, str)
            and name not in ("", ".", "..")
            and Path(name).name == name
            and "\\" not in name
            and "\0" not in name
        ):
            kept.append(name)
        else:
            log.warning("output: ignored %r in %s: not a plain file name of the output folder", name, backup / MANIFEST)
    return kept


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, owned by someone else
    return True


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
