"""``surgery.export``: write a model under surgery in a deployable format, through a registry
of formats. ``safetensors`` (the weights as they compute now) is built in; deployment formats
register the same way a user's format does.
"""

from __future__ import annotations

import logging
import math
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from dataclasses import replace as replace_field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from surgery.core.checkpoints import cpu_state, refuse_existing, write_atomically, write_folder_atomically
from surgery.core.errors import ConfigError, ConfigTypeError, OutputWriteError, SurgeryError, first_line
from surgery.core.handles import Handle, HandleGroup, attached_to, copied_outside, members
from surgery.core.inputs import Call, Inputs, as_call, device_of, flatten_tensors, moved
from surgery.core.registry import Registry
from surgery.core.routing import routed_as
from surgery.core.safetensors_streams import write_streamed
from surgery.ops.export.positions import unreached
from surgery.ops.numerics.deployment import ExportParts, gather_export_parts
from surgery.ops.quantization.targets import DEPLOY_TARGETS, DeployTarget

log = logging.getLogger("surgery")
DEPRECATED_TAKES_PLAN = "register_export_format(takes_plan=) is now takes_parts=; the old name goes away in 0.4"
Write = Callable[[Any, Path, dict[str, Any]], None]  # (model, or ExportParts with takes_parts; path; options)
Load = Callable[[Path], Any]  # path -> the deployable object
Run = Callable[[Any, Call], list[Tensor]]  # (deployable, one batch) -> its output tensors, in order
RuntimeSummary = Callable[[Path, nn.Module, list, Any], dict[str, Any]]  # (path, simulation, inputs, metric) -> figures


def run_module(deployable: Any, call: Call) -> list[Tensor]:
    """Every output tensor of a loaded ``nn.Module`` (or any callable taking the batch's arguments)."""
    with torch.no_grad():
        return flatten_tensors(call(deployable), floating_only=False)


@dataclass(frozen=True)
class ExportFormat:
    """A registered export format: ``write(model, path, options)`` writes ``path`` (a file, or
    with ``folder`` a folder; written atomically around it) and may return notes
    (``{"exact": False, "left_out": [...], "int8_ops": (n, of)}``); ``load(path)`` gives back the deployable object
    and ``run(deployable, call)`` its outputs on one batch.

    ``takes_parts``: ``write`` gets the :class:`~surgery.ops.numerics.deployment.ExportParts` (the model
    with each quantized weight's integer grid, activation scales and masks) instead of the
    model. ``exact``: the loaded artifact computes what the model under surgery computes, bit
    for bit (a weights file, weight-only formats that dequantize); otherwise ``bound`` is the
    smallest cosine similarity its outputs keep (int8 kernels round differently). ``stream``
    writes the same from an offloaded model (:func:`surgery.offloaded`, or what a verb made of
    it), given the handle, reading each tensor as it is written. ``agreement``: with a cosine
    bound, the smallest share of entries of integer and boolean outputs (an argmax, token ids)
    that must be equal (an exact format keeps them all). ``holds_g_idx``: the format writes a
    weight's group index (``actorder="group"``: groups scattered over the inputs); the others
    are refused such a weight. ``holds_float_offset``: the format writes grids whose groups
    store a float offset (``GridSpec(float_offset=True)``); the others refuse them.
    ``also_runs_in``: (name, summary) of the runtimes the artifact is made for beyond ``load``'s,
    measured in ``report.json`` ``deploy`` under that name: ``summary(path, simulation, inputs,
    metric)`` gives their figures, ``holds: False`` where they miss their bound (GGUF: llama.cpp)."""

    name: str
    write: Write
    load: Load
    suffix: str
    holds_hooks: bool = False  # the file keeps what hooks do (activation quantization, rewrites)
    takes_parts: bool = False
    folder: bool = False
    run: Run = run_module
    exact: bool = True
    bound: float = 0.999
    target: DeployTarget | None = None
    stream: Write | None = None  # writes an offloaded model's result reading one tensor at a time
    agreement: float = 0.99  # with a cosine bound: the smallest share of integer outputs (argmax) kept equal
    holds_g_idx: bool = False  # writes WeightGrid.g_idx (groups not of consecutive inputs)
    holds_float_offset: bool = False  # writes grids with float offsets (GridSpec.float_offset)
    also_runs_in: tuple[tuple[str, RuntimeSummary], ...] = ()

    @property
    def runnable(self) -> bool:
        """Whether what ``load`` gives back runs (a deployment format), so parity can be measured."""
        return self.takes_parts or self.run is not run_module

    def __call__(self, source: Any, path: Path, options: dict[str, Any]) -> dict[str, Any] | None:
        return self.write(source, path, options)


