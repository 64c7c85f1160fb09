"""``QuantizeSpec``: how to quantize, validated when built, and the keywords that build it."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

from surgery.core.errors import ConfigError, ConfigTypeError
from surgery.core.inputs import present_device
from surgery.core.originals import check_place
from surgery.core.sequential import UNROUTED_POLICIES
from surgery.ops.numerics import searched_ranges  # noqa: F401 - the mse observer registers itself
from surgery.ops.numerics.grid import GridSpec
from surgery.ops.numerics.number_formats import FORMATS
from surgery.ops.numerics.weight_methods import (
    WEIGHT_METHODS,
    WeightMethod,
    method_of,
    resolve_method,
    settings_of,
    weight_method,
)
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
    ``method`` is held as the method's settings object (``GptqSettings()`` for ``"gptq"``), or
    its name when it has no settings (``"rtn"``); :attr:`weight_method` is the registered method.
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
    method: Any = None  # the weight method with its own settings (GptqSettings(damping=...)), or its name; None: rtn
    unrouted: str = "refuse"  # calibrated methods: a layer no calibration token reached (an expert): refuse, or "rtn"

    def __post_init__(self) -> None:
        weights = _as_spec(self.weights, "quantize.weights")
        method, weights = _method_and_grid(self.method, weights)
        object.__setattr__(self, "method", method)
        activations = _as_spec(self.activations, "quantize.activations")
        if activations is not None and activations.method_given is not None:
            raise ConfigError(
                "quantize.activations.method",
                activations.method_given["name"],
                "applies to weights (quantize.method); activations are rounded to nearest",
            )
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
        _validate_method(weights, activations, self.train, self.blocks, self.weight_method)
        _validate_actorder(weights, self.method)
        _validate_weighted(weights, activations, self.train, self.weight_method)
        _validate_dynamic(weights, activations, self.where, self.freeze_observers_after)
        _validate_offsets(weights, activations, self.train)
        _validate_onload(self.onload, weights, self.weight_method)
        check_place(self.originals, "quantize.originals")
        if self.unrouted not in UNROUTED_POLICIES:
            raise ConfigError(
                "quantize.unrouted",
                self.unrouted,
                f"must be one of {', '.join(UNROUTED_POLICIES)} (what a layer no calibration token reached gets)",
            )
        if self.originals == "disk" and self.train:
            raise ConfigError(
                "quantize.originals",
                "disk",
                "spills the originals of weights rounded once; quantization-aware training "
                "keeps its float weights in memory to train them (set originals=memory)",
            )

    @property
    def weight_method(self) -> WeightMethod:
        """The registered weight method ``method`` names."""
        return method_of(self.method)

    @property
    def method_settings(self) -> Any:
        """The weight method's own settings (GptqSettings...), None for a method without any."""
        return settings_of(self.method)

    @property
    def calibrated(self) -> bool:
        """Whether quantizing needs calibration batches (activations, or a calibrated weight method)."""
        folds = self.target is not None and deploy_target(self.target).fold_batchnorm
        return (
            folds
            or (self.activations is not None and self.activations.dynamic is None)
            or (self.weights is not None and self.weight_method.needs_calibration)
            or (self.weights is not None and self.weights.weighted)  # imatrix_mse: its inputs' energy
        )


def _method_and_grid(method: Any, weights: GridSpec | None) -> tuple[Any, GridSpec | None]:
    """``method`` as the spec holds it (:func:`resolve_method`) and the grid alone. A pre-0.3 grid's
    method fields (``GridSpec(method=, actorder=, iterations=)``, deprecated) become ``method``'s,
    or must agree with it."""
    if weights is None:
        if method not in (None, "rtn"):
            raise ConfigError("quantize.method", _name_of(method), "picks the weights' method; set weights too")
        return "rtn", None
    legacy = weights.method_given
    if legacy is None:
        return resolve_method(method), weights
    if legacy["name"] not in WEIGHT_METHODS:
        raise ConfigError(
            "quantize.weights.method", legacy["name"], f"must be one of {', '.join(WEIGHT_METHODS.names())}"
        )
    if method in (None, "rtn"):  # rtn: the default (a config echoes it back)
        return resolve_method(legacy, "quantize.weights"), weights.without_method()
    chosen = resolve_method(method)
    name = method_of(chosen).name
    if legacy["name"] not in ("rtn", name):
        raise ConfigError(
            "quantize.method", name, f"is given beside weights.method={legacy['name']!r}: name the method once"
        )
    shared = {}
    for key, grid_value in legacy.items():
        if key == "name":
            continue
        if not hasattr(chosen, key):
            raise ConfigError(f"quantize.weights.{key}", grid_value, f"is not a setting of method {name!r}")
        own, default = getattr(chosen, key), type(chosen).__dataclass_fields__[key].default
        if own not in (default, grid_value):
            raise ConfigError(
                f"quantize.method.{key}", own, f"is given beside weights.{key}={grid_value!r}: set it once"
            )
        shared[key] = grid_value
    return (dataclasses.replace(chosen, **shared) if shared else chosen), weights.without_method()


