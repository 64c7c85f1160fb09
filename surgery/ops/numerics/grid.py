"""The grid one tensor is fake-quantized onto (:class:`GridSpec`), validated when built, and the
tables of names its fields take: observers and weight methods."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, NamedTuple

import torch
from torch import Tensor

from surgery.core.errors import ConfigError, ConfigTypeError
from surgery.core.registry import Registry
from surgery.core.settings import whole_count
from surgery.ops.numerics.number_formats import FORMATS, NumberFormat

DEPRECATED_QUANTSPEC = "QuantSpec is now GridSpec (the grid of one tensor; QuantizeSpec is the verb's settings); the old name goes away in 0.4"
METHOD_FIELDS = ("method", "actorder", "iterations")  # a weight method's, on the grid before 0.3 (warn until 0.4)
DEPRECATED_METHOD_FIELDS = (
    "GridSpec({fields}=) is deprecated: the grid describes the grid only; name the weight method and its "
    "settings in quantize(method=...) (GptqSettings(actorder=), AutoRoundSettings(iterations=); in a recipe "
    "quantize.method: {{name: gptq, actorder: weight}}). The grid's fields go away in 0.4"
)


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
    its own scale (in the order of ``weight.reshape(out, -1)``; finer than ``per_channel``).
    How the weights are rounded onto the grid is the weight method's, named apart from the grid
    (``quantize(method=GptqSettings(actorder="weight"))``); ``method``, ``actorder`` and
    ``iterations`` here are the pre-0.3 spellings of it, accepted with a ``DeprecationWarning``
    until 0.4 (``quantize`` moves them to its ``method``).
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
    method: str | None = field(default=None, compare=False, repr=False)  # deprecated: quantize(method=)
    group_size: int | None = None
    format: str = (
        "int"  # or a floating-point grid: fp8_e4m3, fp8_e5m2, mxfp4, nvfp4 (surgery.ops.numerics.number_formats)
    )
    dynamic: str | None = None  # activations: "token" or "tensor" scales computed as each tensor runs
    rounding: str = "divide"  # dynamic activations: round x / scale ("divide") or x * (1 / scale) ("reciprocal")
    actorder: str | None = field(default=None, compare=False, repr=False)  # deprecated: GptqSettings(actorder=)
    iterations: int | None = field(default=None, compare=False, repr=False)  # deprecated: AutoRoundSettings
    scale_dtype: str | None = None  # integer grids: "float16"/"bfloat16" rounds each scale as it is computed
    super_group: int | None = None  # inputs sharing one scale_dtype scale over the groups' integer scales
    scale_bits: int | None = None  # with super_group: each group's scale an integer in [1, 2^scale_bits - 1] x it
    float_offset: bool = False  # affine groups: value = scale x q - offset, the offset a float (GGUF's minimums)

    def __post_init__(self) -> None:
        _check(self, "GridSpec")
        given = [name for name in METHOD_FIELDS if getattr(self, name) is not None]
        if given:
            warnings.warn(DEPRECATED_METHOD_FIELDS.format(fields="=, ".join(given)), DeprecationWarning, stacklevel=3)
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
        """The grid's fields, the observer by name (JSON-serialisable)."""
        fields = (name for name in self.__dataclass_fields__ if name not in METHOD_FIELDS)
        return {**{name: getattr(self, name) for name in fields}, "observer": self.observer_name}

    @property
    def method_given(self) -> dict[str, Any] | None:
        """The weight method a pre-0.3 grid named (``GridSpec(method=, actorder=, iterations=)``),
        as ``quantize(method=)`` takes it; None when it names none."""
        given = {name: getattr(self, name) for name in METHOD_FIELDS if getattr(self, name) is not None}
        if given.get("iterations") == 200 and given.get("method") != "autoround":
            del given["iterations"]  # the old default, which every pre-0.3 grid wrote out (as_dict): no setting
        return {"name": given.pop("method", "rtn"), **given} if given else None

    def without_method(self) -> GridSpec:
        """The grid alone (the pre-0.3 method fields cleared)."""
        return dataclasses.replace(self, **dict.fromkeys(METHOD_FIELDS)) if self.method_given else self

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
    if spec.method is not None and not isinstance(spec.method, str):
        raise ConfigTypeError(
            f"{field}.method", spec.method, "must be a weight method's name (deprecated: quantize(method=))"
        )
    size = spec.group_size
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= 1 << 20):
        raise ConfigError(
            f"{field}.group_size", size, "must be null or a whole number of inputs in [1, 1048576] (e.g. 32, 64, 128)"
        )
    _check_format(spec, field)
    _check_full_range(spec, field)
    _check_dynamic(spec, field)
    _check_actorder(spec, field)
    if spec.iterations is not None:
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
            f"{field}.actorder",
            spec.actorder,
            f"orders GPTQ's walk over the columns; method is {spec.method or 'rtn'!r}",
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


def __getattr__(name: str) -> Any:
    """``QuantSpec``: the name :class:`GridSpec` had before 0.3 (warns)."""
    if name == "QuantSpec":
        warnings.warn(DEPRECATED_QUANTSPEC, DeprecationWarning, stacklevel=2)
        return GridSpec
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
