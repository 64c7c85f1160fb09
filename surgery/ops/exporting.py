"""``surgery.export``: write a model under surgery in a deployable format, through a registry
of formats. ``safetensors`` (the weights as they compute now) is built in; deployment formats
register the same way a user's format does.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from dataclasses import replace as replace_field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from surgery.core.checkpoints import cpu_state, refuse_existing, write_atomically, write_folder_atomically
from surgery.core.errors import ConfigError, ConfigTypeError
from surgery.core.handles import Handle, HandleGroup
from surgery.core.inputs import Call, Inputs, as_call, flatten_tensors
from surgery.core.registry import Registry
from surgery.core.safetensors_streams import write_streamed
from surgery.ops.deployment import deploy_plan

log = logging.getLogger("surgery")
Write = Callable[[Any, Path, dict[str, Any]], None]  # (model, or DeployPlan with takes_plan; path; options)
Load = Callable[[Path], Any]  # path -> the deployable object
Run = Callable[[Any, Call], list[Tensor]]  # (deployable, one batch) -> its floating outputs


def run_module(deployable: Any, call: Call) -> list[Tensor]:
    """Outputs of a loaded ``nn.Module`` (or any callable taking the batch's arguments)."""
    with torch.no_grad():
        return flatten_tensors(call(deployable))


@dataclass(frozen=True)
class DeployTarget:
    """How ``quantize(..., target=FORMAT)`` simulates what that format's runtime computes:
    BatchNorm folded first (``fold_batchnorm``), only ``layers`` of these types quantized,
    activations at their ``where``, and the QuantSpec fields its kernels fix (``weights``,
    ``activations``: field -> value)."""

    fold_batchnorm: bool = False
    layers: Any = (nn.Linear,)  # a selection (layer types, or a predicate(module, name))
    where: str = "input"
    weights: dict[str, Any] = field(default_factory=dict)
    activations: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ExportFormat:
    """A registered export format: ``write(model, path, options)`` writes ``path`` (a file, or
    with ``folder`` a folder; written atomically around it) and may return notes
    (``{"exact": False, "left_out": [...], "int8_ops": (n, of)}``); ``load(path)`` gives back the deployable object
    and ``run(deployable, call)`` its outputs on one batch.

    ``takes_plan``: ``write`` gets the :class:`~surgery.ops.deployment.DeployPlan` (the model
    with each quantized weight's integer grid, activation scales and masks) instead of the
    model. ``exact``: the loaded artifact computes what the model under surgery computes, bit
    for bit (a weights file, weight-only formats that dequantize); otherwise ``bound`` is the
    smallest cosine similarity its outputs keep (int8 kernels round differently). ``stream``
    writes the same from an offloaded model (:func:`surgery.offloaded`, or what a verb made of
    it), given the handle, reading each tensor as it is written."""

    name: str
    write: Write
    load: Load
    suffix: str
    holds_hooks: bool = False  # the file keeps what hooks do (activation quantization, rewrites)
    takes_plan: bool = False
    folder: bool = False
    run: Run = run_module
    exact: bool = True
    bound: float = 0.999
    target: DeployTarget | None = None
    stream: Write | None = None  # writes an offloaded model's result reading one tensor at a time

    @property
    def runnable(self) -> bool:
        """Whether what ``load`` gives back runs (a deployment format), so parity can be measured."""
        return self.takes_plan or self.run is not run_module

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
        """The floating outputs of a loaded artifact (``load()``) on one batch."""
        return EXPORT_FORMATS.get(self.format).run(deployable, as_call(batch))

    def as_dict(self) -> dict[str, Any]:
        found = {"path": self.path.name, "format": self.format, "bytes": self.bytes}
        found |= {"parity": self.parity.as_dict()} if self.parity is not None else {}
        found |= {"int8_ops": list(self.int8_ops)} if self.int8_ops is not None else {}
        return found | ({"left_out": self.left_out} if self.left_out else {})


@dataclass(frozen=True)
class Parity:
    """The loaded artifact against the model under surgery on the same batches: the largest
    absolute difference, the smallest cosine similarity of any output, and whether every output
    is equal bit for bit; ``expected`` is what the format promises (``"exact"`` or a cosine)."""

    max_abs: float
    cosine: float
    equal: bool
    expected: str

    @property
    def holds(self) -> bool:
        if self.expected == "exact":
            return self.equal
        return math.isfinite(self.max_abs) and self.cosine >= float(self.expected.removeprefix("cosine>="))

    def as_dict(self) -> dict[str, Any]:
        return {
            "max_abs": self.max_abs,
            "cosine": self.cosine,
            "equal": self.equal,
            "expected": self.expected,
            "holds": self.holds,
        }


EXPORT_FORMATS: Registry[ExportFormat] = Registry("export.format")


def register_export_format(
    name: str,
    write: Write,
    *,
    load: Load,
    suffix: str,
    holds_hooks: bool = False,
    takes_plan: bool = False,
    folder: bool = False,
    run: Run = run_module,
    exact: bool = True,
    bound: float = 0.999,
    target: DeployTarget | None = None,
    stream: Write | None = None,
    replace: bool = False,
) -> ExportFormat:
    """Make ``write``/``load`` available as ``export(..., format=name)`` and ``export.format=name``
    (see :class:`ExportFormat` for the other settings).

    Example:
        >>> register_export_format("torchscript", lambda m, p, o: torch.jit.script(m).save(str(p)),
        ...                        load=torch.jit.load, suffix="pt")
    """
    if not isinstance(suffix, str) or not (suffix.isidentifier() or (folder and suffix == "")):
        raise ConfigTypeError("export suffix", suffix, "must be a file extension without the dot, e.g. 'onnx'")
    chosen = ExportFormat(name, write, load, suffix, holds_hooks, takes_plan, folder, run, exact, bound, target, stream)
    return EXPORT_FORMATS.register(name, chosen, replace=replace)


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
            scale from the handles, so they need the handle, attached.
        path: the file (or, for folder formats such as ``"compressed-tensors"``, the folder) to
            write; an existing one is refused unless ``overwrite``. What the model does outside
            its weights and the format cannot hold is logged and listed in ``record.left_out``.
        format: a registered format (:func:`register_export_format`): ``"safetensors"`` writes
            the weights as they compute now (pruned zeros, quantized values);
            ``"compressed-tensors"``, ``"torchao"`` and ``"onnx"`` write integer weights for
            their runtimes (the ``deploy`` extra).
            An offloaded model's handle (:func:`surgery.offloaded`), or what a verb made of
            it, is streamed: one tensor read at a time, in the formats that stream
            (``"safetensors"``, ``"compressed-tensors"``).
        inputs: batches (or one) to compare the artifact, loaded in its runtime, with the model
            under surgery: ``record.parity``. Formats that trace the model (``"onnx"``) need them.
        compare: ``False``: ``inputs`` only trace the model, no parity is measured.
        **options: passed to the format's writer.

    Example:
        >>> record = surgery.export(surgery.prune(model, 0.5), "pruned.safetensors")
        >>> record.bytes, sorted(record.load())[:1]
    """
    chosen = EXPORT_FORMATS.get(format)
    if getattr(handle, "streams", False):
        return _export_streamed(handle, chosen, Path(path), overwrite, inputs, options)
    model = handle if isinstance(handle, nn.Module) else getattr(handle, "model", None)
    if not isinstance(model, nn.Module):
        raise ConfigTypeError("export.handle", type(handle).__name__, "must be a handle, a handle group or a model")
    path = Path(path)
    if chosen.suffix and path.suffix != f".{chosen.suffix}":
        raise ConfigError("export.path", str(path), f"must end in .{chosen.suffix} for format={format!r}")
    refuse_existing([path], overwrite)
    calls = None if inputs is None else [as_call(b) for b in _listed(inputs)]
    source: Any = model
    left_out: list[str] = []
    if chosen.takes_plan:
        if not isinstance(handle, Handle):
            raise ConfigTypeError(
                "export.handle", type(handle).__name__, f"format={format!r} needs the handle a verb returned"
            )
        source = deploy_plan(handle)
        source.inputs = calls
        if source.unexpressed:
            raise ConfigError(
                "export.handle", "; ".join(source.unexpressed), f"cannot be expressed in format={format!r}"
            )
    elif not chosen.holds_hooks and isinstance(handle, Handle):
        left_out = handle.outside_weights()
    writer = write_folder_atomically if chosen.folder else write_atomically
    notes: dict[str, Any] = {}
    writer(path, lambda tmp: notes.update(chosen(source, tmp, options) or {}))
    if left_out:
        log.warning("export: format=%r holds the weights only; not in %s: %s", format, path.name, "; ".join(left_out))
    left_out += notes.get("left_out", [])
    exact, int8_ops = notes.get("exact", chosen.exact), notes.get("int8_ops")
    record = ExportRecord(path, format, _size(path), dict(options), left_out, exact=exact, int8_ops=int8_ops)
    if calls and compare and chosen.runnable:
        record = replace_field(record, parity=parity(record, model, calls))
        _warn_unless_held(record)
    return record


def _warn_unless_held(record: ExportRecord) -> None:
    """A loaded artifact that does not compute what the simulation computes is said out loud."""
    found = record.parity
    if found is not None and not found.holds:
        log.warning(
            "export: the loaded %s computes something else than the model under surgery (max abs %.3g, "
            "cosine %.6f, expected %s); record.parity has the figures",
            record.format,
            found.max_abs,
            found.cosine,
            found.expected,
        )


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
    refuse_existing([path], overwrite)
    calls = None if inputs is None else [as_call(b) for b in _listed(inputs)]
    writer = write_folder_atomically if chosen.folder else write_atomically
    notes: dict[str, Any] = {}
    writer(path, lambda tmp: notes.update(chosen.stream(handle, tmp, options) or {}))
    left_out = notes.get("left_out", [])
    record = ExportRecord(
        path, chosen.name, _size(path), dict(options), left_out, exact=notes.get("exact", chosen.exact)
    )
    if calls and chosen.runnable:
        record = replace_field(record, parity=parity(record, handle.model, calls))
        _warn_unless_held(record)
    return record


def parity(record: ExportRecord, model: nn.Module, calls: list[Call]) -> Parity:
    """Load ``record`` in its runtime and compare its outputs with ``model``'s on ``calls``."""
    chosen = EXPORT_FORMATS.get(record.format)
    deployable = record.load()
    worst_abs, worst_cosine, equal = 0.0, 1.0, True
    for call in calls:
        with torch.no_grad():
            expected = flatten_tensors(call(model))
        found = chosen.run(deployable, call)
        if len(found) != len(expected):
            raise ConfigError("export.parity", record.format, f"gave {len(found)} outputs, the model {len(expected)}")
        for want, got in zip(expected, found):
            want, got = want.detach().float().cpu(), got.detach().float().cpu().reshape(want.shape)
            equal = equal and torch.equal(want, got)
            worst_abs = max(worst_abs, float((want - got).abs().max())) if want.numel() else worst_abs
            cosine = torch.nn.functional.cosine_similarity(want.double().flatten(), got.double().flatten(), dim=0)
            worst_cosine = min(worst_cosine, float(cosine)) if want.numel() else worst_cosine
            if not torch.isfinite(got).all():
                worst_abs, worst_cosine = math.inf, math.nan
    expected_kind = "exact" if record.exact else f"cosine>={chosen.bound}"
    return Parity(worst_abs, worst_cosine, equal, expected_kind)


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
