"""What a model under surgery hands to a deployment format: each quantized weight's integer grid,
each quantized activation's scale, each pruning mask, gathered from the handles that made them
(each handle's ``export_parts()``) into one :class:`ExportParts`."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from surgery.core.errors import ConfigError
from surgery.core.handles import Handle, members
from surgery.core.inputs import Call
from surgery.ops.numerics.fake_quant import fake_quantize
from surgery.ops.numerics.grid import GridSpec

DEPRECATED_NAMES = {  # the names before 0.3 (warn until 0.4)
    "DeployPlan": "ExportParts",
    "deploy_plan": "gather_export_parts",
}


@dataclass(frozen=True)
class WeightGrid:
    """The integer grid of one quantized weight (``key``: its qualified name): ``scale`` and
    ``zero_point`` are scalars (``axis=None``), one per output channel along ``axis``, or
    (outputs, groups) for ``spec.group_size``. ``outputs`` is the weight's output axis whatever
    the grid (1 for a transformers ``Conv1D``, stored inputs x outputs), so that a per-tensor
    grid lays the weight out as every other grid does. ``g_idx`` (``actorder="group"``): the
    group of each input column of :meth:`rows`; None: groups of consecutive columns."""

    key: str
    spec: GridSpec
    scale: Tensor
    zero_point: Tensor
    axis: int | None
    outputs: int = 0
    g_idx: Tensor | None = None

    @property
    def group_size(self) -> int | None:
        return self.spec.group_size

    @property
    def output_axis(self) -> int:
        """The axis that becomes the rows of :meth:`rows`: the grid's axis, else the weight's outputs."""
        return self.outputs if self.axis is None else self.axis

    def rows(self, value: Tensor) -> Tensor:
        """``value`` as an (outputs, inputs) matrix: the output axis first, the rest flattened."""
        moved = value.movedim(self.output_axis, 0)
        return moved.reshape(moved.shape[0], -1)

    def in_layout(self, matrix: Tensor, shape: torch.Size | tuple[int, ...]) -> Tensor:
        """An (outputs, inputs) ``matrix`` (:meth:`rows`) back in the weight's own layout ``shape``."""
        moved = list(shape)
        moved.insert(0, moved.pop(self.output_axis))
        return matrix.reshape(moved).movedim(0, self.output_axis)

    def row_scales(self, columns: int) -> tuple[Tensor, Tensor]:
        """Scale and zero point (a float offset with ``spec.float_offset``) for every entry of an
        (outputs, ``columns``) matrix, broadcastable."""
        offset = self.zero_point.float() if self.spec.float_offset else self.zero_point.to(torch.int32)
        scale, zero_point = self.scale.float(), offset
        if self.group_size:
            index = torch.arange(columns) // self.group_size if self.g_idx is None else self.g_idx.long().cpu()
            return scale[:, index], zero_point[:, index]
        if self.axis is None:
            return scale.reshape(1, 1), zero_point.reshape(1, 1)
        return scale.reshape(-1, 1), zero_point.reshape(-1, 1)

    def integers(self, value: Tensor) -> Tensor:
        """The grid's integers (int32) of ``value`` as an (outputs, inputs) matrix. ``value`` is
        the weight on the grid, or a quantization-aware training shadow off it: that one is first
        rounded by the simulation's own op (``x × (1 / scale)``, which can round a tie otherwise
        than ``x / scale``), so the integers are the ones the simulation computes with."""
        return self.row_integers(self.rows(value.detach().float().cpu()))

    def row_integers(self, rows: Tensor) -> Tensor:
        """The grid's integers (int32) of the weight already laid out as (outputs, inputs) ``rows``
        (rounded by the simulation's own op first, as :meth:`integers` says)."""
        rows = rows.float()
        scale, zero_point = self.row_scales(rows.shape[1])
        low, high = self.spec.quant_range
        if not self.group_size and not self.spec.is_float:  # a per-group grid is never trained off the grid
            axis = None if self.axis is None else 0
            flat = (scale.reshape(()), zero_point.reshape(())) if axis is None else (scale[:, 0], zero_point[:, 0])
            rows = fake_quantize(rows, *flat, axis, self.spec)
        if self.spec.float_offset:
            return torch.clamp(torch.round((rows + zero_point) / scale), low, high).to(torch.int32)
        return torch.clamp(torch.round(rows / scale) + zero_point, low, high).to(torch.int32)

    def dequantized(self, integers: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
        """(integers - zero point) × scale, as the simulation computes it (float32 matrix; in
        float64, exact, so that rounding it back gives the same integers); with a float offset,
        integers × scale - offset."""
        scale, zero_point = self.row_scales(integers.shape[1])
        if self.spec.float_offset:
            return integers.to(dtype) * scale.to(dtype) - zero_point.to(dtype)
        return (integers - zero_point).to(dtype) * scale.to(dtype)


@dataclass(frozen=True)
class ActivationGrid:
    """The frozen grid of one quantized activation: the ``where`` (``"input"`` or
    ``"output"``) of ``layer`` at its ``call``-th run in a forward (0 unless quantized per
    call), one scale (``axis=None``) or one per channel; ``follows``: the key of the quantizer
    that wrote the tensor it reads (through max-pooling), whose grid it shares; ``step``: the
    handle's kind that made it. A dynamic one
    (``spec.dynamic``) has no scale: each tensor sets its own as it runs."""

    layer: str
    where: str
    spec: GridSpec
    scale: Tensor | None
    zero_point: Tensor | None
    axis: int | None
    call: int = 0
    follows: str | None = None
    step: str = "quantize"  # what made it: "quantize", or "kv_cache" (the keys and values cached)

    @property
    def dynamic(self) -> bool:
        return self.spec.dynamic is not None


@dataclass(frozen=True)
class SparsityMask:
    """A pruning keep-mask on the weight ``key``."""

    key: str
    mask: Tensor


@dataclass
class ExportParts:
    """Everything the handles put on ``model`` that a deployment format may hold (what a format
    registered with ``takes_parts=True`` writes from); ``DeployPlan`` before 0.3."""

    model: nn.Module
    weights: dict[str, WeightGrid] = field(default_factory=dict)
    activations: dict[tuple[str, str, int], ActivationGrid] = field(default_factory=dict)  # (layer, where, call)
    masks: dict[str, Tensor] = field(default_factory=dict)
    unexpressed: list[str] = field(default_factory=list)  # changes no format holds (input rewrites)
    inputs: list[Call] | None = None  # example batches, for formats that trace the model

    def layer_weight(self, layer: str) -> WeightGrid | None:
        """The grid of ``layer``'s ``weight``, if quantized."""
        return self.weights.get(f"{layer}.weight" if layer else "weight")

    def activation(self, layer: str, where: str, call: int = 0) -> ActivationGrid | None:
        return self.activations.get((layer, where, call))

    @property
    def activation_mode(self) -> str:
        """How the handles quantize activations (an export's default ``activations`` option):
        ``"none"``, ``"static"`` (calibrated scales) or ``"dynamic"`` (set as each tensor runs)."""
        if not self.activations:
            return "none"
        return "dynamic" if all(grid.dynamic for grid in self.activations.values()) else "static"


def gather_export_parts(handle: Handle, field_name: str = "export.handle") -> ExportParts:
    """Gather what ``handle`` (or each handle of a group) contributes to a deployed model.

    Raises:
        ConfigError: the handle is no longer attached (restored or baked: its grids are gone).
    """
    model = handle.model
    gathered = ExportParts(model)
    for each in members(handle):
        if each.state != "attached":
            raise ConfigError(field_name, repr(each), f"is {each.state}; export a handle while its surgery is attached")
        parts = each.export_parts()
        for part in parts:
            if isinstance(part, WeightGrid):
                gathered.weights[part.key] = part
            elif isinstance(part, ActivationGrid):
                gathered.activations[(part.layer, part.where, part.call)] = part
            elif isinstance(part, SparsityMask):
                gathered.masks[part.key] = part.mask
        if not parts:
            gathered.unexpressed.extend(each.outside_weights())
    return gathered


def __getattr__(name: str) -> Any:
    """``DeployPlan`` and ``deploy_plan``: the names of :class:`ExportParts` and
    :func:`gather_export_parts` before 0.3 (warn)."""
    if name in DEPRECATED_NAMES:
        new = DEPRECATED_NAMES[name]
        warnings.warn(f"{name} is now {new}; the old name goes away in 0.4", DeprecationWarning, stacklevel=2)
        return globals()[new]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
