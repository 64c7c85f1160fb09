"""``surgery.quantize``: fake quantization of weights (in place, guarded) and activations (hooks)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import Tensor, nn

from surgery.core import compiled, guards
from surgery.core._compat import BATCH_NORMS, CONVOLUTIONS, forward_hook_functions
from surgery.core.capture import Capture
from surgery.core.checkpoints import save_tensors
from surgery.core.errors import (
    AlreadyModifiedError,
    CheckpointError,
    ConfigError,
    ConfigTypeError,
    OutputExistsError,
)
from surgery.core.handles import Handle
from surgery.core.inputs import batches, run_batches
from surgery.core.originals import Originals, check_place
from surgery.core.selection import Selection, describe, select
from surgery.core.sequential import SequentialReport, find_blocks, resolve_blocks
from surgery.core.settings import spec_or_keywords
from surgery.core.targets import Targets, default_layer, is_hf_conv1d, select_parameters
from surgery.core.transforms import Saved, SavedTensor, attach_all, own_step_hook
from surgery.ops.equivalence.folding import fold_batchnorms
from surgery.ops.numerics.deployment import ActivationGrid, WeightGrid
from surgery.ops.numerics.number_formats import FORMATS
from surgery.ops.numerics.observers import (
    GridSpec,
    NonFiniteError,
    Observer,
    fake_quantize,
    fake_quantize_dynamic,
    fake_quantize_groups,
)
from surgery.ops.numerics.weight_methods import (
    WEIGHT_METHODS,
    QuantizedWeight,
    WeightProblem,
    layer_axis,
    output_axis,
    weight_axis,
    weight_method,
)
from surgery.ops.offload.offloaded_compression import OffloadedCompression, OffloadedVerb, compress_offloaded
from surgery.ops.offload.offloading import Offloaded
from surgery.ops.quantization import methods  # noqa: F401 - the built-in weight methods register themselves
from surgery.ops.quantization.placement import ACTIVATIONS, Site, saved_sites, site_key, tensor_sites
from surgery.ops.quantization.qat import ShadowWeight, attach_shadows
from surgery.ops.quantization.targets import DeployTarget, deploy_target

log = logging.getLogger("surgery")
ACTIVATION_AXIS = (
    (nn.Conv1d, 1),
    (nn.Conv2d, 1),
    (nn.Conv3d, 1),
    (nn.ConvTranspose1d, 1),
    (nn.ConvTranspose2d, 1),
    (nn.ConvTranspose3d, 1),
    (nn.Linear, -1),
)
WHERE = ("output", "input", "both", "tensors")  # both: each layer's input and output; tensors: see placement


def activation_sides(where: str) -> tuple[str, ...]:
    """The hook sides ``where`` quantizes: ``("input",)``, ``("output",)`` or both."""
    return ("input", "output") if where in ("both", "tensors") else (where,)


def activation_key(layer: str, side: str, where: str, call: int = 0) -> str:
    """The key of a layer's quantizer in :attr:`QuantizeHandle.activations` and in saved qparams:
    the layer's name, ``"<layer>@output"`` for outputs when both sides are quantized, ``"#k"``
    after it for the k-th call of a module quantized per call."""
    return site_key(layer, side, call) if where in ("both", "tensors") else layer


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
    originals: str = "memory"  # where the weights' original values wait for restore(): memory or disk

    def __post_init__(self) -> None:
        weights = _as_spec(self.weights, "quantize.weights")
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
        _validate_dynamic(weights, activations, self.where, self.freeze_observers_after)
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
    method = weight_method(spec.weights.method) if spec.weights is not None else None
    if method is not None and method.needs_calibration and calibration is None:
        raise ConfigError(
            "quantize.calibration",
            None,
            f"weights.method={method.name!r} is calibrated (gptq solves each layer with its input Hessian); "
            "pass calibration batches",
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


@contextlib.contextmanager
def _target_selection(model: nn.Module, spec: QuantizeSpec, rules: DeployTarget | None) -> Iterator[None]:
    """An empty selection that the ``target`` chose (the user selected nothing) is said as the
    target's: the layer types its runtime quantizes, which the model lacks."""
    try:
        yield
    except ConfigError as err:  # a SelectionError, or no weight among the layers selected
        if rules is None or spec.select is not None or err.field != "quantize.select":
            raise
        kinds = describe(rules.layers)
        kinds = ", ".join(kinds) if isinstance(kinds, tuple) else kinds
        outside = " outside quantize.exclude" if spec.exclude else ""
        raise ConfigError(
            "quantize.target",
            spec.target,
            f"quantizes {kinds} layers and {type(model).__name__} has none{outside}; "
            "choose another target (compressed-tensors takes transformers' Conv1D)",
        ) from None


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
    ) -> None:
        self.spec, self.scale, self.zero_point, self.axis = spec, scale, zero_point, axis
        self.pending = update  # a method's new weights, written once when attached
        self.rewrites = update is not None
        self.saved = saved  # the original values, kept before the method wrote into the weight

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
                param.copy_(fake_quantize_groups(param, scale, zero_point, self.axis, self.spec))
            else:
                param.copy_(fake_quantize(param, scale, zero_point, self.axis, self.spec))


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


