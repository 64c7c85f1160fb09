"""The fake-quantize transforms ``quantize`` attaches: a weight's, an activation hook, a per-call hook,
and the schedule that freezes learned ranges in quantization-aware training."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from surgery.core import compiled
from surgery.core._compat import forward_hook_functions
from surgery.core.errors import ConfigError
from surgery.core.targets import is_hf_conv1d
from surgery.core.transforms import Saved, SavedTensor
from surgery.ops.numerics.fake_quant import fake_quantize, fake_quantize_dynamic, fake_quantize_groups
from surgery.ops.numerics.grid import GridSpec
from surgery.ops.numerics.observers import NonFiniteError, Observer
from surgery.ops.quantization.placement import site_key


def activation_sides(where: str) -> tuple[str, ...]:
    """The hook sides ``where`` quantizes: ``("input",)``, ``("output",)`` or both."""
    return ("input", "output") if where in ("both", "tensors") else (where,)


def activation_key(layer: str, side: str, where: str, call: int = 0) -> str:
    """The key of a layer's quantizer in :attr:`QuantizeHandle.activations` and in saved qparams:
    the layer's name, ``"<layer>@output"`` for outputs when both sides are quantized, ``"#k"``
    after it for the k-th call of a module quantized per call."""
    return site_key(layer, side, call) if where in ("both", "tensors") else layer


class WeightQuantizer:
    """The fake-quantization transform of one weight, with frozen scale and zero point."""

    kind = "quantize"

    def __init__(
        self,
        spec: GridSpec,
        scale: Tensor,
        zero_point: Tensor,
        axis: int | None,
        update: Tensor | None = None,
        saved: Saved | None = None,
        g_idx: Tensor | None = None,
    ) -> None:
        self.spec, self.axis = spec, axis
        self.scale, self.zero_point = scale, zero_point  # held compactly (see below), read as given
        self.g_idx = g_idx  # the group of each input column (actorder="group"); None: contiguous groups
        self.pending = update  # a method's new weights, written once when attached
        self.rewrites = update is not None
        self.saved = saved  # the original values, kept before the method wrote into the weight

    @property
    def scale(self) -> Tensor:
        """The grid's scales, float32 (held in half precision where that holds them exactly)."""
        return self._scale.float() if self._scale.dtype != torch.float32 else self._scale

    @scale.setter
    def scale(self, value: Tensor) -> None:
        self._scale = _compact(value, (torch.bfloat16, torch.float16))

    @property
    def zero_point(self) -> Tensor:
        """The grid's zero points, int32 (held in one byte each where that holds them exactly)."""
        return self._zero_point.int() if self._zero_point.dtype in (torch.uint8, torch.int8) else self._zero_point

    @zero_point.setter
    def zero_point(self, value: Tensor) -> None:
        compact = _compact(value, (torch.uint8, torch.int8)) if value.dtype == torch.int32 else value
        if compact is not value and bool((compact == compact.reshape(-1)[0]).all()):  # one value (symmetric)
            compact = compact.reshape(-1)[:1].clone().reshape(()).expand(value.shape)  # held once
        self._zero_point = compact

    def save(self, param: Tensor) -> Saved:
        """The undo record: the originals kept when the method wrote its values, else a copy."""
        return self.saved if self.saved is not None else SavedTensor(param)

    def apply(self, param: Tensor) -> None:
        """Replace ``param`` in place by its fake-quantized values (idempotent); first, once,
        by the solver's weights when there are any."""
        with torch.no_grad():
            if self.pending is not None:
                param.copy_(self.pending.to(param.device, param.dtype))
                self.pending = None
            scale, zero_point = self.scale.to(param.device), self.zero_point.to(param.device)
            if self.spec.group_size:
                g_idx = None if self.g_idx is None else self.g_idx.to(param.device)
                param.copy_(fake_quantize_groups(param, scale, zero_point, self.axis, self.spec, g_idx))
            else:
                param.copy_(fake_quantize(param, scale, zero_point, self.axis, self.spec))


def _compact(value: Tensor, dtypes: tuple[torch.dtype, ...]) -> Tensor:
    """``value`` in the first of ``dtypes`` that holds every entry exactly, else as it is: a
    grid's per-group scale and zero point, kept beside the weights while a handle is attached,
    would otherwise be 8 bytes a group (6 % of a float32 weight at groups of 32, 12 % of a bf16 one)."""
    if value.dtype not in (torch.float32, torch.int32) or value.numel() < 2:
        return value
    for dtype in dtypes:
        info = torch.finfo(dtype) if dtype.is_floating_point else torch.iinfo(dtype)
        if value.numel() and not info.min <= value.min().item() <= value.max().item() <= info.max:
            continue
        narrow = value.to(dtype)
        if torch.equal(narrow.to(value.dtype), value):
            return narrow
    return value


