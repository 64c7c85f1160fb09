"""Quantizer settings, range observers, and scale/zero-point computation (as torch.ao)."""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, NamedTuple

import torch
from torch import Tensor

from surgery.core.errors import ConfigError, ConfigTypeError
from surgery.core.registry import Registry
from surgery.core.settings import whole_count
from surgery.ops.numerics.number_formats import FORMATS, NumberFormat
from surgery.ops.numerics.weight_methods import WEIGHT_METHODS

log = logging.getLogger("surgery")
DEPRECATED_QUANTSPEC = "QuantSpec is now GridSpec (the grid of one tensor; QuantizeSpec is the verb's settings); the old name goes away in 0.4"
# set by quantize_kv_cache: keys and values are never constant by construction, so a constant range is bad data
VARIED_RANGES_REQUIRED: ContextVar[bool] = ContextVar("VARIED_RANGES_REQUIRED", default=False)

_QUANTILE_LIMIT = 1 << 24  # torch.quantile's input size limit


class ObservedRange(NamedTuple):
    """An observer's running estimate: per-channel (or single) ``low`` and ``high``, and how
    many batches it has seen."""

    low: Tensor
    high: Tensor
    batches: int


ObserverFn = Callable[[Tensor, ObservedRange | None, "GridSpec"], tuple[Tensor, Tensor]]
OBSERVERS: Registry[ObserverFn] = Registry("quantize.observer")
WEIGHTED_OBSERVERS: set[str] = set()  # the registered names called with each value's importance


def register_observer(name: str, observe: ObserverFn, *, replace: bool = False, importance: bool = False) -> ObserverFn:
    """Make ``observe(x, previous, spec) -> (low, high)`` available as ``GridSpec(observer=name)``.

    ``x`` is the batch as a float32 ``(channels, values)`` matrix (one row per tensor),
    ``previous`` the :class:`ObservedRange` so far (``None`` on the first batch); return the
    new per-row ``low`` and ``high``.

    ``importance=True``: a weights-only observer called ``observe(x, None, spec, importance)``,
    ``importance`` shaped as ``x``: each value's weight in the error, its input column's
    calibration energy E[x²] relative to the layer's mean (``imatrix_mse``); the spec then
    needs calibration batches.

    Example:
        >>> surgery.register_observer("absmax", lambda x, prev, spec: (-x.abs().amax(1), x.abs().amax(1)))
    """
    if not callable(observe):
        raise ConfigError("register_observer.observe", observe, "must be a function (x, previous, spec) -> (low, high)")
    found = OBSERVERS.register(name, observe, replace=replace)
    (WEIGHTED_OBSERVERS.add if importance else WEIGHTED_OBSERVERS.discard)(name)
    return found


def relative_importance(energy: Tensor) -> Tensor:
    """Each input column's calibration energy E[x²] over the layer's mean (llm-compressor's
    imatrix normalisation): the ``importance`` a weighted observer receives, per column."""
    energy = energy.float()
    return energy / (energy.mean() + torch.finfo(torch.float32).tiny)


def minmax(x: Tensor, previous: ObservedRange | None, spec: GridSpec) -> tuple[Tensor, Tensor]:
    """Running extremes."""
    low, high = x.amin(dim=1), x.amax(dim=1)
    if previous is None:
        return low, high
    return torch.minimum(previous.low, low), torch.maximum(previous.high, high)


def moving_average(x: Tensor, previous: ObservedRange | None, spec: GridSpec) -> tuple[Tensor, Tensor]:
    """Exponential moving average of each batch's extremes (``spec.averaging``), as torch.ao."""
    low, high = x.amin(dim=1), x.amax(dim=1)
    if previous is None:
        return low, high
    c = spec.averaging
    low, high = previous.low + c * (low - previous.low), previous.high + c * (high - previous.high)
    # a channel whose every value is the same can come out of the two averages one ulp apart,
    # the wrong way round (c = 1: a + (b - a) need not be b); its range is that one value
    return low, torch.maximum(high, low)


def percentile(x: Tensor, previous: ObservedRange | None, spec: GridSpec) -> tuple[Tensor, Tensor]:
    """The ``100 - p`` and ``p`` quantiles of each batch, averaged over batches."""
    if x.numel() > _QUANTILE_LIMIT:
        x = x[:, :: math.ceil(x.numel() / _QUANTILE_LIMIT)]
    q = torch.tensor([100 - spec.percentile, spec.percentile], dtype=x.dtype, device=x.device) / 100
    low, high = torch.quantile(x, q, dim=1)
    if previous is None:
        return low, high
    n = previous.batches
    return (previous.low * n + low) / (n + 1), (previous.high * n + high) / (n + 1)


def full_range(x: Tensor, previous: ObservedRange | None, spec: GridSpec) -> tuple[Tensor, Tensor]:
    """Running extremes made symmetric about zero on an affine grid of ``2^bits`` levels, the
    extra level on the side of each row's larger magnitude ``M``: scale ``M / 2^(bits-1)``, zero
    point ``2^(bits-1)`` (``-M`` the lowest level) or ``2^(bits-1) - 1`` (``M`` the highest):
    llama.cpp's Q4_0/Q5_0 grids and auto-round's ``int_sym``."""
    low, high = minmax(x, previous, spec)
    low, high = low.clamp(max=0), high.clamp(min=0)
    shrink = 1 - 2.0 ** (1 - spec.bits)  # the short side: (2^(bits-1) - 1) / 2^(bits-1) of M
    largest = torch.maximum(-low, high)
    negative = -low > high  # a tie goes to the positive side, as auto-round's int_sym
    return torch.where(negative, -largest, -largest * shrink), torch.where(negative, largest * shrink, largest)