@dataclass(frozen=True)
class ExportRecord:
    """What :func:`export` wrote: where, in which format, how many bytes; ``load()`` reads it
    back in its own runtime; ``parity`` compares that with the model under surgery (when
    ``export`` was given ``inputs``)."""

    path: Path
    format: str
    bytes: int
    options: dict[str, Any] = field(default_factory=dict)
    left_out: list[str] = field(default_factory=list)  # what the model under surgery does that the file does not
    exact: bool = True  # the loaded artifact computes bit for bit what the model under surgery computes
    parity: Parity | None = None
    int8_ops: tuple[int, int] | None = None  # (weighted ops its runtime runs in int8, weighted ops), where known

    def load(self) -> Any:
        return EXPORT_FORMATS.get(self.format).load(self.path)

    def run(self, deployable: Any, batch: Any) -> list[Tensor]:
        """The output tensors of a loaded artifact (``load()``) on one batch."""
        return EXPORT_FORMATS.get(self.format).run(deployable, as_call(batch))

    def as_dict(self) -> dict[str, Any]:
        found = {"path": self.path.name, "format": self.format, "bytes": self.bytes}
        found |= {"parity": self.parity.as_dict()} if self.parity is not None else {}
        found |= {"int8_ops": list(self.int8_ops)} if self.int8_ops is not None else {}
        return found | ({"left_out": self.left_out} if self.left_out else {})


@dataclass(frozen=True)
class Parity:
    """The loaded artifact against the model under surgery on the same batches, every output
    tensor of both compared: the largest absolute difference and the smallest cosine similarity
    of the floating ones (1.0 when there is none), the smallest share of equal entries of the
    integer and boolean ones (``agreement``; ``None`` when there is none), whether every output
    is equal bit for bit, and which side gave NaN or Inf (``nonfinite``: then ``max_abs`` is
    inf, ``cosine`` NaN and the promise fails). ``expected`` is what the format promises
    (``"exact"`` or a cosine), ``agreement_bound`` what its integer outputs must reach."""

    max_abs: float
    cosine: float
    equal: bool
    expected: str
    agreement: float | None = None
    agreement_bound: float = 1.0
    nonfinite: tuple[str, ...] = ()
    why: str = ""  # what differs between the two, where it is known (buffers in another dtype)
    unreached: str = ""  # a position-dependent feature the inputs were too short to exercise: no vouching

    @property
    def holds(self) -> bool:
        """Whether the artifact keeps what its format promises (no NaN or Inf on either side), on
        inputs long enough to exercise every position-dependent feature of the model."""
        if self.nonfinite or self.unreached:
            return False
        if self.expected == "exact":
            return self.equal
        agreed = self.agreement is None or self.agreement >= self.agreement_bound
        return agreed and self.cosine >= float(self.expected.removeprefix("cosine>="))

    def describe(self) -> str:
        """The figures in one line: what was promised and what was measured."""
        found = f"cosine {self.cosine:.6f}, max |diff| {self.max_abs:.3g}"
        if self.agreement is not None:
            found += f", integer outputs agree on {self.agreement:.2%} (at least {self.agreement_bound:.2%} promised)"
        if self.nonfinite:
            found += f", NaN or Inf from {' and '.join(self.nonfinite)}"
        notes = "".join(f"; {note}" for note in (self.unreached, self.why) if note)
        return f"expected {self.expected}: {found}{notes}"

    def as_dict(self) -> dict[str, Any]:
        found = {"max_abs": self.max_abs, "cosine": self.cosine, "equal": self.equal, "expected": self.expected}
        if self.agreement is not None:
            found |= {"agreement": self.agreement, "agreement_bound": self.agreement_bound}
        if self.nonfinite:
            found["nonfinite"] = list(self.nonfinite)
        if self.unreached:
            found["unreached"] = self.unreached
        return found | {"holds": self.holds}


class ExportParityError(SurgeryError, RuntimeError):
    """The artifact, loaded in its own runtime, does not keep what its format promises against
    the model under surgery; it was never moved into place. ``record`` (its ``parity``) has the
    figures."""

    def __init__(self, record: ExportRecord) -> None:
        self.record = record
        parity = record.parity
        if parity.unreached and replace_field(parity, unreached="").holds:  # it matched, on inputs too short
            figures = replace_field(parity, unreached="").describe()
            super().__init__(
                f"export.inputs: the {record.format} artifact matched the model under surgery on them ({figures}), "
                f"but the check {parity.unreached}; {record.path.name} was not written"
            )
            return
        super().__init__(
            f"export.format={record.format!r}: the loaded artifact computes something else than the model under "
            f"surgery ({parity.describe()}); {record.path.name} was not written"
        )


EXPORT_FORMATS: Registry[ExportFormat] = Registry("export.format")


