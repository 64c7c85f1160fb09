"""``surgery.export``: write a model under surgery in a deployable format, through a registry
of formats. ``safetensors`` (the weights as they compute now) is built in; deployment formats
register the same way a user's format does.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from safetensors.torch import load_file, save_file
from torch import nn

from surgery.core.checkpoints import cpu_state, refuse_existing, write_atomically
from surgery.core.errors import ConfigError, ConfigTypeError
from surgery.core.handles import Handle, HandleGroup
from surgery.core.registry import Registry

log = logging.getLogger("surgery")
Write = Callable[[nn.Module, Path, dict[str, Any]], None]  # (model, path, options) writes path
Load = Callable[[Path], Any]  # path -> the deployable object


@dataclass(frozen=True)
class ExportFormat:
    """A registered export format: ``write(model, path, options)`` writes one file at
    ``path`` (written atomically around it), ``load(path)`` gives back the deployable object;
    ``suffix`` is the file's extension."""

    name: str
    write: Write
    load: Load
    suffix: str
    holds_hooks: bool = False  # the file keeps what hooks do (activation quantization, rewrites)

    def __call__(self, model: nn.Module, path: Path, options: dict[str, Any]) -> None:
        self.write(model, path, options)


@dataclass(frozen=True)
class ExportRecord:
    """What :func:`export` wrote: where, in which format, how many bytes; ``load()`` reads it
    back in its own runtime."""

    path: Path
    format: str
    bytes: int
    options: dict[str, Any] = field(default_factory=dict)
    left_out: list[str] = field(default_factory=list)  # what the model under surgery does that the file does not

    def load(self) -> Any:
        return EXPORT_FORMATS.get(self.format).load(self.path)

    def as_dict(self) -> dict[str, Any]:
        found = {"path": self.path.name, "format": self.format, "bytes": self.bytes}
        return found | ({"left_out": self.left_out} if self.left_out else {})


EXPORT_FORMATS: Registry[ExportFormat] = Registry("export.format")


def register_export_format(
    name: str, write: Write, *, load: Load, suffix: str, holds_hooks: bool = False, replace: bool = False
) -> ExportFormat:
    """Make ``write``/``load`` available as ``export(..., format=name)`` and ``export.format=name``.

    Example:
        >>> register_export_format("torchscript", lambda m, p, o: torch.jit.script(m).save(str(p)),
        ...                        load=torch.jit.load, suffix="pt")
    """
    if not isinstance(suffix, str) or not suffix.isidentifier():
        raise ConfigTypeError("export suffix", suffix, "must be a file extension without the dot, e.g. 'onnx'")
    return EXPORT_FORMATS.register(name, ExportFormat(name, write, load, suffix, holds_hooks), replace=replace)


def export(
    handle: Handle | HandleGroup | nn.Module,
    path: str | Path,
    *,
    format: str = "safetensors",
    overwrite: bool = False,
    **options: Any,
) -> ExportRecord:
    """Write the model under surgery (the model of ``handle``) to ``path`` in ``format``.

    Args:
        handle: what a verb returned (or a group of them), or the model itself.
        path: the file to write; an existing file is refused unless ``overwrite``. What the
            model does outside its weights (activation quantization, input rewrites) and the
            format cannot hold is logged and listed in ``record.left_out``.
        format: a registered format (:func:`register_export_format`); ``"safetensors"``
            writes the weights as they compute now (pruned zeros, quantized values).
        **options: passed to the format's writer.

    Example:
        >>> record = surgery.export(surgery.prune(model, 0.5), "pruned.safetensors")
        >>> record.bytes, sorted(record.load())[:1]
    """
    chosen = EXPORT_FORMATS.get(format)
    model = handle if isinstance(handle, nn.Module) else getattr(handle, "model", None)
    if not isinstance(model, nn.Module):
        raise ConfigTypeError("export.handle", type(handle).__name__, "must be a handle, a handle group or a model")
    path = Path(path)
    if path.suffix != f".{chosen.suffix}":
        raise ConfigError("export.path", str(path), f"must end in .{chosen.suffix} for format={format!r}")
    refuse_existing([path], overwrite)
    left_out = [] if chosen.holds_hooks or not isinstance(handle, Handle) else handle.outside_weights()
    write_atomically(path, lambda tmp: chosen(model, tmp, options))
    if left_out:
        log.warning("export: format=%r holds the weights only; not in %s: %s", format, path.name, "; ".join(left_out))
    return ExportRecord(path, format, path.stat().st_size, dict(options), left_out)


def _write_safetensors(model: nn.Module, path: Path, options: dict[str, Any]) -> None:
    if options:
        raise ConfigError("export.options", sorted(options), "format='safetensors' takes no options")
    save_file(cpu_state(model), str(path))


register_export_format("safetensors", _write_safetensors, load=lambda path: load_file(str(path)), suffix="safetensors")