for _observer in (minmax, moving_average, percentile, full_range):
    register_observer(_observer.__name__, _observer)


@dataclass(frozen=True)
class GridSpec:
    """The grid one kind of tensor is fake-quantized onto (a weight's or an activation's); not
    to be confused with :class:`~surgery.QuantizeSpec`, the settings of the ``quantize`` verb,
    which holds one ``GridSpec`` for the weights and one for the activations. Validated when
    built (``GridSpec(bits=9)`` raises) and immutable, so a spec is safe to share. It was called
    ``QuantSpec`` before 0.3; that name still works, with a ``DeprecationWarning``, until 0.4.

    ``bits`` in [2, 8]; ``symmetric`` uses signed integers and a zero point of 0, otherwise
    unsigned integers with an affine zero point; ``per_channel`` gives one scale per channel
    (weights: output channels; activations: dim 1 of conv outputs, the last dim of linear
    outputs). ``observer`` picks how ranges are estimated: ``minmax`` (running extremes),
    ``moving_average`` (``averaging`` constant, as torch.ao), ``percentile`` (the
    ``percentile``/``100 - percentile`` quantiles of each batch, averaged over batches),
    ``full_range`` (affine grids: symmetric about zero with the extra level on the side of the
    larger magnitude, as llama.cpp's Q4_0 and auto-round's ``int_sym``), any
    name added with :func:`register_observer`, or such a function itself.

    Activations only: ``dynamic`` computes the scale from each tensor as it runs, with no
    calibration: ``"token"`` (one per token, each row of the last dimension, as llm-compressor's
    and torchao's dynamic int8/fp8 inputs) or ``"tensor"`` (one per call); ``None`` (default):
    a static scale from calibration. ``rounding`` is how a dynamic value meets its integer grid,
    as the runtime computes it: ``"divide"`` rounds ``x / scale`` (compressed-tensors, vLLM),
    ``"reciprocal"`` rounds ``x * (1 / scale)`` (torchao); the two differ on about one value in
    a thousand, which a deep model amplifies (``target=`` sets the runtime's).

    Weights only: ``group_size`` gives every ``group_size`` consecutive inputs of each output
    its own scale (in the order of ``weight.reshape(out, -1)``; finer than ``per_channel``);
    ``method`` is ``"rtn"`` (round to nearest) or ``"gptq"`` (rounds input column after column
    and moves each column's error onto the columns not yet rounded, through the inverse
    Hessian of the layer's calibration inputs; Frantar et al. 2023) or ``"gptaq"`` (GPTQ fitted
    to the float model's outputs; Li et al. 2025). ``actorder`` (GPTQ, GPTAQ):
    ``None`` walks the columns in order; ``"weight"`` walks them by decreasing activation energy
    (the Hessian's diagonal) while each column keeps its own group's grid, so the stored format
    is unchanged (llm-compressor's ``actorder="weight"``, its default); ``"group"`` sorts the
    columns by that diagonal first and makes every ``group_size`` consecutive columns of the
    sorted order a group (the GPTQ authors' ``actorder=True``, AutoGPTQ's ``desc_act``,
    llm-compressor's ``"group"``/``"dynamic"``): groups are then scattered over the inputs and
    each weight stores ``g_idx``, the group of every input column. Without ``group_size``,
    ``"group"`` is ``"weight"`` (one grid for all columns). ``"autoround"`` tunes
    each weight's rounding and its groups' ranges by signed gradient descent on every block's
    output error (Cheng et al., intel/auto-round), for ``iterations`` steps per block, on the
    integer grids (``observer="full_range"``: auto-round's ``int_sym``), ``mxfp4`` and ``nvfp4``.
    ``scale_dtype`` (integer grids): ``"float16"`` or ``"bfloat16"`` rounds every scale to that
    dtype as it is computed, so methods round the weights against the scale a format stores
    (GGUF's fp16 block scales); ``None`` keeps float32 scales (rounded to a half-precision
    weight's dtype once a method is done).
    ``super_group`` with ``scale_bits`` (integer grids in groups): two-level scales, as
    llama.cpp's K-quants store them; every ``super_group`` consecutive inputs (a multiple of
    ``group_size``) share one scale ``d`` in ``scale_dtype`` (``max group scale / (2^scale_bits
    - 1)``), and each group's scale is ``d`` times an integer in [1, 2^scale_bits - 1], the
    nearest to the scale the observer found. The zero point must not depend on the scale:
    ``symmetric`` or ``observer="full_range"``.
    ``float_offset`` (affine weight grids, per channel or in groups): each group stores a float offset ``m``
    instead of an integer zero point, ``value = scale × q - m`` with ``q`` in [0, 2^bits - 1]
    and ``m = -min`` of the group's range (llama.cpp's Q4_1/Q5_1 minimum and the K-quants'
    mins), ``m`` rounded to ``scale_dtype`` where set; with ``super_group``, every super group's
    offsets share one stored ``dmin``, each ``dmin`` times an integer in [0, 2^scale_bits - 1].
    """

    bits: int = 8
    symmetric: bool = False
    per_channel: bool = False
    observer: Any = "minmax"  # a registered observer name, or an ObserverFn
    percentile: float = 99.99
    averaging: float = 0.01
    method: str = "rtn"
    group_size: int | None = None
    format: str = (
        "int"  # or a floating-point grid: fp8_e4m3, fp8_e5m2, mxfp4, nvfp4 (surgery.ops.numerics.number_formats)
    )
    dynamic: str | None = None  # activations: "token" or "tensor" scales computed as each tensor runs
    rounding: str = "divide"  # dynamic activations: round x / scale ("divide") or x * (1 / scale) ("reciprocal")
    actorder: str | None = None  # GPTQ's column order: None (as stored), "weight" or "group" (by activation energy)
    iterations: int = 200  # AutoRound's signed-gradient steps per block (its learning rate is 1 / iterations)
    scale_dtype: str | None = None  # integer grids: "float16"/"bfloat16" rounds each scale as it is computed
    super_group: int | None = None  # inputs sharing one scale_dtype scale over the groups' integer scales
    scale_bits: int | None = None  # with super_group: each group's scale an integer in [1, 2^scale_bits - 1] x it
    float_offset: bool = False  # affine groups: value = scale x q - offset, the offset a float (GGUF's minimums)

    def __post_init__(self) -> None:
        _check(self, "GridSpec")
        block = self.number_format.block_size
        if block is not None and self.group_size is None:  # a micro-scaled format's blocks are its groups
            object.__setattr__(self, "group_size", block)

    @classmethod
    def build(cls, values: Mapping[str, Any], field: str) -> GridSpec:
        """A spec from a dict of fields, errors naming ``field.<key>`` (as a config file spells it)."""
        unknown = sorted(set(values) - set(cls.__dataclass_fields__))
        if unknown:
            raise ConfigError(field, unknown[0], f"unknown setting; allowed: {', '.join(cls.__dataclass_fields__)}")
        defaults = {name: f.default for name, f in cls.__dataclass_fields__.items()}
        _check(SimpleNamespace(**{**defaults, **values}), field)
        return cls(**values)

    def validate(self, field: str) -> GridSpec:
        """Check again with errors naming ``field.<key>`` (a spec is already valid once built)."""
        _check(self, field)
        return self

    @property
    def observer_name(self) -> str:
        return self.observer if isinstance(self.observer, str) else getattr(self.observer, "__name__", "custom")

    @property
    def weighted(self) -> bool:
        """Whether the observer weighs each value by its input column's calibration energy (``imatrix_mse``)."""
        return isinstance(self.observer, str) and self.observer in WEIGHTED_OBSERVERS

    def observe(
        self, x: Tensor, previous: ObservedRange | None, importance: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """Update a range estimate with ``x`` (``(channels, values)``) through the observer
        (``importance``, shaped as ``x``: each value's weight, for a :attr:`weighted` observer)."""
        fn = self.observer if callable(self.observer) else OBSERVERS.get(self.observer)
        if not self.weighted:
            return fn(x, previous, self)
        if importance is None:
            raise ConfigError(
                "quantize.weights.observer",
                self.observer,
                "weighs each input column by its calibration energy; this weight has none "
                "(it is quantized outside a calibrated method: use rtn, gptq or gptaq with calibration)",
            )
        return fn(x, previous, self, importance)

    def as_dict(self) -> dict[str, Any]:
        """The fields, the observer by name (JSON-serialisable)."""
        return {**{name: getattr(self, name) for name in self.__dataclass_fields__}, "observer": self.observer_name}

    @property
    def number_format(self) -> NumberFormat:
        return FORMATS.get(self.format)

    @property
    def is_float(self) -> bool:
        """Rounded onto a floating-point grid (scale only, zero point 0)."""
        return self.number_format.is_float

    @property
    def quant_range(self) -> tuple[int, int]:
        """(quant_min, quant_max) of the integer grid."""
        if self.is_float:
            raise ConfigError("quantize.format", self.format, "has no integer range (a floating-point grid)")
        if self.symmetric:
            return -(1 << (self.bits - 1)), (1 << (self.bits - 1)) - 1
        return 0, (1 << self.bits) - 1


def _check(spec: Any, field: str) -> None:
    """Raise :class:`ConfigError` naming ``field.<key>`` for any value out of range."""
    if isinstance(spec.bits, bool) or not isinstance(spec.bits, int):
        raise ConfigTypeError(f"{field}.bits", spec.bits, "must be an integer in [2, 8]")
    if not 2 <= spec.bits <= 8:
        raise ConfigError(f"{field}.bits", spec.bits, "must be an integer in [2, 8]")
    for flag in ("symmetric", "per_channel"):
        if not isinstance(getattr(spec, flag), bool):
            raise ConfigTypeError(f"{field}.{flag}", getattr(spec, flag), "must be true or false")
    if not callable(spec.observer) and spec.observer not in OBSERVERS:
        raise ConfigError(
            f"{field}.observer",
            spec.observer,
            f"must be one of {', '.join(OBSERVERS.names())} (or a function registered with register_observer)",
        )
    if isinstance(spec.percentile, bool) or not (
        isinstance(spec.percentile, (int, float)) and 50 < spec.percentile <= 100
    ):
        raise ConfigError(f"{field}.percentile", spec.percentile, "must be a number in (50, 100]")
    if isinstance(spec.averaging, bool) or not (isinstance(spec.averaging, (int, float)) and 0 < spec.averaging <= 1):
        raise ConfigError(f"{field}.averaging", spec.averaging, "must be a number in (0, 1]")
    if spec.method not in WEIGHT_METHODS:
        allowed = ", ".join(WEIGHT_METHODS.names())
        raise ConfigError(f"{field}.method", spec.method, f"must be one of {allowed} (or a registered weight method)")
    size = spec.group_size
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= 1 << 20):
        raise ConfigError(
            f"{field}.group_size", size, "must be null or a whole number of inputs in [1, 1048576] (e.g. 32, 64, 128)"
        )
    _check_format(spec, field)
    _check_full_range(spec, field)
    _check_dynamic(spec, field)
    _check_actorder(spec, field)
    _check_iterations(spec, field)
    _check_scale_dtype(spec, field)
    _check_super_group(spec, field)
    _check_float_offset(spec, field)


