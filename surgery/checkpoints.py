"""Checkpoint files: safe loading with clear errors, and atomic saving."""

from __future__ import annotations

import os
import pickle
import tempfile
import zipfile
from collections.abc import Callable
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
    if path.exists() and not overwrite:
        raise OutputExistsError(str(path))
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


def write_atomically(path: Path, write: Callable[[Path], None]) -> None:
    """Call ``write`` on a temporary file beside ``path``, then rename it into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(handle)
    tmp = Path(tmp_name)
    try:
        write(tmp)
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; outputs are ordinary files
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
