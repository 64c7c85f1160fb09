"""Which configuration field a failed file operation belongs to: an ``OSError`` raised while a run
reads or writes names a path, and the one-line error names the field that holds that path (the
model folder, the tokenizer, the spill folder, ...), not the run's output folder."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from surgery.core.checkpoints import STAGING_PREFIX
from surgery.core.errors import ConfigError

# (field, how to read it from the RunConfig): every setting that names a file or folder
PATH_FIELDS = (
    ("model.weights", lambda c: c.model.weights),
    ("model.path", lambda c: c.model.path),
    ("model.offload_folder", lambda c: c.model.offload_folder),
    ("data.root", lambda c: c.data.root),
    ("data.text", lambda c: c.data.text),
    ("data.tokenizer", lambda c: c.data.tokenizer),
    ("data.activation_folder", lambda c: c.data.activation_folder),
    ("export.options.tokenizer", lambda c: c.export.options.get("tokenizer")),
)
# the library's name of a setting -> the command line's
CLI_FIELDS = {"work": "model.offload_folder", "activation_budget.folder": "data.activation_folder"}
_TEMPORARY = re.compile(r"^\.(?P<name>.+)\.[A-Za-z0-9_]{6,}\.tmp(\.previous)?$")  # write_atomically's names


def os_error_as_config_error(err: OSError, config: Any, out_dir: Path) -> ConfigError:
    """``err`` as a one-line :class:`ConfigError` naming the field whose path failed, the path
    and the system's reason; a path inside ``out_dir`` (or none) is the run's ``output``."""
    reason = err.strerror or str(err) or type(err).__name__
    failed = err.filename
    if failed is not None:
        for name, read in PATH_FIELDS:
            value = read(config) if config is not None else None
            if value is not None and _within(Path(str(failed)), Path(str(value))):
                return ConfigError(name, str(failed), f"cannot be used ({reason})")
    if failed is not None and not _within(Path(str(failed)), out_dir):
        return ConfigError("file", str(failed), f"cannot be used ({reason}); nothing was written")
    where = out_dir if failed is None else output_name(Path(str(failed)), out_dir)
    return ConfigError("output", str(where), f"cannot be written ({reason}); nothing was written")


def with_cli_field(err: ConfigError) -> ConfigError:
    """``err`` naming the command line's setting where the library names its own argument
    (``work`` is ``model.offload_folder``); ``err`` itself when both are the same."""
    field = CLI_FIELDS.get(err.field)
    return err if field is None else ConfigError(field, err.value, err.allowed, err.hint)


def output_name(path: Path, out_dir: Path) -> Path:
    """The output a staged or temporary ``path`` inside ``out_dir`` becomes once published."""
    parts = [p for p in path.resolve().relative_to(out_dir.resolve()).parts if not p.startswith(STAGING_PREFIX)]
    cleaned = [m.group("name") if (m := _TEMPORARY.match(p)) else p for p in parts]
    return out_dir.joinpath(*cleaned)


def _within(path: Path, folder: Path) -> bool:
    """Whether ``path`` is ``folder`` or inside it (both made absolute, links resolved)."""
    try:
        path.resolve().relative_to(Path(os.path.abspath(folder)).resolve())
    except (ValueError, OSError, RuntimeError):
        return False
    return True