SCALE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def _check_scale_dtype(spec: Any, field: str) -> None:
    if spec.scale_dtype is None:
        return
    if spec.scale_dtype not in SCALE_DTYPES:
        raise ConfigError(f"{field}.scale_dtype", spec.scale_dtype, f"must be null, {' or '.join(SCALE_DTYPES)}")
    if FORMATS.get(spec.format).is_float:
        raise ConfigError(
            f"{field}.scale_dtype",
            spec.scale_dtype,
            f"applies to integer grids; format {spec.format!r} fixes its scales",
        )


def stored_scale(scale: Tensor, spec: GridSpec) -> Tensor:
    """``scale`` rounded to ``spec.scale_dtype`` (kept in float32, at least that dtype's
    smallest normal so it stays positive); as it is without one."""
    if spec.scale_dtype is None:
        return scale
    dtype = SCALE_DTYPES[spec.scale_dtype]
    return _in_range(scale.to(dtype).float().clamp_min(torch.finfo(dtype).smallest_normal), scale, spec, "scale")


def _in_range(stored: Tensor, given: Tensor, spec: GridSpec, what: str) -> Tensor:
    """``stored``, unless rounding to ``scale_dtype`` overflowed a finite value: refused in one line."""
    overflow = torch.isinf(stored) & torch.isfinite(given)
    if bool(overflow.any()):
        largest = torch.finfo(SCALE_DTYPES[spec.scale_dtype]).max
        raise ConfigError(
            "quantize.weights.scale_dtype",
            spec.scale_dtype,
            f"cannot hold a group's {what} {float(given[overflow].flatten()[0]):.6g} (its largest is {largest:g}): "
            "a weight is too large for this grid; exclude its layer or rescale it",
        )
    return stored