class QuantizeHandle(Handle):
    """Handle returned by :func:`quantize`; also saves and reports quantization parameters."""

    def __init__(self, model: nn.Module, selection: Targets | None = None) -> None:
        super().__init__("quantize", model)
        self.selection = selection or Targets({}, [])  # the weights matched and skipped
        self.weights: dict[str, WeightQuantizer | ShadowWeight] = {}
        self.activations: dict[str, ActivationQuantizer] = {}
        self.sequential: SequentialReport | None = None  # GPTQ's calibration pass
        self.folded: list[tuple[str, str]] = []  # (convolution, BatchNorm) pairs folded for a target

    @property
    def skipped(self) -> list:
        """Weights selected (or, by default, not selected) but left unquantized, with why."""
        return list(self.selection.skipped)

    def outside_weights(self) -> list[str]:
        if self.state != "attached" or not self.activations:
            return []
        return [f"activation quantization of {len(self.activations)} layer(s) (save_qparams keeps its parameters)"]

    def weight_qparams(self) -> dict[str, Tensor]:
        """Weight scales and zero points by ``"<parameter>.scale"`` / ``"<parameter>.zero_point"``
        (``"fc.weight.scale"``): scalars, one per output channel, or (outputs, groups) with
        ``group_size``; quantization-aware training gives those of the weights as they are now."""
        out: dict[str, Tensor] = {}
        for key, grid in self._weight_grids().items():
            out[f"{key}.scale"] = grid.scale.detach().cpu().contiguous()
            out[f"{key}.zero_point"] = grid.zero_point.detach().cpu().contiguous()
        return out

    def _weight_grids(self) -> dict[str, WeightGrid]:
        grids, model = {}, self.model
        for key, quantizer in self.weights.items():
            scale, zero_point = quantizer.scale, quantizer.zero_point  # a shadow observes its current values
            layer, _, attribute = key.rpartition(".")
            outputs = output_axis(model.get_submodule(layer), attribute) if model is not None else 0
            grids[key] = WeightGrid(key, quantizer.spec, scale.detach(), zero_point.detach(), quantizer.axis, outputs)
        return grids

    def export_parts(self) -> list:
        if self.state != "attached":
            return []
        step = self.kind  # "quantize", or "kv_cache" for the cache's scales
        activations = [
            ActivationGrid(
                q.name, q.where, q.spec, q.scale.detach(), q.zero_point.detach(), q.axis, q.call, q.follows, step
            )
            if not q.spec.dynamic
            else ActivationGrid(q.name, q.where, q.spec, None, None, None, q.call, step=step)
            for q in self.activations.values()
            if q.scale is not None or q.spec.dynamic
        ]
        return [*self._weight_grids().values(), *activations]

    def qparams(self) -> dict[str, Tensor]:
        """Activation scales and zero points by ``"<layer>.scale"`` / ``"<layer>.zero_point"``."""
        out: dict[str, Tensor] = {}
        for name, quantizer in self.activations.items():
            if quantizer.scale is not None:
                out[f"{name}.scale"] = quantizer.scale.detach().cpu().contiguous()
                out[f"{name}.zero_point"] = quantizer.zero_point.detach().cpu().contiguous()
            if quantizer.per_call:  # where="tensors": the module's runs per forward, to reattach without one
                out[f"{name}.runs"] = torch.tensor(quantizer.per_call)
        return out

    def save_qparams(self, path: str | Path, *, overwrite: bool = False) -> Path:
        """Write the activation (:meth:`qparams`) and weight (:meth:`weight_qparams`) quantization
        parameters to one safetensors file, settings as metadata, atomically; an existing file
        raises :class:`~surgery.core.errors.OutputExistsError` unless ``overwrite``.
        ``quantize(..., qparams=path)`` reads the activation parameters back."""
        if Path(path).exists() and not overwrite:
            raise OutputExistsError(str(path))
        first = next(iter(self.activations.values()), None)
        weight_spec = next(iter(self.weights.values())).spec if self.weights else None
        meta = {
            "where": first.where if first else "output",
            "spec": json.dumps(first.spec.as_dict() if first else {}),
            "layers": json.dumps(list(self.activations)),
            "weights": json.dumps(list(self.weights)),
            "weight_spec": json.dumps(weight_spec.as_dict() if weight_spec else {}),
            "weight_axes": json.dumps({key: q.axis for key, q in self.weights.items()}),
        }
        return save_tensors(self.qparams() | self.weight_qparams(), path, metadata=meta)