def register_export_format(
    name: str,
    write: Write,
    *,
    load: Load,
    suffix: str,
    holds_hooks: bool = False,
    takes_parts: bool = False,
    folder: bool = False,
    run: Run = run_module,
    exact: bool = True,
    bound: float = 0.999,
    target: DeployTarget | None = None,
    stream: Write | None = None,
    agreement: float = 0.99,
    replace: bool = False,
    takes_plan: bool | None = None,
    holds_g_idx: bool = False,
    holds_float_offset: bool = False,
    also_runs_in: tuple[tuple[str, RuntimeSummary], ...] = (),
) -> ExportFormat:
    """Make ``write``/``load`` available as ``export(..., format=name)`` and ``export.format=name``
    (see :class:`ExportFormat` for the other settings).

    Example:
        >>> register_export_format("torchscript", lambda m, p, o: torch.jit.script(m).save(str(p)),
        ...                        load=torch.jit.load, suffix="pt")

    ``takes_plan`` is ``takes_parts``'s name before 0.3 (warns until 0.4).
    """
    if takes_plan is not None:
        warnings.warn(DEPRECATED_TAKES_PLAN, DeprecationWarning, stacklevel=2)
        takes_parts = bool(takes_plan)
    if not isinstance(suffix, str) or not (suffix.isidentifier() or (folder and suffix == "")):
        raise ConfigTypeError("export suffix", suffix, "must be a file extension without the dot, e.g. 'onnx'")
    chosen = ExportFormat(
        name,
        write,
        load,
        suffix,
        holds_hooks,
        takes_parts,
        folder,
        run,
        exact,
        bound,
        target,
        stream,
        agreement,
        holds_g_idx,
        holds_float_offset,
        also_runs_in,
    )
    registered = EXPORT_FORMATS.register(name, chosen, replace=replace)
    if target is not None:
        DEPLOY_TARGETS[name] = target  # quantize(target=name) reads it there
    return registered


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
            record = replace_field(record, parity=_runtime_parity(chosen, tmp, model, calls, exact))
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


def _runtime_parity(chosen: ExportFormat, tmp: Path, model: nn.Module, calls: list[Call], exact: bool) -> Parity:
    """:func:`_parity` of the written copy ``tmp``; an artifact its runtime cannot load or run (or
    inputs the model cannot take) is said in one line, and nothing is moved into place."""
    try:
        deployable = chosen.load(tmp)
    except (SurgeryError, KeyboardInterrupt):
        raise
    except Exception as err:
        raise ConfigError(
            "export.format",
            chosen.name,
            f"its runtime cannot load the written {type(model).__name__} ({first_line(err)}); nothing was written",
        ) from err
    try:
        found = _parity(chosen, deployable, model, calls, exact)
        return found if found.holds else replace_field(found, why=_buffers_differ(model, deployable))
    except (SurgeryError, KeyboardInterrupt):
        raise
    except Exception as err:
        _refuse_inputs(model, calls, "nothing")
        raise ConfigError(
            "export.format",
            chosen.name,
            f"the written {type(model).__name__} does not run in its runtime on export's inputs "
            f"({first_line(err)}); nothing was written",
        ) from err


def _buffers_differ(model: nn.Module, deployable: Any) -> str:
    """Why a loaded module may compute otherwise than the model: buffers of the same name in
    another dtype (a model cast with ``.to(bfloat16)`` casts its rotary ``inv_freq``, which
    ``from_pretrained(dtype=...)`` keeps in float32). Empty when none differ or it is no module."""
    if not isinstance(deployable, nn.Module):
        return ""
    theirs = dict(deployable.named_buffers())
    differ = [
        (name, mine.dtype, theirs[name].dtype)
        for name, mine in model.named_buffers()
        if name in theirs and mine.is_floating_point() and mine.dtype != theirs[name].dtype
    ]
    if not differ:
        return ""
    name, mine, loaded = differ[0]
    return (
        f"the model's buffer {name} is {str(mine).removeprefix('torch.')}, the loaded one's "
        f"{str(loaded).removeprefix('torch.')} (a model cast with .to() casts buffers that from_pretrained(dtype=...) "
        "keeps): load the model with from_pretrained(dtype=...), or cast those buffers back"
    )


def _refuse_inputs(model: nn.Module, calls: list[Call], name: str) -> None:
    """Raise when the model under surgery itself fails on export's ``inputs``."""
    for index, call in enumerate(calls):
        try:
            with torch.no_grad():
                call(model)
        except Exception as err:
            raise ConfigError(
                "export.inputs",
                f"batch {index}",
                f"{type(model).__name__} fails on it ({first_line(err)}); give batches the model takes "
                f"({name} was written)",
            ) from err


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


