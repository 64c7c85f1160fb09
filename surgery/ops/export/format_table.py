"""The table of export formats: :class:`ExportFormat` (how a format writes, loads and runs) and
:func:`register_export_format`, through which the built-in formats register as a user's do."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from surgery.core.errors import ConfigTypeError
from surgery.core.inputs import Call, flatten_tensors
from surgery.core.registry import Registry
from surgery.ops.quantization.targets import DEPLOY_TARGETS, DeployTarget

DEPRECATED_KEYWORDS = (
    "register_export_format(name, write, load=..., ...) is now register_export_format(ExportFormat(name, write, "
    "load=..., ...)); the keyword form goes away in 0.4"
)
DEPRECATED_TAKES_PLAN = "register_export_format(takes_plan=) is now takes_parts=; the old name goes away in 0.4"


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

    def __post_init__(self) -> None:
        suffix = self.suffix
        if not isinstance(suffix, str) or not (suffix.isidentifier() or (self.folder and suffix == "")):
            raise ConfigTypeError("export suffix", suffix, "must be a file extension without the dot, e.g. 'onnx'")

    def __call__(self, source: Any, path: Path, options: dict[str, Any]) -> dict[str, Any] | None:
        return self.write(source, path, options)


EXPORT_FORMATS: Registry[ExportFormat] = Registry("export.format")


def register_export_format(
    chosen: ExportFormat | str, write: Write | None = None, *, replace: bool = False, **settings: Any
) -> ExportFormat:
    """Make ``chosen`` (an :class:`ExportFormat`: its ``write``, ``load``, ``suffix`` and the other
    settings) available as ``export(..., format=chosen.name)`` and ``export.format=<name>``; the
    built-in formats are registered the same way. Returns ``chosen``.

    Example:
        >>> register_export_format(ExportFormat("torchscript", lambda m, p, o: torch.jit.script(m).save(str(p)),
        ...                                     load=torch.jit.load, suffix="pt"))

    Before 0.3 the settings were keywords (``register_export_format(name, write, load=, suffix=,
    ...)``, and ``takes_plan`` was ``takes_parts``): still taken, with a warning, until 0.4.
    """
    if not isinstance(chosen, ExportFormat):
        warnings.warn(DEPRECATED_KEYWORDS, DeprecationWarning, stacklevel=2)
        if "takes_plan" in settings:
            warnings.warn(DEPRECATED_TAKES_PLAN, DeprecationWarning, stacklevel=2)
            settings["takes_parts"] = bool(settings.pop("takes_plan"))
        unknown = sorted(set(settings) - set(ExportFormat.__dataclass_fields__))
        if unknown:
            allowed = ", ".join(ExportFormat.__dataclass_fields__)
            raise ConfigTypeError("register_export_format", unknown[0], f"unknown setting; allowed: {allowed}")
        chosen = ExportFormat(chosen, write, **settings)
    elif write is not None or settings:
        raise ConfigTypeError(
            "register_export_format", chosen.name, "takes an ExportFormat alone: set its settings in it"
        )
    registered = EXPORT_FORMATS.register(chosen.name, chosen, replace=replace)
    if chosen.target is not None:
        DEPLOY_TARGETS.register(chosen.name, chosen.target, replace=True)  # quantize(target=name) reads it there
    return registered


Write = Callable[[Any, Path, dict[str, Any]], None]  # (model, or ExportParts with takes_parts; path; options)


Load = Callable[[Path], Any]  # path -> the deployable object


Run = Callable[[Any, Call], list[Tensor]]  # (deployable, one batch) -> its output tensors, in order


RuntimeSummary = Callable[[Path, nn.Module, list, Any], dict[str, Any]]  # (path, simulation, inputs, metric) -> figures
