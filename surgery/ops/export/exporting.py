"""``surgery.export``: write a model under surgery in a deployable format, through a registry
of formats. ``safetensors`` (the weights as they compute now) is built in; deployment formats
register the same way a user's format does.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import replace as replace_field
from pathlib import Path
from typing import Any

from torch import Tensor, nn

from surgery.core.checkpoints import refuse_existing, write_atomically, write_folder_atomically
from surgery.core.errors import ConfigError, ConfigTypeError, OutputWriteError, SurgeryError, first_line
from surgery.core.handles import Handle, HandleGroup, attached_to, copied_outside, members
from surgery.core.inputs import Call, Inputs, as_call
from surgery.ops.export.format_table import EXPORT_FORMATS, ExportFormat
from surgery.ops.export.parity import ExportParityError, ExportRecord, runtime_parity
from surgery.ops.numerics.deployment import ExportParts, gather_export_parts

log = logging.getLogger("surgery")


def export(
    handle: Handle | HandleGroup | nn.Module,
    path: str | Path,
    *,
    format: str = "safetensors",
    overwrite: bool = False,
    inputs: Inputs | None = None,
    compare: bool = True,
    **options: Any,
) -> ExportRecord:
    """Write the model under surgery (the model of ``handle``) to ``path`` in ``format``.

    Args:
        handle: what a verb returned (or a group of them), or the model itself (weights-only
            formats). Deployment formats read each quantized weight's grid and each activation's
            scale from the handles, so they need the handle, attached; surgery outside the
            weights that another handle keeps on the model (an input rewrite, an online
            rotation) is refused by name: compose the handles and export the group.
        path: the file (or, for folder formats such as ``"compressed-tensors"``, the folder) to
            write; an existing one is refused unless ``overwrite``. What the model does outside
            its weights (whichever handle attached it) and a weights-only format cannot hold is
            logged and listed in ``record.left_out``.
        format: a registered format (:func:`register_export_format`): ``"safetensors"`` writes
            the weights as they compute now (pruned zeros, quantized values);
            ``"compressed-tensors"``, ``"torchao"``, ``"onnx"`` and ``"gguf"`` write integer
            weights for their runtimes (the ``deploy`` extra).
            An offloaded model's handle (:func:`surgery.offloaded`), or what a verb made of
            it, is streamed: one tensor read at a time, in the formats that stream
            (``"safetensors"``, ``"compressed-tensors"``, ``"gguf"``).
        inputs: batches (or one) to compare the artifact, loaded in its runtime, with the model
            under surgery as it runs (every attached surgery), every output tensor of both:
            ``record.parity``. Formats that trace the model (``"onnx"``) need them.
        compare: ``False``: ``inputs`` only trace the model, no parity is measured.
        **options: passed to the format's writer.

    Raises:
        ExportParityError: given ``inputs``, the loaded artifact misses what its format
            promises (bit-identical outputs, or its cosine bound and integer outputs' agreement;
            NaN or Inf on either side): the artifact is never moved into place, and an earlier
            one at ``path`` is left as it was.

    Example:
        >>> record = surgery.export(surgery.prune(model, 0.5), "pruned.safetensors")
        >>> record.bytes, sorted(record.load())[:1]
    """
    chosen = EXPORT_FORMATS.get(format)
    if getattr(handle, "streams", False):
        return _export_streamed(handle, chosen, Path(path), overwrite, inputs, options)
    model = handle if isinstance(handle, nn.Module) else getattr(handle, "model", None)
    if isinstance(handle, Handle) and model is None:
        raise ConfigError(
            "export.handle",
            handle.kind,
            "its model no longer exists (a handle keeps only a weak reference to it): keep the model while exporting",
        )
    if not isinstance(model, nn.Module):
        raise ConfigTypeError("export.handle", type(handle).__name__, "must be a handle, a handle group or a model")
    path = Path(path)
    if chosen.suffix and path.suffix != f".{chosen.suffix}":
        raise ConfigError("export.path", str(path), f"must end in .{chosen.suffix} for format={format!r}")
    refuse_existing([path], overwrite)
    calls = None if inputs is None else [as_call(b) for b in _listed(inputs)]
    source, left_out = _source(chosen, handle, model, calls)
    write = lambda tmp: chosen(source, tmp, options)  # noqa: E731 - one call, named for the reader
    record = _write_checked(chosen, path, write, model, calls if compare else None, options, left_out)
    if left_out:
        log.warning("export: format=%r holds the weights only; not in %s: %s", format, path.name, "; ".join(left_out))
    return record


def _source(chosen: ExportFormat, handle: Any, model: nn.Module, calls: list[Call] | None) -> tuple[Any, list[str]]:
    """What the format's writer gets (the model, or the parts the handles export), and what the model
    does as it runs — with the surgery of every handle attached to it — that the file cannot hold."""
    if chosen.takes_parts:
        if not isinstance(handle, Handle):
            raise ConfigTypeError(
                "export.handle", type(handle).__name__, f"format={chosen.name!r} needs the handle a verb returned"
            )
        _refuse_others(chosen, handle, model)
        parts = gather_export_parts(handle)
        _refuse_g_idx(chosen, parts)
        for key, grid in parts.weights.items():
            _refuse_float_offset(chosen, grid.spec, key)
        parts.inputs = calls
        if parts.unexpressed:
            raise ConfigError(
                "export.handle", "; ".join(parts.unexpressed), f"cannot be expressed in format={chosen.name!r}"
            )
        return parts, []
    if chosen.holds_hooks:
        return model, []
    mine = {id(each) for each in members(handle)} if isinstance(handle, Handle) else None
    return model, [
        item if mine is None or id(each) in mine else f"{item} (attached by another handle, {each.kind})"
        for each in attached_to(model)
        for item in each.outside_weights()
    ] + copied_outside(model)


def _refuse_g_idx(chosen: ExportFormat, parts: ExportParts) -> None:
    """Refuse a weight whose groups are scattered over its inputs (GPTQ's ``actorder="group"``)
    in a format that stores only groups of consecutive inputs: it would load with the wrong scales."""
    if chosen.holds_g_idx:
        return
    for key, grid in parts.weights.items():
        if grid.g_idx is not None:
            raise ConfigError(
                "export.format",
                chosen.name,
                f"cannot hold {key}'s group index (g_idx, from actorder='group': its groups are not consecutive "
                "inputs); quantize with actorder='weight', or export format='safetensors'",
            )


def _refuse_float_offset(chosen: ExportFormat, spec: Any, key: str) -> None:
    """Refuse a grid whose groups store a float offset in a format that stores integer zero points."""
    if getattr(spec, "float_offset", False) and not chosen.holds_float_offset:
        holding = [name for name in EXPORT_FORMATS.names() if EXPORT_FORMATS.get(name).holds_float_offset]
        raise ConfigError(
            "export.format",
            chosen.name,
            f"stores integer zero points; {key}'s groups have float offsets (float_offset=true): "
            f"export format={' or '.join(map(repr, holding))}, or quantize without float_offset",
        )


def _refuse_others(chosen: ExportFormat, handle: Handle, model: nn.Module) -> None:
    """Refuse surgery outside the weights that a handle other than ``handle`` keeps on ``model``:
    the format holds only what the handle it is given describes."""
    copied = copied_outside(model)
    if copied:
        raise ConfigError(
            "export.handle",
            copied[0],
            f"format={chosen.name!r} holds only the handle it is given, and this model is a copy of one under "
            "surgery whose hooks came along: export the original, or bake (or restore) before copying",
        )
    mine = {id(each) for each in members(handle)}
    for other in attached_to(model):
        outside = other.outside_weights()
        if id(other) not in mine and outside:
            raise ConfigError(
                "export.handle",
                f"{other.kind} handle",
                f"is also attached to the model, and format={chosen.name!r} holds only the handle it is given: "
                f"{outside[0]} would be missing from the file; compose the handles (surgery.compose) and export "
                "the group, or restore the other one first",
            )


def _write_checked(
    chosen: ExportFormat,
    path: Path,
    write: Callable[[Path], dict[str, Any] | None],
    model: nn.Module,
    calls: list[Call] | None,
    options: dict[str, Any],
    left_out: list[str],
) -> ExportRecord:
    """Write ``path`` atomically; with ``calls`` (a runnable format), load the written copy
    before it is moved into place and compare it with ``model`` as it runs: one that misses its
    format's promise raises :class:`ExportParityError` and is never moved into place."""
    made: list[ExportRecord] = []

    def written(tmp: Path) -> None:
        notes = write(tmp) or {}
        missing = [*left_out, *notes.get("left_out", [])]
        exact = notes.get("exact", chosen.exact) and not missing
        int8_ops = notes.get("int8_ops")
        record = ExportRecord(path, chosen.name, _size(tmp), dict(options), missing, exact=exact, int8_ops=int8_ops)
        if calls and chosen.runnable:
            record = replace_field(record, parity=runtime_parity(chosen, tmp, model, calls, exact))
            if not record.parity.holds:
                hint = notes.get("parity_hint")  # the writer's word on what the option chosen may cost
                if hint and not record.parity.why:
                    record = replace_field(record, parity=replace_field(record.parity, why=hint))
                raise ExportParityError(record)
        made.append(record)

    _written(chosen, path, written, type(model).__name__)
    return made[0]


def _written(chosen: ExportFormat, path: Path, write: Callable[[Path], Any], model_name: str) -> dict[str, Any]:
    """Write ``path`` atomically with ``write`` (the format's writer); its notes. A writer that
    fails otherwise than on bad input or the file system leaves nothing behind and is one line
    naming the format."""
    writer = write_folder_atomically if chosen.folder else write_atomically
    notes: dict[str, Any] = {}
    try:
        writer(path, lambda tmp: notes.update(write(tmp) or {}))
    except (SurgeryError, KeyboardInterrupt):
        raise
    except OSError as err:  # a full disk, a read-only folder, a file where the folder should be
        if err.filename is not None and not _inside(Path(str(err.filename)), path.parent):
            raise  # a file the writer reads (an offloaded model's shard), which is not the output
        raise OutputWriteError("export.path", str(path), err) from err
    except Exception as err:
        raise ConfigError(
            "export.format", chosen.name, f"cannot write {model_name} ({first_line(err)}); nothing was written"
        ) from err
    return notes


def _inside(path: Path, folder: Path) -> bool:
    """Whether ``path`` is ``folder`` or inside it."""
    return Path(os.path.abspath(path)).is_relative_to(os.path.abspath(folder))


def _export_streamed(
    handle: Any, chosen: ExportFormat, path: Path, overwrite: bool, inputs: Inputs | None, options: dict[str, Any]
) -> ExportRecord:
    """Write an offloaded model's result with the format's ``stream`` writer (atomically)."""
    if chosen.stream is None:
        streaming = [name for name in EXPORT_FORMATS.names() if EXPORT_FORMATS.get(name).stream is not None]
        raise ConfigError(
            "export.format",
            chosen.name,
            f"cannot be written from an offloaded model without loading it; formats that stream: {', '.join(streaming)}",
        )
    if chosen.suffix and path.suffix != f".{chosen.suffix}":
        raise ConfigError("export.path", str(path), f"must end in .{chosen.suffix} for format={chosen.name!r}")
    _refuse_float_offset(chosen, getattr(handle, "spec", None), "every quantized weight")
    refuse_existing([path], overwrite)
    calls = None if inputs is None else [as_call(b) for b in _listed(inputs)]
    write = lambda tmp: chosen.stream(handle, tmp, options)  # noqa: E731 - one call, named for the reader
    return _write_checked(chosen, path, write, handle.model, calls, options, [])


def _listed(inputs: Inputs) -> list[Any]:
    if isinstance(inputs, (Tensor, dict)):
        return [inputs]
    return list(inputs)


def _size(path: Path) -> int:
    if path.is_dir():
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return path.stat().st_size