def parity(record: ExportRecord, model: nn.Module, calls: list[Call]) -> Parity:
    """Load ``record`` in its runtime and compare its outputs with ``model``'s on ``calls``."""
    chosen = EXPORT_FORMATS.get(record.format)
    return _parity(chosen, record.load(), model, calls, record.exact)


def _parity(chosen: ExportFormat, deployable: Any, model: nn.Module, calls: list[Call], exact: bool) -> Parity:
    """Every output tensor of ``deployable`` against ``model``'s (as it runs, all its surgery
    attached) on ``calls``, measured against what ``chosen`` promises."""
    figures = _ParityFigures()
    for call in calls:
        # routed as the model routes (inside every_expert_calibrated() too): the artifact routes so,
        # and every-expert forwards differ from it in the last bit on some CPUs
        with torch.no_grad(), routed_as("routed"):
            expected = flatten_tensors(call(model), floating_only=False)
        found = chosen.run(deployable, moved(call, device_of(deployable)))  # where the artifact runs
        if len(found) != len(expected):
            raise ConfigError("export.parity", chosen.name, f"gave {len(found)} outputs, the model {len(expected)}")
        for want, got in zip(expected, found):
            figures.add(want.detach().cpu(), got.detach().cpu(), chosen.name)
    expected_kind = "exact" if exact else f"cosine>={chosen.bound}"
    return replace_field(
        figures.result(expected_kind, 1.0 if exact else chosen.agreement), unreached=unreached(model, calls)
    )


class _ParityFigures:
    """Running parity figures: floating outputs by difference and cosine, integer and boolean
    ones by the share of equal entries, NaN or Inf on either side by who gave it."""

    def __init__(self) -> None:
        self.max_abs, self.cosine, self.equal = 0.0, 1.0, True
        self.agreement: float | None = None
        self.nonfinite: dict[str, None] = {}

    def add(self, want: Tensor, got: Tensor, name: str) -> None:
        if got.numel() != want.numel():
            raise ConfigError(
                "export.parity", name, f"gave an output of shape {tuple(got.shape)}, the model {tuple(want.shape)}"
            )
        got = got.reshape(want.shape)
        if want.is_complex():
            want, got = torch.view_as_real(want), torch.view_as_real(got.to(want.dtype))
        if want.is_floating_point():
            self._floating(want.double(), got.double())
            return
        same = want.long() == got.long() if not got.is_floating_point() else want.double() == got.double()
        share = float(same.double().mean()) if same.numel() else 1.0
        self.agreement = share if self.agreement is None else min(self.agreement, share)
        self.equal = self.equal and bool(same.all())

    def _floating(self, want: Tensor, got: Tensor) -> None:
        for side, values in (("the model under surgery", want), ("the artifact", got)):
            if not torch.isfinite(values).all():
                self.nonfinite[side] = None
        same = torch.equal(want, got)
        self.equal = self.equal and same
        if want.numel() and not same:  # equal outputs agree whatever their cosine (two zero outputs have 0)
            self.max_abs = max(self.max_abs, float((want - got).abs().max()))
            cosine = torch.nn.functional.cosine_similarity(want.flatten(), got.flatten(), dim=0)
            self.cosine = min(self.cosine, float(cosine))

    def result(self, expected: str, agreement_bound: float) -> Parity:
        if self.nonfinite:  # max(0.0, nan) is 0.0: a NaN must not fold away
            return Parity(math.inf, math.nan, False, expected, self.agreement, agreement_bound, tuple(self.nonfinite))
        return Parity(self.max_abs, self.cosine, self.equal, expected, self.agreement, agreement_bound)


def _listed(inputs: Inputs) -> list[Any]:
    if isinstance(inputs, (Tensor, dict)):
        return [inputs]
    return list(inputs)


def _size(path: Path) -> int:
    if path.is_dir():
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return path.stat().st_size


def _write_safetensors(model: nn.Module, path: Path, options: dict[str, Any]) -> None:
    if options:
        raise ConfigError("export.options", sorted(options), "format='safetensors' takes no options")
    save_file(cpu_state(model), str(path))


def _stream_safetensors(handle: Any, path: Path, options: dict[str, Any]) -> None:
    """The offloaded model's state, as it computes now, one tensor read at a time."""
    if options:
        raise ConfigError("export.options", sorted(options), "format='safetensors' takes no options")
    state = handle.model.state_dict(keep_vars=True)
    entries = [(name, tuple(value.shape), value.dtype) for name, value in state.items()]
    write_streamed(path, entries, lambda name: handle.value_of(state[name]))


register_export_format(
    "safetensors",
    _write_safetensors,
    load=lambda path: load_file(str(path)),
    suffix="safetensors",
    stream=_stream_safetensors,
)