@compiled.eager_at_top_level
class ActivationQuantizer:
    """Forward hook (outputs) or forward-pre hook (first input) that observes, then fake-quantizes."""

    def __init__(
        self,
        spec: GridSpec,
        axis: int | None,
        name: str,
        where: str,
        learning: bool = False,
        call: int = 0,
        follows: str | None = None,
    ) -> None:
        self.spec, self.axis, self.name, self.where = spec, axis, name, where
        self.call = call  # which run of the module in a forward (a PerCallQuantizer's k-th quantizer)
        self.follows = follows  # the key of the quantizer whose grid this one takes after calibration
        self.per_call = 0  # quantized per call: the module's runs per forward (observed by its PerCallQuantizer)
        self.observer: Observer | None = None if spec.dynamic else Observer(spec, axis, name)
        self.scale: Tensor | None = None
        self.zero_point: Tensor | None = None
        self.inference: tuple[float, float, float, float] | None = None
        self.learning = learning  # quantization-aware training: training-mode forwards keep observing
        self.tracker: Observer | None = None

    def freeze(self, scale: Tensor | None = None, zero_point: Tensor | None = None) -> None:
        """Stop calibrating; use the observed range, or the given scale and zero point. While
        ``learning``, training-mode forwards go on refining the range from there."""
        if scale is None:
            self.observer.check_varied(self.where)
            scale, zero_point = self.observer.qparams()
        if self.learning:
            self.tracker = self.observer or Observer(self.spec, self.axis, self.name)
            if self.tracker.low is None:  # from saved qparams: start the range where they put it
                low, high = _range_of(scale, zero_point, self.spec)
                self.tracker.low, self.tracker.high, self.tracker.count = low, high, 1
        self._use(scale, zero_point)
        self.observer = None

    def stop_learning(self) -> None:
        """Freeze the range where training has brought it."""
        self.learning, self.tracker = False, None

    def range_state(self) -> tuple:
        """What training changes (the range, its running estimate, whether it still learns)."""
        tracker = self.tracker
        running = None if tracker is None else (tracker.low, tracker.high, tracker.count, tracker.axis)
        return self.scale, self.zero_point, self.learning, tracker, running

    def load_range(self, state: tuple) -> None:
        """Put back a :meth:`range_state`."""
        scale, zero_point, self.learning, self.tracker, running = state
        if self.tracker is not None:
            self.tracker.low, self.tracker.high, self.tracker.count, self.tracker.axis = running
        if scale is not None:
            self._use(scale, zero_point)

    def _use(self, scale: Tensor, zero_point: Tensor) -> None:
        self.scale, self.zero_point = scale, zero_point
        if self.axis is None and not self.spec.is_float:
            scale32 = scale.detach().float().reshape(())
            inverse = float(torch.ones((), dtype=torch.float32) / scale32)  # as the fused kernel: 1.0f / scale
            quant_min, quant_max = self.spec.quant_range
            offset = int(zero_point)
            self.inference = (inverse, float(quant_min - offset), float(quant_max - offset), float(scale32))

    def _fast_path(self, x: Tensor) -> Tensor | None:
        """The fused op's arithmetic without its gradient mask (3.8 ns/element on CPU): only for
        float32 per-tensor quantization where no gradient is needed. Values equal the fused op's
        (a result of zero may carry the sign of its input)."""
        if self.inference is None or x.dtype != torch.float32 or (x.requires_grad and torch.is_grad_enabled()):
            return None
        inverse, low, high, scale = self.inference
        return torch.mul(x, inverse).round_().clamp_(low, high).mul_(scale)

    def _quantize(self, x: Any, training: bool = False, features_last: bool = False) -> Any:
        if not isinstance(x, Tensor) or not x.is_floating_point():
            raise ConfigError(
                "quantize.select",
                self.name,
                f"its {self.where} is {type(x).__name__}"
                f"{'' if not isinstance(x, Tensor) else f' of dtype {x.dtype}'}; only floating "
                "tensors can be quantized",
            )
        if self.spec.dynamic:
            return self._dynamic(x, features_last)
        axis = None if self.axis is None else self.axis % x.dim()
        if self.observer is not None:  # calibrating: the capture feeds the observer, values pass unchanged
            return None
        if self.tracker is not None and training:  # quantization-aware training: the range keeps learning
            if self.tracker.requested_axis is not None:
                self.tracker.axis = self.tracker.requested_axis % x.dim()
            if not torch.isfinite(x.detach()).all():
                raise NonFiniteError(
                    "quantize.train",
                    self.name,
                    "NaN or Inf reached this layer in training, where its range is learned; lower the learning rate",
                )
            self.tracker.observe(x)
            self._use(*self.tracker.qparams())
        fast = self._fast_path(x)
        if fast is not None:
            return fast
        return fake_quantize(x, self.scale.to(x.device), self.zero_point.to(x.device), axis, self.spec)

    def _dynamic(self, x: Tensor, features_last: bool = False) -> Tensor:
        """``x`` rounded with scales of its own; a Linear's tokens are all but its last axis, at
        any rank, where an image's (batch, channels, height, width) has no token rows."""
        if self.spec.dynamic == "token" and x.dim() >= 4 and not features_last:
            raise ConfigError(
                "quantize.activations.dynamic",
                "token",
                f"{self.name}'s {self.where} is {tuple(x.shape)}: rows of its last axis are not tokens "
                "(an image's columns); use dynamic='tensor' or select the Linear layers",
            )
        quantized, scale = fake_quantize_dynamic(x, self.spec)
        if not torch.isfinite(scale).all():
            raise NonFiniteError(
                "quantize.activations.dynamic", self.name, "NaN or Inf reached this layer, whose scale it sets"
            )
        return quantized

    def __call__(self, module: nn.Module, args: tuple, output: Any = None) -> Any:
        features_last = isinstance(module, nn.Linear) or is_hf_conv1d(module)
        if self.where == "output":
            return self._quantize(output, module.training, features_last)
        if not args:
            raise ConfigError("quantize.where", "input", f"{self.name} was called without positional inputs")
        quantized = self._quantize(args[0], module.training, features_last)
        return None if quantized is None else (quantized, *args[1:])