def _check_super_group(spec: Any, field: str) -> None:
    size, bits = spec.super_group, spec.scale_bits
    if size is None and bits is None:
        return
    if size is None or bits is None:
        raise ConfigError(
            f"{field}.super_group", size, "and scale_bits are set together (e.g. 256 and 6) or not at all"
        )
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ConfigError(f"{field}.scale_bits", bits, "must be a whole number of bits in [1, 8]")
    group = spec.group_size
    if isinstance(size, bool) or not isinstance(size, int) or not group or size <= group or size % group:
        raise ConfigError(
            f"{field}.super_group", size, f"must be a multiple of group_size (group_size={group}; e.g. 256 for 16)"
        )
    if spec.scale_dtype is None or FORMATS.get(spec.format).is_float:
        raise ConfigError(
            f"{field}.super_group", size, "needs an integer format and scale_dtype (the super group's stored scale)"
        )
    if not spec.symmetric and spec.observer != "full_range" and spec.float_offset is not True:
        raise ConfigError(
            f"{field}.super_group",
            size,
            "rounds each group's scale, so its zero point must not depend on it: set symmetric=true, "
            "observer='full_range' or float_offset=true",
        )
    if spec.actorder == "group":
        raise ConfigError(
            f"{field}.actorder", "group", "scatters the groups over the inputs; super groups need consecutive ones"
        )


def _check_float_offset(spec: Any, field: str) -> None:
    if not isinstance(spec.float_offset, bool):
        raise ConfigTypeError(f"{field}.float_offset", spec.float_offset, "must be true or false")
    if not spec.float_offset:
        return
    problem = (
        "applies to integer formats"
        if FORMATS.get(spec.format).is_float
        else "applies to affine grids (symmetric=false)"
        if spec.symmetric
        else "is symmetric about zero (an integer zero point); use observer='minmax' or a searched one"
        if spec.observer == "full_range"
        else "applies to weights per channel or in groups (set group_size)"
        if not (spec.group_size or spec.per_channel) or spec.dynamic is not None
        else None
    )
    if problem:
        raise ConfigError(f"{field}.float_offset", True, problem)


