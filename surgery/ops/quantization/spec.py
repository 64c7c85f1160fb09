"""``QuantizeSpec``: how to quantize, validated when built, and the keywords that build it."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from surgery.core.errors import ConfigError, ConfigTypeError
from surgery.core.inputs import present_device
from surgery.core.originals import check_place
from surgery.core.settings import settings_from
from surgery.ops.numerics import searched_ranges  # noqa: F401 - the mse observer registers itself
from surgery.ops.numerics.grid import GridSpec
from surgery.ops.numerics.number_formats import FORMATS
from surgery.ops.numerics.weight_methods import WEIGHT_METHODS, method_of_settings, weight_method
from surgery.ops.quantization import methods  # noqa: F401 - the built-in weight methods register themselves
from surgery.ops.quantization.targets import deploy_target

log = logging.getLogger("surgery")


WHERE = ("output", "input", "both", "tensors")  # both: each layer's input and output; tensors: see placement


DEFAULT_WEIGHTS = GridSpec(bits=8, symmetric=True, per_channel=True)


@dataclass(frozen=True)
class QuantizeSpec:
    """How to quantize, validated when built: ``QuantizeSpec(where="middle")`` raises at once.

    The fields are the keyword arguments of :func:`quantize` (see there); ``weights`` and
    ``activations`` are :class:`GridSpec` (or dicts of its fields), ``None`` turns that part off.
    """

    weights: GridSpec | None = DEFAULT_WEIGHTS
    activations: GridSpec | None = None
    select: Any = None
    exclude: Any = None
    where: str = "output"
    train: bool = False
    freeze_observers_after: int | None = None  # with train: optimizer steps before activation ranges freeze
    blocks: Any = None  # sequential methods (gptq): blocks calibrated in turn; False: layer by layer
    target: str | None = None  # a deployment format whose runtime the simulation then equals
    onload: str | None = None  # sequential methods: the device each block is calibrated on (cuda), moved back after
    originals: str = "memory"  # where the weights' original values wait for restore(): memory or disk
    method: Any = None  # the weight method with its own settings (GptqSettings(damping=...)), or its name

    def __post_init__(self) -> None:
        weights = _as_spec(self.weights, "quantize.weights")
        if self.method is not None:
            weights, settings = _with_method(weights, self.method)
            object.__setattr__(self, "method", settings)
        activations = _as_spec(self.activations, "quantize.activations")
        if self.target is not None:
            weights, activations = _for_target(self, weights, activations)
        object.__setattr__(self, "weights", weights)
        object.__setattr__(self, "activations", activations)
        object.__setattr__(self, "exclude", self.exclude or None)
        if weights is None and activations is None:
            raise ConfigError("quantize", None, "set weights, activations or both")
        if self.where not in WHERE:
            raise ConfigError("quantize.where", self.where, f"must be one of {', '.join(WHERE)}")
        _validate_training(self.train, self.freeze_observers_after, activations)
        if self.where == "tensors" and (self.train or (activations is not None and activations.per_channel)):
            raise ConfigError(
                "quantize.where",
                "tensors",
                "quantizes each tensor once, with one scale, after training: "
                "set train=false and per-tensor activations",
            )
        _validate_method(weights, activations, self.train, self.blocks)
        _validate_weighted(weights, activations, self.train)
        _validate_dynamic(weights, activations, self.where, self.freeze_observers_after)
        _validate_offsets(weights, activations, self.train)
        _validate_onload(self.onload, weights)
        check_place(self.originals, "quantize.originals")
        if self.originals == "disk" and self.train:
            raise ConfigError(
                "quantize.originals",
                "disk",
                "spills the originals of weights rounded once; quantization-aware training "
                "keeps its float weights in memory to train them (set originals=memory)",
            )

    @property
    def calibrated(self) -> bool:
        """Whether quantizing needs calibration batches (activations, or a calibrated weight method)."""
        folds = self.target is not None and deploy_target(self.target).fold_batchnorm
        return (
            folds
            or (self.activations is not None and self.activations.dynamic is None)
            or (self.weights is not None and weight_method(self.weights.method).needs_calibration)
            or (self.weights is not None and self.weights.weighted)  # imatrix_mse: its inputs' energy
        )


def _with_method(weights: GridSpec | None, method: Any) -> tuple[GridSpec, Any]:
    """``weights`` on ``method`` (a registered name, its settings, or a mapping ``{name: ..., <setting>:
    ...}``) and the method's settings (None for a method without any): the grid names the
    method, and the settings it shares with the grid (``actorder``, ``iterations``) agree."""
    if weights is None:
        raise ConfigError("quantize.method", _name_of(method), "picks the weights' method; set weights too")
    if isinstance(method, str):
        chosen = weight_method(method)
        settings = None if chosen.settings is None else chosen.settings()
    elif isinstance(method, Mapping):
        given = dict(method)
        chosen = weight_method(given.pop("name", None))
        if chosen.settings is None and given:
            raise ConfigError("quantize.method", chosen.name, f"has no settings of its own; got {sorted(given)}")
        settings = None if chosen.settings is None else settings_from(chosen.settings, given, "quantize.method")
    else:
        chosen, settings = method_of_settings(method), method
    if weights.method not in ("rtn", chosen.name):
        raise ConfigError(
            "quantize.method", chosen.name, f"is given beside weights.method={weights.method!r}: name the method once"
        )
    shared = {}
    for name in ("actorder", "iterations"):
        if settings is None or not hasattr(settings, name):
            continue
        grid_value, own = getattr(weights, name), getattr(settings, name)
        default = GridSpec.__dataclass_fields__[name].default
        if grid_value != default and own != grid_value and own != type(settings).__dataclass_fields__[name].default:
            raise ConfigError(
                f"quantize.method.{name}", own, f"is given beside weights.{name}={grid_value!r}: set it once"
            )
        shared[name] = own if own != type(settings).__dataclass_fields__[name].default else grid_value
    if settings is not None and shared:
        settings = dataclasses.replace(settings, **shared)
    return dataclasses.replace(weights, method=chosen.name, **shared), settings


def _name_of(method: Any) -> str:
    return method if isinstance(method, str) else type(method).__name__


def method_settings(spec: QuantizeSpec) -> Any:
    """The weight method's settings a quantization runs with: the spec's, or the method's
    defaults (with the grid's ``actorder`` and ``iterations``); None for a method without any."""
    if spec.method is not None or spec.weights is None:
        return spec.method
    return _with_method(spec.weights, spec.weights.method)[1]


def _validate_onload(onload: object, weights: GridSpec | None) -> None:
    """``onload`` moves the blocks of a sequential weight method (gptq, autoround) to a device."""
    if onload is None:
        return
    present_device(onload, "quantize.onload")
    if weights is None or not weight_method(weights.method).sequential:
        method = None if weights is None else weights.method
        raise ConfigError(
            "quantize.onload",
            onload,
            f"moves each block to a device while a sequential weight method (gptq, autoround) calibrates it; "
            f"weights.method={method!r} calibrates no blocks (quantize the model where it is)",
        )


def _for_target(spec: QuantizeSpec, weights: GridSpec | None, activations: GridSpec | None) -> tuple:
    """The settings the target's kernels fix, put over the given ones (each change logged)."""
    target = deploy_target(spec.target)
    if spec.train:
        raise ConfigError("quantize.target", spec.target, "applies to post-training quantization; train=false")
    if spec.where != target.where and activations is not None:
        places = "inputs and outputs" if target.where == "both" else f"{target.where}s"
        log.info("quantize.target=%s: activations quantized at layer %s", spec.target, places)
    object.__setattr__(spec, "where", target.where)
    found = []
    for part, fixed, name in ((weights, target.weights, "weights"), (activations, target.activations, "activations")):
        if part is not None:
            changed = {k: v for k, v in fixed.items() if getattr(part, k) != v}
            if changed:
                log.info("quantize.target=%s sets %s %s", spec.target, name, changed)
            part = dataclasses.replace(part, **changed)
        found.append(part)
    return found[0], found[1]


def _validate_inputs(spec: QuantizeSpec, calibration: Any, qparams: Any) -> None:
    """What the settings need from the call: calibration batches, or saved parameters."""
    static = spec.activations is not None and spec.activations.dynamic is None
    if static and calibration is None and qparams is None:
        raise ConfigError(
            "quantize.calibration", None, "activation quantization needs calibration batches (or saved qparams)"
        )
    if spec.weights is not None and spec.weights.weighted and calibration is None:
        raise ConfigError(
            "quantize.calibration",
            None,
            f"weights.observer={spec.weights.observer!r} weighs each input column by its energy in calibration; "
            "pass calibration batches",
        )
    method = weight_method(spec.weights.method) if spec.weights is not None else None
    if method is not None and method.needs_calibration and calibration is None:
        raise ConfigError(
            "quantize.calibration",
            None,
            f"weights.method={method.name!r} is calibrated (gptq solves each layer with its input Hessian); "
            "pass calibration batches",
        )


WEIGHTED_METHODS = ("rtn", "gptq", "gptaq")  # the methods that give a weighted observer its inputs' energy


def _validate_weighted(weights: GridSpec | None, activations: GridSpec | None, train: bool) -> None:
    """A weighted observer (``imatrix_mse``) picks weights' per-channel or per-group ranges once,
    from calibration, in a method that gives it each input's energy."""
    if activations is not None and activations.weighted:
        raise ConfigError(
            "quantize.activations.observer", activations.observer, "weighs weight columns by their inputs; weights only"
        )
    if weights is None or not weights.weighted:
        return
    if weights.method not in WEIGHTED_METHODS:
        raise ConfigError(
            "quantize.weights.observer",
            weights.observer,
            f"weighs the clipping search of methods that pick scales ({', '.join(WEIGHTED_METHODS)}); "
            f"method {weights.method!r} picks its own: use observer=minmax",
        )
    if train or not (weights.per_channel or weights.group_size):
        raise ConfigError(
            "quantize.weights.observer",
            weights.observer,
            "weighs each row's inputs once, after calibration: set per_channel=true or a group_size, and train=false",
        )


def _validate_training(train: object, freeze_after: object, activations: GridSpec | None) -> None:
    if not isinstance(train, bool):
        raise ConfigTypeError("quantize.train", train, "must be true or false")
    if freeze_after is None:
        return
    if isinstance(freeze_after, bool) or not isinstance(freeze_after, int) or not 0 <= freeze_after < 2**63:
        raise ConfigError(
            "quantize.freeze_observers_after", freeze_after, "must be null or an integer >= 0 (optimizer steps)"
        )
    if not train or activations is None:
        raise ConfigError(
            "quantize.freeze_observers_after",
            freeze_after,
            "applies to quantization-aware training of activations: set train=true and activations",
        )


def _validate_offsets(weights: GridSpec | None, activations: GridSpec | None, train: bool) -> None:
    """Float offsets are a weight grid's, rounded once after the method (no gradient passes them)."""
    if activations is not None and activations.float_offset:
        raise ConfigError("quantize.activations.float_offset", True, "applies to weights; leave it false")
    if weights is not None and weights.float_offset and train:
        raise ConfigError(
            "quantize.weights.float_offset",
            True,
            "rounds post-training (no straight-through gradient for training); set train=false",
        )


def _validate_dynamic(weights: GridSpec | None, activations: GridSpec | None, where: str, freeze: Any) -> None:
    """Dynamic scales: activations only, on layer inputs or outputs, with no range to freeze."""
    if weights is not None and weights.dynamic is not None:
        raise ConfigError(
            "quantize.weights.dynamic",
            weights.dynamic,
            "applies to activations; weights are rounded once: leave it null",
        )
    if activations is None or activations.dynamic is None:
        return
    if where == "tensors":
        raise ConfigError(
            "quantize.where",
            "tensors",
            "places static scales as graph runtimes do; dynamic activations go on layer inputs or outputs",
        )
    if freeze is not None:
        raise ConfigError(
            "quantize.freeze_observers_after", freeze, "dynamic activations have no learned range to freeze"
        )


def _validate_method(weights: GridSpec | None, activations: GridSpec | None, train: bool, blocks: Any) -> None:
    for field, spec in (("quantize.weights", weights), ("quantize.activations", activations)):
        if spec is not None and spec.is_float and train:
            raise ConfigError(f"{field}.format", spec.format, "quantization-aware training takes the integer format")
    if activations is not None and not activations.number_format.activations:
        usable = ", ".join(n for n in FORMATS.names() if FORMATS.get(n).activations)
        raise ConfigError(
            "quantize.activations.format",
            activations.format,
            f"scales per block of each tensor as it runs; activations take one static scale here: use {usable}",
        )
    if activations is not None and activations.method != "rtn":
        raise ConfigError(
            "quantize.activations.method",
            activations.method,
            "applies to weights; activations are rounded to nearest ('rtn')",
        )
    if activations is not None and activations.group_size is not None:
        raise ConfigError(
            "quantize.activations.group_size",
            activations.group_size,
            "applies to weights; activations take per_channel or one scale",
        )
    if weights is None:
        if blocks is not None:
            raise ConfigError("quantize.blocks", blocks, "applies to weight methods calibrated in sequence (gptq)")
        return
    method = weight_method(weights.method)
    if train and (not method.trainable or weights.group_size is not None):
        trainable = ", ".join(repr(n) for n in WEIGHT_METHODS.names() if weight_method(n).trainable)
        raise ConfigError(
            "quantize.train",
            True,
            "quantization-aware training rounds weights to nearest with "
            f"per-channel or per-tensor scales; set weights.method to one of {trainable} and group_size=null",
        )
    if blocks is not None and not method.sequential:
        raise ConfigError("quantize.blocks", blocks, "applies to weight methods calibrated in sequence (gptq)")


def _as_spec(spec: Any, field: str) -> GridSpec | None:
    if spec is None or isinstance(spec, GridSpec):
        return spec
    if isinstance(spec, dict):
        return GridSpec.build(spec, field)
    raise ConfigError(field, spec, "must be a GridSpec, a dict of its fields, or None")