def _name_of(method: Any) -> str:
    return method if isinstance(method, str) else type(method).__name__


def _validate_onload(onload: object, weights: GridSpec | None, method: WeightMethod) -> None:
    """``onload`` moves the blocks of a sequential weight method (gptq, autoround) to a device."""
    if onload is None:
        return
    present_device(onload, "quantize.onload")
    if weights is None or not method.sequential:
        name = None if weights is None else method.name
        raise ConfigError(
            "quantize.onload",
            onload,
            f"moves each block to a device while a sequential weight method (gptq, autoround) calibrates it; "
            f"method={name!r} calibrates no blocks (quantize the model where it is)",
        )


def _validate_actorder(weights: GridSpec | None, method: Any) -> None:
    """GPTQ's ``actorder="group"`` scatters the groups over the inputs; two-level scales need consecutive ones."""
    if weights is not None and weights.super_group and getattr(method, "actorder", None) == "group":
        raise ConfigError(
            "quantize.method.actorder",
            "group",
            "scatters the groups over the inputs; super groups need consecutive ones",
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
    method = spec.weight_method if spec.weights is not None else None
    if method is not None and method.needs_calibration and calibration is None:
        raise ConfigError(
            "quantize.calibration",
            None,
            f"method={method.name!r} is calibrated (gptq solves each layer with its input Hessian); "
            "pass calibration batches",
        )


WEIGHTED_METHODS = ("rtn", "gptq", "gptaq")  # the methods that give a weighted observer its inputs' energy


def _validate_weighted(
    weights: GridSpec | None, activations: GridSpec | None, train: bool, method: WeightMethod
) -> None:
    """A weighted observer (``imatrix_mse``) picks weights' per-channel or per-group ranges once,
    from calibration, in a method that gives it each input's energy."""
    if activations is not None and activations.weighted:
        raise ConfigError(
            "quantize.activations.observer", activations.observer, "weighs weight columns by their inputs; weights only"
        )
    if weights is None or not weights.weighted:
        return
    if method.name not in WEIGHTED_METHODS:
        raise ConfigError(
            "quantize.weights.observer",
            weights.observer,
            f"weighs the clipping search of methods that pick scales ({', '.join(WEIGHTED_METHODS)}); "
            f"method {method.name!r} picks its own: use observer=minmax",
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


def _validate_method(
    weights: GridSpec | None, activations: GridSpec | None, train: bool, blocks: Any, method: WeightMethod
) -> None:
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
    if train and (not method.trainable or weights.group_size is not None):
        trainable = ", ".join(repr(n) for n in WEIGHT_METHODS.names() if weight_method(n).trainable)
        raise ConfigError(
            "quantize.train",
            True,
            "quantization-aware training rounds weights to nearest with "
            f"per-channel or per-tensor scales; set method to one of {trainable} and group_size=null",
        )
    if blocks is not None and not method.sequential:
        raise ConfigError("quantize.blocks", blocks, "applies to weight methods calibrated in sequence (gptq)")


def _as_spec(spec: Any, field: str) -> GridSpec | None:
    if spec is None or isinstance(spec, GridSpec):
        return spec
    if isinstance(spec, dict):
        return GridSpec.build(spec, field)
    raise ConfigError(field, spec, "must be a GridSpec, a dict of its fields, or None")