class PerCallQuantizer:
    """Forward hook of a module quantized per call (a ReLU, shared in a block): of the ``count``
    runs a forward makes, run k uses ``quantizers[k]`` (none: left as it is), which observes
    itself while calibrating. :meth:`start` and :meth:`end` (hooks of the root model, the end
    one run on errors too) bound each forward; a run outside one cannot say which call it is and
    is refused. An in-place ReLU is quantized in place, for callers that drop its return value."""

    def __init__(self, quantizers: dict[int, ActivationQuantizer], count: int) -> None:
        self.quantizers, self.count = quantizers, count
        self.runs = 0
        self.in_forward = False
        for quantizer in quantizers.values():
            quantizer.per_call = count

    def start(self, *_: Any) -> None:
        self.runs, self.in_forward = 0, True

    def end(self, *_: Any) -> None:
        self.in_forward = False

    def __call__(self, module: nn.Module, args: tuple, output: Any) -> Any:
        name = next(iter(self.quantizers.values())).name
        if not self.in_forward:
            raise ConfigError(
                "quantize.where",
                "tensors",
                f"{name} ran outside a forward of the whole model; its quantizers are per call of that forward",
            )
        if self.runs >= self.count:
            raise ConfigError(
                "quantize.where",
                "tensors",
                f"{name} ran {self.runs + 1} times in one forward where calibration saw {self.count}; "
                "quantize again with batches that take this path",
            )
        quantizer = self.quantizers.get(self.runs)
        self.runs += 1
        if quantizer is None:
            return None
        if quantizer.observer is not None:
            if isinstance(output, Tensor) and output.is_floating_point():
                quantizer.observer.update(output)
            return None
        quantized = quantizer._quantize(output, module.training)
        if getattr(module, "inplace", False) and not torch.is_grad_enabled():
            return output.copy_(quantized)  # callers of an in-place ReLU may read its input instead
        return quantized


def _range_of(scale: Tensor, zero_point: Tensor, spec: GridSpec) -> tuple[Tensor, Tensor]:
    """The float range a scale and zero point cover (the inverse of ``compute_qparams``)."""
    quant_min, quant_max = spec.quant_range
    scale, offset = scale.float().reshape(-1), zero_point.float().reshape(-1)
    return (quant_min - offset) * scale, (quant_max - offset) * scale


def learned_ranges(model: nn.Module) -> list[tuple[ActivationQuantizer, tuple]]:
    """The activation quantizers on ``model`` whose ranges training moves, with their state now."""
    found = {
        id(h): h
        for m in model.modules()
        for h in forward_hook_functions(m)
        if isinstance(h, ActivationQuantizer) and h.tracker is not None
    }
    return [(quantizer, quantizer.range_state()) for quantizer in found.values()]


class ObserverSchedule:
    """Global optimizer step post-hook of quantization-aware training: after ``steps`` optimizer
    steps over the model's parameters, the activation ranges stop learning."""

    def __init__(self, quantizers: list[ActivationQuantizer], params: list[nn.Parameter], steps: int) -> None:
        self.quantizers, self.params, self.left = quantizers, {id(p) for p in params}, steps
        if steps == 0:
            self.freeze()

    def freeze(self) -> None:
        for quantizer in self.quantizers:
            quantizer.stop_learning()

    def __call__(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        if self.left > 0 and any(id(p) in self.params for group in optimizer.param_groups for p in group["params"]):
            self.left -= 1
            if self.left == 0:
                self.freeze()