def super_grouped(scale: Tensor, spec: GridSpec) -> Tensor:
    """(outputs, groups) ``scale`` on ``spec``'s two-level grid: every ``super_group`` inputs'
    groups share ``d`` (their largest scale over ``2^scale_bits - 1``, in ``scale_dtype``), the
    largest group ``d`` times that top level and every other ``d`` times the nearest integer in
    [1, 2^scale_bits - 1] (as llama.cpp's K-quants; exact in float32)."""
    return _on_two_levels(scale, spec, 1)


def super_grouped_offsets(offset: Tensor, spec: GridSpec) -> Tensor:
    """(outputs, groups) float offsets on the two-level grid, as :func:`super_grouped` puts the
    scales, under one ``dmin`` a super group, each an integer in [0, 2^scale_bits - 1] times it."""
    return _on_two_levels(offset, spec, 0)


def _on_two_levels(values: Tensor, spec: GridSpec, least: int) -> Tensor:
    if spec.super_group is None:
        return values
    top = (1 << spec.scale_bits) - 1
    rows, groups = values.shape
    per = spec.super_group // spec.group_size
    if groups % per:
        raise ConfigError(
            "quantize.weights.super_group",
            spec.super_group,
            f"needs weights whose inputs are a multiple of it ({groups * spec.group_size} inputs)",
        )
    blocks = values.float().reshape(rows, -1, per)
    largest = blocks.amax(-1, keepdim=True)
    d = super_scale(largest, spec)
    at_top = (blocks == largest) & (largest > 0)  # a super group of zero offsets keeps them zero
    levels = torch.where(at_top, top, torch.clamp(torch.round(blocks / d), least, top))
    return (d * levels).reshape(rows, groups)


def stored_offset(offset: Tensor, spec: GridSpec) -> Tensor:
    """A float offset rounded to ``spec.scale_dtype`` (zero stays zero); as it is without one."""
    if spec.scale_dtype is None:
        return offset
    return _in_range(offset.to(SCALE_DTYPES[spec.scale_dtype]).float(), offset, spec, "offset")


def fake_quantize_offset(x: Tensor, scale: Tensor, offset: Tensor, spec: GridSpec) -> Tensor:
    """``x`` on a float-offset grid: ``q = clamp(round((x + offset) / scale))``, then ``scale × q
    - offset`` in float32, as GGUF's dequantizers compute it (``scale``, ``offset`` broadcast)."""
    low, high = spec.quant_range
    q = torch.clamp(torch.round((x.float() + offset) / scale), low, high)
    return (q * scale - offset).to(x.dtype)


def super_scale(largest: Tensor, spec: GridSpec) -> Tensor:
    """The stored scale ``d`` of super groups whose largest group scale is ``largest``: over
    the top level, in ``scale_dtype`` (a subnormal where small, as llama.cpp stores it; never 0)."""
    dtype = SCALE_DTYPES[spec.scale_dtype]
    info = torch.finfo(dtype)
    return (largest / ((1 << spec.scale_bits) - 1)).to(dtype).float().clamp_min(info.smallest_normal * info.eps)


def _check_full_range(spec: Any, field: str) -> None:
    if spec.observer != "full_range" or not (spec.symmetric or FORMATS.get(spec.format).is_float):
        return
    raise ConfigError(
        f"{field}.observer",
        "full_range",
        "is symmetric about zero on an affine integer grid (zero point 2^(bits-1) or 2^(bits-1) - 1); "
        "set symmetric=false and an integer format",
    )


ITERATIONS_LIMIT = 10_000  # AutoRound's steps: its rate is 1/iterations, so more add no movement, only hours


def _check_iterations(spec: Any, field: str) -> None:
    whole_count(f"{field}.iterations", spec.iterations, "tuning steps", at_most=ITERATIONS_LIMIT, example=200)


ACTORDER = ("weight", "group")  # "group": groups formed in the sorted order, a g_idx stored


def _check_actorder(spec: Any, field: str) -> None:
    if spec.actorder is None:
        return
    if spec.actorder not in ACTORDER:
        raise ConfigError(f"{field}.actorder", spec.actorder, f"must be null or {', '.join(map(repr, ACTORDER))}")
    if spec.method not in ("gptq", "gptaq"):
        raise ConfigError(
            f"{field}.actorder", spec.actorder, f"orders GPTQ's walk over the columns; method is {spec.method!r}"
        )


DYNAMIC = ("token", "tensor")
ROUNDING = ("divide", "reciprocal")  # round(x / scale): compressed-tensors, vLLM; round(x * (1 / scale)): torchao


def _check_dynamic(spec: Any, field: str) -> None:
    if spec.rounding not in ROUNDING:
        raise ConfigError(f"{field}.rounding", spec.rounding, f"must be {' or '.join(ROUNDING)}")
    if spec.dynamic is None:
        return
    if spec.dynamic not in DYNAMIC:
        raise ConfigError(f"{field}.dynamic", spec.dynamic, f"must be null, {' or '.join(DYNAMIC)}")
    if spec.per_channel:
        raise ConfigError(
            f"{field}.per_channel", True, f"dynamic={spec.dynamic!r} gives the scales; set per_channel=false"
        )