def load_qparams(path: str | Path) -> dict[str, Tensor]:
    """Read a file written by :meth:`QuantizeHandle.save_qparams`."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"quantize.qparams={str(path)!r}: no such file")
    try:
        return load_file(str(path))
    except Exception as err:
        raise CheckpointError(f"quantize.qparams={str(path)!r}: unreadable ({type(err).__name__})") from None


def quantize(
    model: nn.Module,
    spec: QuantizeSpec | None = None,
    *,
    weights: GridSpec | None = DEFAULT_WEIGHTS,
    activations: GridSpec | None = None,
    select: Selection = None,
    exclude: Selection = None,
    calibration: Iterable | None = None,
    where: str = "output",
    qparams: dict[str, Tensor] | str | Path | None = None,
    progress: bool = True,
    train: bool = False,
    freeze_observers_after: int | None = None,
    blocks: Selection | bool | None = None,
    target: str | None = None,
    originals: str = "memory",
    work: str | Path | None = None,
) -> QuantizeHandle | OffloadedCompression:
    """Fake-quantize the weights and/or activations of the selected layers.

    Args:
        model: the model to modify in place; or an offloaded model's handle
            (:func:`surgery.offloaded`), quantized block by block without loading it whole:
            weights only, the result an :class:`OffloadedCompression` that ``surgery.export``
            streams and whose ``restore()`` reads the untouched source files again.
        spec: a :class:`QuantizeSpec` holding every setting below but ``calibration``,
            ``qparams`` and ``progress`` (the keyword arguments are a shorthand for it).
        weights: settings for weights (default int8, symmetric, per output channel), or None.
            Weights are replaced in place by their fake-quantized values with PyTorch's fused
            ops and kept so by forward-pre hooks; the originals are saved for ``restore()``.
        activations: settings for activations, or None. Forward hooks fake-quantize each
            selected layer's output (``where="input"``: forward-pre hooks, its first input;
            ``where="both"``: both, the output's parameters saved as ``"<layer>@output"``;
            ``where="tensors"``: each tensor once, as graph runtimes quantize: a layer's output,
            or the ReLU after it, per call (``"<relu>@output#1"``: its second call), and a
            layer's input only where no quantizer wrote it; found in one forward of the first
            calibration batch).
        select, exclude: layers (see :func:`surgery.select`), or weights by qualified parameter
            name (``"**.weight_ih_l0"``); default every Conv*d, Linear and Hugging Face Conv1D
            (weight axis 1). Weights matched and skipped are in ``handle.selection``.
        calibration: batches (tensors, tuples of inputs or dicts of keyword inputs) run
            through the model, with a progress bar, to estimate activation ranges (required
            for activations unless ``qparams``, a dict or a file from
            :meth:`QuantizeHandle.save_qparams`, is given) and, for ``weights.method="gptq"``,
            each layer's input Hessian, layer after layer on the already quantized model.
        train: quantization-aware training. Weights keep their float values (the shadow an
            optimizer updates) and each forward sees them fake-quantized, with gradients passed
            straight through; ``bake()`` folds them to the grid, ``restore()`` gives back the
            original floats. Activation ranges keep learning in training-mode forwards.
        freeze_observers_after: with ``train``, stop learning activation ranges after this
            many optimizer steps over the model's parameters (``None``: never).
        blocks: for GPTQ, the repeated blocks calibrated one after another (default: found
            automatically; a selection; ``False`` for layer-by-layer full forwards).
        target: an export format (``"onnx"``, ``"torchao"``, ``"compressed-tensors"``) whose
            runtime the simulation then equals: BatchNorm folded into convolutions (restorably,
            with the first calibration batch), only the layer types it quantizes selected by
            default, activations where it quantizes them, with its bit widths and signedness.
        originals: where the weights' original values wait for ``restore()``: ``"memory"``
            (one copy), or ``"disk"`` (a temporary file each, read back on restore, deleted
            with the handle): the model then needs about one copy of its weights in memory.
        work: for an offloaded model, the folder finished blocks are written to (kept; a run
            that died part-way, started again with the same settings and calibration, goes on
            after the last finished block); default a temporary folder.

    Example:
        >>> handle = surgery.quantize(model, activations=GridSpec(bits=8), calibration=batches)
        >>> handle.save_qparams("model.qparams.safetensors")
    """
    keywords = dict(weights=weights, activations=activations, select=select, exclude=exclude, where=where)
    keywords |= dict(train=train, freeze_observers_after=freeze_observers_after, blocks=blocks, target=target)
    spec = spec_or_keywords(QuantizeSpec, spec, keywords | {"originals": originals}, "quantize.spec")
    if isinstance(model, Offloaded):
        return _quantize_offloaded(model, spec, calibration, work, progress)
    model = compiled.in_memory("quantize", model, work)
    weights, activations, select, exclude, where = spec.weights, spec.activations, spec.select, spec.exclude, spec.where
    train, freeze_observers_after, blocks = spec.train, spec.freeze_observers_after, spec.blocks
    _validate_inputs(spec, calibration, qparams)
    if calibration is not None and iter(calibration) is calibration:  # one pass only: a probe takes the first
        calibration = list(calibration)
    if activations is None or activations.dynamic is not None:  # no static scales to read: none are saved
        qparams = None
    if isinstance(qparams, (str, Path)):  # read once, before anything changes
        qparams = load_qparams(qparams)
    rules = deploy_target(spec.target) if spec.target is not None else None
    select = rules.layers if rules is not None and select is None else select
    folding = rules is not None and rules.fold_batchnorm and any(isinstance(m, BATCH_NORMS) for m in model.modules())
    if folding and calibration is None:
        raise ConfigError("quantize.calibration", None, f"target={spec.target!r} folds BatchNorm; pass calibration")
    with _target_selection(model, spec, rules):
        weight_targets, layers = quantize_targets(model, select, exclude, weights, activations, where)
    guards.check_editable({name: t.param for name, t in weight_targets.matched.items()}, "quantize.select")
    handle = QuantizeHandle(model, weight_targets)
    with handle.applying():
        if folding:
            handle.folded = fold_batchnorms(handle, model, next(batches(calibration, "quantize.calibration")))
        if weights is not None and train:
            _attach_shadow_weights(handle, model, weight_targets, weights)
        elif weights is not None:
            _attach_weights(handle, model, weight_targets, weights, calibration, blocks, progress, spec.originals)
        if activations is not None and where == "tensors":
            _attach_sites(handle, model, _sites_of(model, layers, calibration, qparams), activations)
        elif activations is not None:
            _attach_activations(handle, layers, activations, where, learning=train)
        if activations is not None:
            _calibrate_or_load(handle, model, calibration, qparams, progress)
            if train and freeze_observers_after is not None:
                schedule = ObserverSchedule(
                    list(handle.activations.values()), list(model.parameters()), freeze_observers_after
                )
                own_step_hook(handle, model, schedule)
    return handle


def _quantize_offloaded(
    source: Offloaded, spec: Any, calibration: Any, work: Any, progress: bool
) -> OffloadedCompression:
    """Weights only, stage by stage (:mod:`surgery.ops.offload.offloaded_compression`)."""
    if not isinstance(spec, QuantizeSpec):
        raise ConfigTypeError("quantize.spec", spec, "must be a QuantizeSpec (or pass the settings as keywords)")
    rules = deploy_target(spec.target) if spec.target is not None else None
    model = source.model
    folding = rules is not None and rules.fold_batchnorm and any(isinstance(m, BATCH_NORMS) for m in model.modules())
    unsupported = [
        ("activations", spec.activations is not None),
        ("train", spec.train),
        ("target", folding),
        ("weights", spec.weights is None),
    ]
    refused = next((name for name, bad in unsupported if bad), None)
    if refused is not None:
        raise ConfigError(
            f"quantize.{refused}",
            getattr(spec, refused) if refused != "weights" else None,
            "an offloaded model is quantized weights only, block by block: set weights, and no "
            "activations, train or target that folds BatchNorm (or handle.materialise() it first)",
        )
    _validate_inputs(spec, calibration, None)
    method = weight_method(spec.weights.method)
    select = rules.layers if rules is not None and spec.select is None else spec.select  # the layers it quantizes
    with _target_selection(model, spec, rules):
        targets, _ = quantize_targets(model, select, spec.exclude, spec.weights, None, spec.where)
    keys: dict[str, list[str]] = {}
    for key, target in targets.matched.items():
        keys.setdefault(target.module_name, []).append(key)

    def run(skeleton: nn.Module, layers: list[str], block: str | None, calls: Any) -> QuantizeHandle:
        staged = dataclasses.replace(
            spec,
            select=[key for layer in layers for key in keys[layer]],
            exclude=None,
            blocks=([block] if block else False) if method.sequential else None,
            originals="memory",
            target=None,  # its selection made above; an offloaded model folds no BatchNorm
        )
        return quantize(skeleton, staged, calibration=calls, progress=False)

    def grids(handle: QuantizeHandle) -> dict[str, tuple[Tensor, Tensor, int | None]]:
        return {key: (q.scale, q.zero_point, q.axis) for key, q in handle.weights.items()}

    verb = OffloadedVerb("quantize", run, repr(spec), spec.weights, grids)
    blocks = resolve_blocks(model, spec.blocks, "quantize.blocks") if method.sequential else find_blocks(model)
    layers = {name: model.get_submodule(name) for name in keys}
    calibration = calibration if method.needs_calibration else None
    return compress_offloaded(source, verb, layers, calibration, blocks=blocks, work=work, progress=progress)


def _as_spec(spec: Any, field: str) -> GridSpec | None:
    if spec is None or isinstance(spec, GridSpec):
        return spec
    if isinstance(spec, dict):
        return GridSpec.build(spec, field)
    raise ConfigError(field, spec, "must be a GridSpec, a dict of its fields, or None")


def quantize_targets(
    model: nn.Module,
    include: Selection,
    exclude: Selection,
    weights: GridSpec | None,
    activations: GridSpec | None,
    where: str,
) -> tuple[Targets, dict[str, nn.Module]]:
    """(weights :func:`quantize` would quantize, with those skipped; layers whose activations it
    would quantize), checked as the verb checks them (also the dry run's)."""
    weight_targets = Targets({}, [])
    if weights is not None:
        weight_targets = select_parameters(
            model, include, exclude, verb="quantize", min_dim=1, required=activations is None
        )
        if weights.per_channel:
            for name, target in weight_targets.matched.items():
                weight_axis(target, name)
    layers: dict[str, nn.Module] = {}
    if activations is not None:
        layers = select(
            model,
            default_layer if include is None else include,
            exclude=exclude,
            field="quantize.select",
            exclude_field="quantize.exclude",
        )
    for name, module in layers.items():
        if activations.per_channel and not is_hf_conv1d(module):
            layer_axis(module, ACTIVATION_AXIS, name, "quantize.activations")
        sides = activation_sides(where)
        if any(isinstance(h, ActivationQuantizer) and h.where in sides for h in forward_hook_functions(module)):
            raise AlreadyModifiedError(
                f"quantize: {name} already has its {where} quantized; bake() or restore() that handle first"
            )
    return weight_targets, layers


def _attach_weights(
    handle: QuantizeHandle,
    model: nn.Module,
    targets: Targets,
    spec: GridSpec,
    calibration: Any = None,
    blocks: Any = None,
    progress: bool = True,
    originals: str = "memory",
) -> None:
    for key, target in targets.matched.items():
        if not torch.isfinite(guards.current_value(target.param)).all():
            raise NonFiniteError(
                "quantize.weights", key, "has NaN or Inf entries; only finite weights can be quantized"
            )
    store = Originals(originals)
    attached: set[str] = set()  # until attached, a weight the method wrote into is put back by the handle
    handle.add("put back weights a method wrote but never attached", lambda: store.put_back(skip=attached))
    problem = WeightProblem(model, targets, spec, calibration, blocks, progress, originals=store)
    _check_whole_blocks(problem, spec)
    solved = weight_method(spec.method)(problem)
    handle.sequential = problem.sequential
    quantizers = {}
    for key, target in targets.matched.items():
        found = _checked_answer(spec, key, solved)
        store.keep(key, target.param)  # unless the method kept it before writing
        saved = store.saved(key)
        scale = _scale_as_stored(found.scale, target.param.dtype, spec)
        quantizers[key] = (target.param, WeightQuantizer(spec, scale, found.zero_point, found.axis, found.value, saved))
    for key, (_param, quantizer) in quantizers.items():
        handle.weights[key] = quantizer
    attach_all(handle, model, quantizers, "weight quantization hook")
    attached.update(quantizers)


def _scale_as_stored(scale: Tensor, dtype: torch.dtype, spec: GridSpec) -> Tensor:
    """An integer grid's scale rounded to a half-precision weight's dtype, the dtype
    compressed-tensors stores ``weight_scale`` in: then ``(q - zero point) x scale`` is exact
    before its one rounding to that dtype, so the simulation and an export's runtime compute the
    same weights bit for bit. Float32 weights (and floating-point grids) keep float32 scales."""
    if spec.is_float or dtype not in (torch.bfloat16, torch.float16):
        return scale
    return scale.to(dtype).float().clamp_min(torch.finfo(dtype).smallest_normal)


def _check_whole_blocks(problem: WeightProblem, spec: GridSpec) -> None:
    """A floating-point grid's blocks must tile each weight's inputs (an integer grid's last
    group may be shorter)."""
    if not spec.is_float or not spec.group_size:
        return
    for key, target in problem.targets.matched.items():
        value = target.param
        inputs = value.numel() // value.shape[problem.axis(key)]
        if inputs % spec.group_size:
            raise ConfigError(
                "quantize.weights.group_size",
                spec.group_size,
                f"does not divide the {inputs} inputs of {key}: {spec.format} blocks must be whole; "
                "pick a divisor or exclude the layer",
            )


def _checked_answer(spec: GridSpec, key: str, solved: Any) -> QuantizedWeight:
    """A weight method's grid for ``key``, checked as saved parameters are: a missing weight,
    or a scale that is not positive and finite, would quantize silently to garbage."""
    found = solved.get(key) if isinstance(solved, dict) else None
    if not isinstance(found, QuantizedWeight):
        raise ConfigError(
            "quantize.weights.method",
            spec.method,
            f"returned no QuantizedWeight for {key} (got {type(found).__name__})",
        )
    try:
        _check_qparam_values(key, found.scale, found.zero_point, spec)
    except CheckpointError as err:
        raise ConfigError("quantize.weights.method", spec.method, str(err).removeprefix("quantize.qparams: ")) from None
    return found


def _attach_shadow_weights(handle: QuantizeHandle, model: nn.Module, targets: Targets, spec: GridSpec) -> None:
    shadows: dict[str, ShadowWeight] = {}
    for key, target in targets.matched.items():
        if not torch.isfinite(guards.current_value(target.param)).all():
            raise NonFiniteError(
                "quantize.weights", key, "has NaN or Inf entries; only finite weights can be quantized"
            )
        shadows[key] = ShadowWeight(key, target, spec, weight_axis(target, key) if spec.per_channel else None)
    handle.weights.update(shadows)
    attach_shadows(handle, model, shadows)


def _attach_activations(
    handle: QuantizeHandle, targets: dict[str, nn.Module], spec: GridSpec, where: str, learning: bool = False
) -> None:
    for name, module in targets.items():
        if spec.dynamic == "token" and isinstance(module, CONVOLUTIONS):
            raise ConfigError(
                "quantize.activations.dynamic",
                "token",
                f"{name} is a {type(module).__name__}, whose last dimension is space, not channels: tokens are "
                "rows of a Linear's features; use dynamic='tensor' or select the Linear layers",
            )
        axis = (
            None
            if not spec.per_channel
            else -1
            if is_hf_conv1d(module)
            else layer_axis(module, ACTIVATION_AXIS, name, "quantize.activations")
        )
        for side in activation_sides(where):
            quantizer = ActivationQuantizer(spec, axis, name, side, learning)
            hook = (
                module.register_forward_hook(quantizer)
                if side == "output"
                else module.register_forward_pre_hook(quantizer)
            )
            handle.add_hook("activation quantization hook", hook)
            handle.activations[activation_key(name, side, where)] = quantizer


def _sites_of(model: nn.Module, layers: dict[str, nn.Module], calibration: Any, qparams: Any) -> list[Site]:
    """``where="tensors"``: the quantizers one forward of the first calibration batch finds, or
    those saved parameters hold."""
    if calibration is not None:
        return tensor_sites(model, layers, next(batches(calibration, "quantize.calibration")))
    if not isinstance(qparams, dict):
        raise CheckpointError(f"quantize.qparams: got {type(qparams).__name__}; pass a path or a dict of tensors")
    sites = saved_sites(qparams, {name for name, _ in model.named_modules()})
    if not sites:
        raise CheckpointError("quantize.qparams: holds no activation parameters for this model's modules")
    return sites


def _attach_sites(handle: QuantizeHandle, model: nn.Module, sites: list[Site], spec: GridSpec) -> None:
    """One per-tensor quantizer per :class:`~surgery.ops.quantization.placement.Site`; each ReLU a
    :class:`PerCallQuantizer` (one quantizer per call), restarted by a forward-pre hook of ``model``."""
    calls: dict[str, dict[int, ActivationQuantizer]] = {}
    runs: dict[str, int] = {}
    for site in sites:
        quantizer = ActivationQuantizer(spec, None, site.layer, site.side, call=site.call, follows=site.follows)
        handle.activations[site.key] = quantizer
        module = model.get_submodule(site.layer)
        if site.side == "input":
            handle.add_hook("activation quantization hook", module.register_forward_pre_hook(quantizer))
        elif isinstance(module, ACTIVATIONS):  # quantized per call, each call as calibration saw it
            calls.setdefault(site.layer, {})[site.call] = quantizer
            runs[site.layer] = site.runs
        else:
            handle.add_hook("activation quantization hook", module.register_forward_hook(quantizer))
    for layer, quantizers in calls.items():
        split = PerCallQuantizer(quantizers, runs[layer])
        handle.add_hook("activation quantization hook", model.get_submodule(layer).register_forward_hook(split))
        handle.add_hook("activation quantization hook", model.register_forward_pre_hook(split.start))
        handle.add_hook("activation quantization hook", model.register_forward_hook(split.end, always_call=True))


def _channels(module: nn.Module, where: str) -> int | None:
    """Channels of a layer's output (``where="output"``) or input, when the layer declares them."""
    for attribute in ("out_channels", "out_features") if where == "output" else ("in_channels", "in_features"):
        if isinstance(getattr(module, attribute, None), int):
            return getattr(module, attribute)
    return None


def _check_qparam_values(name: str, scale: Any, zero_point: Any, spec: GridSpec) -> None:
    """Saved scales must be finite, positive, normal floats and zero points integers on the grid:
    anything else quantizes every value to NaN or zero."""
    for key, value in (("scale", scale), ("zero_point", zero_point)):
        if not isinstance(value, Tensor):
            raise CheckpointError(f"quantize.qparams: {name}.{key} is {type(value).__name__}; it must be a tensor")
    if not scale.is_floating_point():
        raise CheckpointError(f"quantize.qparams: {name}.scale has dtype {scale.dtype}; it must be floating")
    low, high = (0, 0) if spec.is_float else spec.quant_range  # a floating-point grid's zero point is 0
    span = 2 * spec.number_format.largest if spec.is_float else high - low
    tiny, huge = torch.finfo(torch.float32).tiny, torch.finfo(torch.float32).max / span
    scale64 = scale.detach().double()
    bad = ~(torch.isfinite(scale64) & (scale64 >= tiny) & (scale64 <= huge))
    if bad.any():
        value = scale.flatten()[bad.flatten()][0].item()
        raise CheckpointError(
            f"quantize.qparams: {name}.scale holds {value!r}; every scale must be a finite "
            f"number in [{tiny:.3g}, {huge:.3g}] (positive, not denormal, and its grid "
            "representable in float32)"
        )
    if zero_point.is_floating_point() or zero_point.is_complex() or zero_point.dtype == torch.bool:
        raise CheckpointError(
            f"quantize.qparams: {name}.zero_point has dtype {zero_point.dtype}; it must be an integer tensor"
        )
    outside = (zero_point < low) | (zero_point > high)
    if outside.any():
        value = int(zero_point.flatten()[outside.flatten()][0])
        kind = spec.format if spec.is_float else f"{spec.bits}-bit {'symmetric' if spec.symmetric else 'affine'}"
        raise CheckpointError(
            f"quantize.qparams: {name}.zero_point holds {value}; it must lie in [{low}, {high}] for {kind} quantization"
        )


def _calibrate_or_load(handle: QuantizeHandle, model: nn.Module, calibration, qparams, progress: bool) -> None:
    if all(q.spec.dynamic for q in handle.activations.values()):
        return  # scales come from each tensor as it runs
    if qparams is not None:
        saved = load_qparams(qparams) if isinstance(qparams, (str, Path)) else qparams
        if not isinstance(saved, dict):
            raise CheckpointError(
                f"quantize.qparams: got {type(saved).__name__}; pass a path or a dict of tensors "
                "as written by save_qparams"
            )
        missing = [n for n in handle.activations if f"{n}.scale" not in saved or f"{n}.zero_point" not in saved]
        if missing:
            raise CheckpointError(f"quantize.qparams: no parameters for {len(missing)} layer(s), e.g. {missing[0]}")
        for name, quantizer in handle.activations.items():
            scale, zero_point = saved[f"{name}.scale"], saved[f"{name}.zero_point"]
            _check_qparam_values(name, scale, zero_point, quantizer.spec)
            channels = _channels(model.get_submodule(quantizer.name), quantizer.where)
            fits = (
                scale.numel() == 1
                if quantizer.axis is None
                else scale.dim() == 1 and (channels is None or scale.numel() == channels)
            )
            if not fits or zero_point.shape != scale.shape:
                need = (
                    "one value each"
                    if quantizer.axis is None
                    else f"1-d tensors of length {channels if channels is not None else 'C'}"
                )
                raise CheckpointError(
                    f"quantize.qparams: {name} has scale shape {tuple(scale.shape)} and zero point "
                    f"shape {tuple(zero_point.shape)}; these settings need {need}"
                )
            quantizer.freeze(scale, zero_point)
        return
    with contextlib.ExitStack() as captures:  # the observers are the reducers, one capture per side
        for side in ("input", "output"):
            observers = {k: q.observer for k, q in handle.activations.items() if q.where == side and not q.per_call}
            if observers:
                layers = {k: model.get_submodule(handle.activations[k].name) for k in observers}
                capture = Capture(model, layers, (f"{side}s",), lambda key, module, seen=observers: seen[key])
                captures.enter_context(capture)
        run_batches(model, calibration, field="quantize.calibration", progress=progress, error=NonFiniteError)
    for quantizer in handle.activations.values():
        if quantizer.per_call and quantizer.observer.low is None:
            raise ConfigError(
                "quantize.calibration", quantizer.name, f"ran fewer than {quantizer.call + 1} times in a forward"
            )
        quantizer.freeze()
    for quantizer in handle.activations.values():
        if quantizer.follows is not None:  # its input is a quantized tensor, max-pooled: one grid for both
            source = handle.activations[quantizer.follows]
            quantizer.freeze(source.scale.clone(), source.zero_point.clone())
