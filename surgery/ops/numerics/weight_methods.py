"""Weight quantization methods: the registry ``quantize(method=...)`` names, and the problem a method solves.

A method turns the selected weights into scales, zero points and (optionally) new weight
values; :func:`surgery.quantize` attaches the result, restorably. RTN (:mod:`surgery.ops.quantization.methods.rtn`)
and GPTQ (:mod:`surgery.ops.quantization.methods.gptq`) register here the same way a user's method does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from torch import Tensor, nn

from surgery.core import guards
from surgery.core.errors import ConfigError, ConfigTypeError
from surgery.core.layer_kinds import channel_axis, weight_axis_of
from surgery.core.originals import Originals
from surgery.core.registry import Registry
from surgery.core.settings import settings_from
from surgery.core.targets import Target, Targets
from surgery.ops.numerics.grid import GridSpec

if TYPE_CHECKING:
    from surgery.core.sequential import SequentialReport


class QuantizedWeight(NamedTuple):
    """A method's answer for one weight: the grid (``scale``, ``zero_point``, one per output
    channel along ``axis`` or per group, or scalars with ``axis=None``), and ``value``, the new
    weights to round onto that grid (None: round the current weights to nearest). ``g_idx``
    (int32, one per input column of ``weight.reshape(outputs, -1)``): the group of each column
    when groups are not ``group_size`` consecutive columns (GPTQ's ``actorder="group"``);
    None: contiguous groups."""

    scale: Tensor
    zero_point: Tensor
    axis: int | None
    value: Tensor | None = None
    g_idx: Tensor | None = None


@dataclass
class WeightProblem:
    """What a weight method is given: the model, the selected weights (``targets.matched``, by
    qualified parameter name) and the spec; calibration batches for calibrated methods.

    A method that writes its new values into the weights itself (GPTQ, in sequence) keeps each
    weight's original in ``originals`` first and answers ``value=None``: the values are then
    held once, in the model."""

    model: nn.Module
    targets: Targets
    spec: GridSpec
    calibration: Any = None
    blocks: Any = None  # the repeated blocks a sequential method calibrates one after another
    progress: bool = True
    sequential: SequentialReport | None = None  # set by a method that runs a sequential pass
    originals: Originals = field(default_factory=Originals)  # weights' values before the method wrote them
    settings: Any = None  # the method's own settings (GptqSettings...; see register_weight_method), or None
    method: str = "rtn"  # the method's registered name
    unrouted: str = "refuse"  # a layer no calibration input reached (an unrouted expert): refuse, or "rtn"

    def value(self, key: str) -> Tensor:
        """The weight's current value (with earlier steps applied, e.g. pruned entries zero)."""
        return guards.current_value(self.targets.matched[key].param)

    def axis(self, key: str) -> int:
        """The weight's output-channel axis: 0, except transposed layouts (ConvTranspose, Conv1D)."""
        return weight_axis(self.targets.matched[key], key)


Solve = Callable[[WeightProblem], dict[str, QuantizedWeight]]
WEIGHT_METHODS: Registry[WeightMethod] = Registry("quantize.method")  # rtn, gptq... register themselves


@dataclass(frozen=True)
class WeightMethod:
    """A registered weight quantization method.

    ``needs_calibration`` makes :func:`surgery.quantize` require calibration batches;
    ``trainable`` says quantization-aware training (``train=True``) may use it.
    """

    name: str
    solve: Solve
    needs_calibration: bool = False
    trainable: bool = False
    sequential: bool = False  # calibrates block after block (takes ``blocks=``)
    float_stream: bool = False  # also needs each layer's inputs in the model before compression (GPTAQ)
    settings: type | None = None  # a frozen dataclass of the method's own settings (damping, steps...), or None

    def __call__(self, problem: WeightProblem) -> dict[str, QuantizedWeight]:
        return self.solve(problem)


def register_weight_method(
    name: str,
    solve: Solve,
    *,
    needs_calibration: bool = False,
    trainable: bool = False,
    sequential: bool = False,
    float_stream: bool = False,
    settings: type | None = None,
    replace: bool = False,
) -> WeightMethod:
    """Make ``solve(problem) -> {key: QuantizedWeight}`` available as ``quantize(method=name)``
    and ``quantize.method=name`` in recipes. ``settings``: a frozen dataclass of the
    method's own settings, apart from the grid (GPTQ's damping and block size, AutoRound's steps
    and batch): ``quantize(method=TheSettings(...))`` picks the method with them, and the solver
    finds them as ``problem.settings`` (their defaults when the caller gave none).

    Example:
        >>> def halves(problem):
        ...     return {key: QuantizedWeight(problem.value(key).abs().amax() / 127, torch.tensor(0), None)
        ...             for key in problem.targets.matched}
        >>> register_weight_method("halves", halves)
    """
    if settings is not None and not (dataclasses.is_dataclass(settings) and settings.__dataclass_params__.frozen):
        raise ConfigTypeError("register_weight_method.settings", settings, "must be a frozen dataclass (or None)")
    taken = next(
        (
            m.name
            for m in map(WEIGHT_METHODS.get, WEIGHT_METHODS.names())
            if settings and m.settings is settings and m.name != name
        ),
        None,
    )
    if taken is not None:
        raise ConfigError("register_weight_method.settings", settings.__name__, f"already names method {taken!r}")
    method = WeightMethod(name, solve, needs_calibration, trainable, sequential, float_stream, settings)
    return WEIGHT_METHODS.register(name, method, replace=replace)


def method_of_settings(settings: object) -> WeightMethod:
    """The registered method whose settings class ``settings`` is an instance of (exactly)."""
    for name in WEIGHT_METHODS.names():
        method = WEIGHT_METHODS.get(name)
        if method.settings is not None and type(settings) is method.settings:
            return method
    kinds = ", ".join(m.settings.__name__ for m in map(WEIGHT_METHODS.get, WEIGHT_METHODS.names()) if m.settings)
    raise ConfigTypeError("quantize.method", settings, f"must be a method's name or its settings ({kinds})")


def method_of(method: object) -> WeightMethod:
    """The registered method ``method`` names: its name, or an instance of its settings class."""
    return weight_method(method) if isinstance(method, str) else method_of_settings(method)


def settings_of(method: object) -> Any:
    """A method's settings object, None for a name (a method without settings of its own)."""
    return None if isinstance(method, str) else method


def resolve_method(method: object, field: str = "quantize.method") -> Any:
    """``method`` as a spec holds it: the settings object of a method that has settings (its
    defaults for a bare name; a mapping ``{name: ..., <setting>: ...}`` builds them), else the
    method's name. Errors name ``field``."""
    if method is None:
        return "rtn"
    if isinstance(method, Mapping):
        given = dict(method)
        chosen = weight_method(given.pop("name", "rtn"))
        if chosen.settings is None:
            if given:
                raise ConfigError(field, chosen.name, f"has no settings of its own; got {sorted(given)}")
            return chosen.name
        return settings_from(chosen.settings, given, field)
    if isinstance(method, str):
        chosen = weight_method(method)
        return chosen.name if chosen.settings is None else chosen.settings()
    method_of_settings(method)
    return method


def weight_method(name: object) -> WeightMethod:
    """The method registered as ``name`` (a one-line error listing the registered ones otherwise)."""
    return WEIGHT_METHODS.get(name)


def weight_axis(target: Target, name: str) -> int:
    """The output-channel axis of a weight, as its layer kind gives it (:mod:`surgery.core.layer_kinds`):
    0, except transposed layouts (ConvTranspose, Conv1D); a one-line error for a kind without one."""
    if target.attribute != "weight":
        return 0  # e.g. an LSTM's weight_ih_l0 or attention's in_proj_weight: rows are outputs
    return channel_axis(target.module, "output_axis", target.module_name, "quantize.weights")


def output_axis(module: nn.Module, attribute: str) -> int:
    """The output axis of ``module``'s ``attribute`` as :func:`weight_axis` gives it, 0 for
    kinds without a channel axis: how a per-tensor grid lays the weight out in rows."""
    return weight_axis_of(module, attribute)