def _check_format(spec: Any, field: str) -> None:
    if not isinstance(spec.format, str) or spec.format not in FORMATS:
        raise ConfigError(f"{field}.format", spec.format, f"must be one of {', '.join(FORMATS.names())}")
    fmt = FORMATS.get(spec.format)
    if not fmt.is_float:
        return
    if spec.bits not in (8, fmt.bits):
        raise ConfigError(
            f"{field}.bits", spec.bits, f"does not apply to format {fmt.name!r} ({fmt.bits} bits): leave it at 8"
        )
    if fmt.block_size is not None and spec.group_size not in (None, fmt.block_size):
        raise ConfigError(
            f"{field}.group_size",
            spec.group_size,
            f"is fixed by format {fmt.name!r}: blocks of {fmt.block_size} (leave it null)",
        )


class NonFiniteError(ConfigError):
    """NaN or Inf where a quantization range is being estimated."""


class Observer:
    """Running range estimate of a tensor, per tensor or per channel along ``axis``."""

    def __init__(self, spec: GridSpec, axis: int | None, name: str) -> None:
        self.spec = spec
        self.axis = axis
        self.requested_axis = axis  # may count from the end (-1): resolved against each batch
        self.name = name
        self.low: Tensor | None = None
        self.high: Tensor | None = None
        self.count = 0
        self.values = 0  # values seen per row (channel, or the whole tensor)

    def observe(self, x: Tensor) -> None:
        """Update the range with ``x``; NaN or Inf raises :class:`NonFiniteError`."""
        x = x.detach().float()
        if not torch.isfinite(x).all():
            raise NonFiniteError(
                "quantize.calibration", self.name, "NaN or Inf reached this layer; clean the calibration data"
            )
        flat = x.reshape(1, -1) if self.axis is None else x.movedim(self.axis, 0).reshape(x.shape[self.axis], -1)
        previous = None if self.low is None else ObservedRange(self.low, self.high, self.count)
        self.low, self.high = self._checked(self.spec.observe(flat, previous), flat.shape[0])
        self.count += 1
        self.values += flat.shape[1]

    def check_varied(self, what: str) -> None:
        """A range over many values that never varied (all zeros, or a bias alone) gets its scale
        from that one value (or from eps) and clips whatever the layer sees later: refused where
        a varied range is certain (:data:`VARIED_RANGES_REQUIRED`, the key/value cache), else
        warned (a layer may be constant by construction, e.g. after a zero-initialised norm)."""
        if self.low is None or self.values <= 1 or not torch.equal(self.low, self.high):
            return
        value = float(self.low.flatten()[0]) if self.low.numel() == 1 or self.low.eq(self.low[0]).all() else None
        seen = f"the value {value:g}" if value is not None else "one value per channel"
        problem = f"its {what} held {seen} in every calibration batch and position, so no range to quantize it by"
        if VARIED_RANGES_REQUIRED.get():
            raise ConfigError(
                "quantize.calibration",
                self.name,
                f"{problem} can be learned; give batches of real data, or exclude the layer",
            )
        log.warning(
            "quantize.calibration=%r: %s was learned; it will clip other values at run time", self.name, problem
        )

    def _checked(self, result: Any, rows: int) -> tuple[Tensor, Tensor]:
        """An observer's ``(low, high)``: tensors of one value per row, finite, low <= high."""
        field, name = "quantize.observer", self.spec.observer_name
        if not (isinstance(result, tuple) and len(result) == 2 and all(isinstance(r, Tensor) for r in result)):
            raise ConfigError(
                field,
                name,
                f"returned {type(result).__name__} for {self.name}; an observer returns (low, high) tensors",
            )
        low, high = (r.float().reshape(-1) for r in result)
        if low.numel() != rows or high.numel() != rows:
            raise ConfigError(
                field,
                name,
                f"returned {low.numel()} and {high.numel()} values for {self.name}; it needs one per row of x ({rows})",
            )
        if not (torch.isfinite(low).all() and torch.isfinite(high).all()) or (low > high).any():
            raise ConfigError(field, name, f"returned a range for {self.name} that is not finite with low <= high")
        return low, high

    def update(self, x: Tensor) -> None:
        """:meth:`observe` as a capture reducer (the channel axis counted from the end is
        resolved against ``x``)."""
        if self.requested_axis is not None:
            self.axis = self.requested_axis % x.dim()
        self.observe(x)

    def result(self) -> tuple[Tensor, Tensor] | None:
        return None if self.low is None else (self.low, self.high)

    def qparams(self) -> tuple[Tensor, Tensor]:
        """(scale float32, zero_point int32), shaped () per tensor or (C,) per channel."""
        if self.low is None:
            raise ConfigError(
                "quantize.calibration",
                self.name,
                "this layer saw no data during calibration",
                "give batches that run through it, or exclude it",
            )
        scale, zero_point = compute_qparams(self.low, self.high, self.spec)
        if not torch.isfinite(scale).all():
            raise NonFiniteError(
                "quantize.calibration",
                self.name,
                f"its range [{float(self.low.min()):g}, {float(self.high.max()):g}] overflows float32 in the "
                "quantization scale; clean or rescale the calibration data",
            )
        return (scale.reshape(()), zero_point.reshape(())) if self.axis is None else (scale, zero_point)


def compute_qparams(
    low: Tensor, high: Tensor, spec: GridSpec, tensor_amax: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Scale and zero point for the range [low, high], with torch.ao's formulas; on a
    floating-point grid, the format's scale of ``max(|low|, |high|)`` and a zero point of 0
    (``tensor_amax``: the whole tensor's, for formats with a per-tensor scale above the blocks');
    with ``float_offset``, the float offset ``-low`` in the zero point's place."""
    if spec.is_float:
        amax = torch.maximum(-low.float(), high.float()).clamp(min=0)
        scale = spec.number_format.scale_of(amax, tensor_amax)
        return scale, torch.zeros_like(scale, dtype=torch.int32)
    quant_min, quant_max = spec.quant_range
    low = torch.minimum(low.float(), torch.zeros_like(low, dtype=torch.float32))
    high = torch.maximum(high.float(), torch.zeros_like(high, dtype=torch.float32))
    eps = torch.tensor(torch.finfo(torch.float32).eps)
    if spec.float_offset:  # the group's minimum, as a float: value = scale x q - offset
        scale = stored_scale(torch.maximum((high - low) / float(quant_max - quant_min), eps), spec)
        return scale, stored_offset(-low, spec)
    if spec.symmetric:
        scale = stored_scale(torch.maximum(torch.maximum(-low, high) / (float(quant_max - quant_min) / 2), eps), spec)
        zero_point = torch.zeros_like(scale, dtype=torch.int32)
    else:
        scale = stored_scale(torch.maximum((high - low) / float(quant_max - quant_min), eps), spec)
        zero_point = torch.clamp(quant_min - torch.round(low / scale).to(torch.int32), quant_min, quant_max)
        if spec.observer == "full_range":  # its zero point by the larger side, an all-zero range's too
            half = (quant_max + 1) // 2
            zero_point = torch.where(-low > high, half, half - 1).to(torch.int32)
    return scale, zero_point.to(torch.int32)


def fake_quantize_groups(
    x: Tensor, scale: Tensor, zero_point: Tensor, axis: int, spec: GridSpec, g_idx: Tensor | None = None
) -> Tensor:
    """Group-wise fake quantization of a weight: ``scale`` and ``zero_point`` are (outputs,
    groups) for groups of ``spec.group_size`` consecutive entries of ``x.movedim(axis, 0)``'s
    rows (the last group may be shorter); with ``g_idx`` (``actorder="group"``), column ``j``
    is in group ``g_idx[j]`` instead (each group ``group_size`` columns, as :func:`check_g_idx` says)."""
    moved = x.movedim(axis, 0)
    rows = moved.reshape(moved.shape[0], -1)
    if g_idx is not None:  # the columns sorted by group (stably) are contiguous groups
        order = torch.argsort(g_idx.to(rows.device), stable=True)
        grouped = fake_quantize_groups(rows[:, order], scale, zero_point, 0, spec)
        return torch.empty_like(grouped).index_copy_(1, order, grouped).reshape(moved.shape).movedim(0, axis)
    size = spec.group_size
    columns = rows.shape[1]
    padded = torch.nn.functional.pad(rows, (0, (-columns) % size)).reshape(-1, size)
    if spec.is_float:
        rounded = spec.number_format.fake_quantize(padded, scale.reshape(-1, 1).to(padded.device))
    elif spec.float_offset:
        scale, offset = scale.reshape(-1, 1).to(padded.device), zero_point.reshape(-1, 1).to(padded.device)
        rounded = fake_quantize_offset(padded, scale, offset, spec)
    else:
        quant_min, quant_max = spec.quant_range
        rounded = torch.fake_quantize_per_channel_affine(
            padded, scale.reshape(-1), zero_point.reshape(-1), 0, quant_min, quant_max
        )
    return rounded.reshape(rows.shape[0], -1)[:, :columns].reshape(moved.shape).movedim(0, axis)


def g_idx_problem(g_idx: Tensor, columns: int, group_size: int) -> str | None:
    """Why ``g_idx`` is not a group index of ``columns`` inputs in groups of ``group_size`` (an
    integer tensor, one entry per column, every group ``group_size`` columns as contiguous
    groups would have them, the last one possibly fewer), or None when it is."""
    if g_idx.is_floating_point() or g_idx.is_complex() or g_idx.dtype == torch.bool:
        return f"has dtype {g_idx.dtype}; it must be an integer tensor"
    if tuple(g_idx.shape) != (columns,):
        return f"has shape {tuple(g_idx.shape)}; it must be ({columns},), one group per input column"
    if not torch.equal(torch.sort(g_idx.cpu().long()).values, torch.arange(columns) // group_size):
        return f"does not put exactly {group_size} columns in each group (groups 0 to {(columns - 1) // group_size})"
    return None


class Grid:
    """A weight's quantization grid seen as an (outputs, columns) matrix, for solvers that
    round it a slice at a time (GPTQ): scales per row (per channel or per group) or one."""

    def __init__(self, spec: GridSpec, per_row: bool, tensor_amax: Tensor | None = None) -> None:
        self.spec, self.per_row, self.tensor_amax = spec, per_row, tensor_amax

    def qparams_of(self, columns: Tensor, importance: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Scale and zero point of an (outputs, k) slice: one per row, or one for all
        (``importance``: one weight per column, or shaped as ``columns``, for a weighted observer)."""
        flat = columns.float() if self.per_row else columns.float().reshape(1, -1)
        weighted = importance is not None and self.spec.weighted
        weights = importance.float().to(flat.device).expand(columns.shape) if weighted else None
        low, high = self.spec.observe(flat, None, None if weights is None else weights.reshape(flat.shape))
        scale, zero_point = compute_qparams(low, high, self.spec, self.tensor_amax)
        return (scale, zero_point) if self.per_row else (scale.reshape(()), zero_point.reshape(()))

    def group_qparams(self, rows: Tensor, importance: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """(outputs, groups) scales and zero points for round-to-nearest by groups (a last,
        shorter group is observed on its own entries only); ``importance``: one weight per
        column, for a weighted observer."""
        size = self.spec.group_size
        whole = rows.shape[1] // size * size
        parts = []
        if self.spec.is_float and self.tensor_amax is None:  # a per-tensor scale over the blocks' (nvfp4)
            return Grid(self.spec, self.per_row, rows.detach().abs().amax().float()).group_qparams(rows, importance)
        weighted = importance is not None and self.spec.weighted
        weights = importance.float().to(rows.device).expand(rows.shape) if weighted else None
        if whole:
            scale, zero_point = self.qparams_of(
                rows[:, :whole].float().reshape(-1, size),
                None if weights is None else weights[:, :whole].reshape(-1, size),
            )
            parts.append((scale.view(rows.shape[0], -1), zero_point.view(rows.shape[0], -1)))
        if whole < rows.shape[1]:
            scale, zero_point = self.qparams_of(
                rows[:, whole:].float(), None if weights is None else weights[:, whole:]
            )
            parts.append((scale.view(-1, 1), zero_point.view(-1, 1)))
        zero_point = torch.cat([p[1] for p in parts], dim=1)
        if self.spec.float_offset:
            zero_point = super_grouped_offsets(zero_point, self.spec)
        return super_grouped(torch.cat([p[0] for p in parts], dim=1), self.spec), zero_point

    def round(self, column: Tensor, scale: Tensor, zero_point: Tensor) -> Tensor:
        """One column rounded onto the grid (``scale``: one per row, or one)."""
        if self.spec.is_float:
            return self.spec.number_format.fake_quantize(column, scale)
        if self.spec.float_offset:
            return fake_quantize_offset(column, scale, zero_point, self.spec)
        quant_min, quant_max = self.spec.quant_range
        rows = column.shape[0]
        return torch.fake_quantize_per_channel_affine(
            column.unsqueeze(1),
            scale.expand(rows).contiguous(),
            zero_point.expand(rows).contiguous(),
            0,
            quant_min,
            quant_max,
        ).squeeze(1)


def fake_quantize(x: Tensor, scale: Tensor, zero_point: Tensor, axis: int | None, spec: GridSpec) -> Tensor:
    """PyTorch's fused fake-quantization op for the given parameters (on a floating-point grid,
    the format's rounding of ``x / scale``)."""
    if spec.is_float:
        shape = [1] * x.dim()
        if axis is not None:
            shape[axis] = -1
        return spec.number_format.fake_quantize(x, scale.reshape(shape) if axis is not None else scale)
    if spec.float_offset:
        shape = [1] * x.dim()
        if axis is not None:
            shape[axis] = -1
        return fake_quantize_offset(x, scale.reshape(shape), zero_point.reshape(shape), spec)
    quant_min, quant_max = spec.quant_range
    if axis is None:
        return torch.fake_quantize_per_tensor_affine(x, scale, zero_point, quant_min, quant_max)
    return torch.fake_quantize_per_channel_affine(x, scale, zero_point, axis, quant_min, quant_max)


def fake_quantize_dynamic(x: Tensor, spec: GridSpec) -> tuple[Tensor, Tensor]:
    """``x`` fake-quantized with scales taken from itself (``spec.dynamic``: one per token, each
    row of the last dimension, or one for the whole tensor), rounded as ``spec.rounding`` says
    (``round(x / scale)``: bit-equal to what llm-compressor and vLLM compute; ``round(x * (1 /
    scale))``: torchao's); gradients pass
    straight through. Returns it and the scales (non-finite where ``x`` is)."""
    if x.numel() == 0:
        return x, torch.ones(0)
    rows = x.reshape(-1, x.shape[-1]) if spec.dynamic == "token" and x.dim() else x.reshape(1, -1)
    values = rows.detach().float()
    scale, zero_point = compute_qparams(values.amin(1), values.amax(1), spec)
    scale, zero_point = scale.to(x.device).reshape(-1, 1), zero_point.to(x.device).reshape(-1, 1)
    if spec.is_float:
        rounded = spec.number_format.fake_quantize(rows, scale)
    else:
        quant_min, quant_max = spec.quant_range
        scaled = rows * (1.0 / scale.to(rows.dtype)) if spec.rounding == "reciprocal" else rows / scale.to(rows.dtype)
        integers = torch.clamp(torch.round(scaled + zero_point), quant_min, quant_max)
        rounded = ((integers - zero_point) * scale.to(rows.dtype)).to(rows.dtype)
    if rows.requires_grad:
        rounded = rows + (rounded - rows).detach()
    return rounded.reshape(x.shape), scale.reshape(-1)


def __getattr__(name: str) -> Any:
    """``QuantSpec``: the name :class:`GridSpec` had before 0.3 (warns)."""
    if name == "QuantSpec":
        warnings.warn(DEPRECATED_QUANTSPEC, DeprecationWarning, stacklevel=2)
        return GridSpec
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
