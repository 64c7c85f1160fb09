"""``surgery.attribution``: what a model looks at, per input, from one layer's activations and
their gradients (Grad-CAM, Grad-CAM++, input × gradient), and how compression moved it.

A forward hook on the chosen layer keeps its output and puts a tensor hook (``register_hook``)
on it that keeps the gradient flowing back into it: the two hook levels of the classic CAM
recipe. Both leave when the call returns, also on errors. The maps follow pytorch-grad-cam's
arithmetic: the method's weighted sum over channels, rectified, scaled to [0, 1] per input at
the layer's resolution, resized bilinearly to the input image (for a 2-d layer under an image
input) and scaled to [0, 1] again. A layer with tokens instead of space (a transformer block,
an embedding) gives one value per token.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from surgery.analysis.attribution_memory import check_attribution_memory
from surgery.analysis.metrics import logits_of
from surgery.core.errors import ConfigError, ConfigTypeError
from surgery.core.inputs import Call, Inputs, as_call, batches, evaluating, flatten_tensors
from surgery.core.layer_kinds import is_kind
from surgery.core.registry import Registry
from surgery.core.selection import select as select_modules
from surgery.core.settings import settings_from

# (activations, gradients), channels first: (N, C, *positions) -> per-position scores (N, *positions)
AttributionFn = Callable[[Tensor, Tensor], Tensor]
ATTRIBUTIONS: Registry[AttributionFn] = Registry("attribution.method")


def register_attribution(name: str, method: AttributionFn, *, replace: bool = False) -> AttributionFn:
    """Make ``method(activations, gradients) -> scores`` available as ``attribution(method=name)``:
    both are (N, C, *positions), channels first; return (N, *positions), before rectifying."""
    if not callable(method):
        raise ConfigError("register_attribution.method", method, "must be a function (activations, gradients)")
    return ATTRIBUTIONS.register(name, method, replace=replace)


def grad_cam(activations: Tensor, gradients: Tensor) -> Tensor:
    """Selvaraju et al. 2017: each channel weighted by its gradient averaged over positions."""
    positions = tuple(range(2, activations.dim()))
    weights = gradients.mean(dim=positions, keepdim=True)
    return (weights * activations).sum(dim=1)


def grad_cam_plus_plus(activations: Tensor, gradients: Tensor) -> Tensor:
    """Chattopadhay et al. 2018 (eq. 19): positive gradients weighted by alpha, summed."""
    positions = tuple(range(2, activations.dim()))
    squared, cubed = gradients**2, gradients**3
    total = activations.sum(dim=positions, keepdim=True)
    alpha = squared / (2 * squared + total * cubed + 1e-6)
    alpha = torch.where(gradients != 0, alpha, torch.zeros_like(alpha))
    weights = (gradients.clamp(min=0) * alpha).sum(dim=positions, keepdim=True)
    return (weights * activations).sum(dim=1)


def input_x_gradient(activations: Tensor, gradients: Tensor) -> Tensor:
    """Each position's activations times their gradients, summed over channels, in magnitude."""
    return (activations * gradients).sum(dim=1).abs()


register_attribution("gradcam", grad_cam)
register_attribution("gradcam_plus_plus", grad_cam_plus_plus)
register_attribution("input_x_gradient", input_x_gradient)


@dataclass
class Attribution:
    """What :func:`attribution` found: ``maps`` (N, H, W) for images, (N, tokens) for tokens, each
    in [0, 1]; the ``layer`` and ``method``; the ``targets`` explained (one class each)."""

    maps: Tensor
    layer: str
    method: str
    targets: Tensor


def attribution(
    model: nn.Module,
    inputs: Any,
    *,
    method: str = "gradcam",
    select: Any = None,
    target: int | Tensor | None = None,
) -> Attribution:
    """Attribution maps of ``model`` on one batch of ``inputs`` at the layer ``select`` picks.

    Args:
        model: any module; it runs in eval mode once forward and once backward (its training
            flags, parameters and gradients are as they were afterwards), after a probe forward
            on one small input that estimates the activation memory; an estimate beyond the
            memory available is refused (:mod:`~surgery.analysis.attribution_memory`).
        inputs: one batch (a tensor, a tuple of positional inputs or a dict of keyword inputs).
        method: ``"gradcam"``, ``"gradcam_plus_plus"``, ``"input_x_gradient"``, or a name added with
            :func:`register_attribution`.
        select: the layer (a name or selection matching exactly one module): convolutions give
            spatial maps, transformer blocks and embeddings one value per token; None: the
            input itself (input × gradient's classic form).
        target: the class explained, for every input or one per input (a tensor of N); default
            each input's top class (for sequence outputs, at the last position).

    Example:
        >>> found = surgery.attribution(resnet, images, method="gradcam", select="layer4")
        >>> found.maps.shape
        torch.Size([8, 224, 224])
    """
    fn = ATTRIBUTIONS.get(method)
    call = as_call(inputs, "attribution.inputs")
    check_attribution_memory(model, call, _image(call))  # before the forward that keeps its activations
    if select is None:  # the input itself
        activations, gradients, targets = _at_input(model, call, target)
        name = "input"
    else:
        name, layer = _layer(model, select)
        with evaluating(model), _kept_gradients(model), _LayerTap(layer) as tap, torch.enable_grad():
            output = call(model)
            tap.check(name)
            targets = _backward(output, target)
            activations, gradients = tap.channels_first(name)
    raw = fn(activations.detach().float(), gradients.detach().float()).clamp(min=0)
    maps = _scaled(raw)
    image = _image(call)
    if image is not None and maps.dim() == 3 and image.dim() == 4:
        maps = _scaled(F.interpolate(maps.unsqueeze(1), size=image.shape[-2:], mode="bilinear").squeeze(1))
    return Attribution(maps, name, method, targets.cpu())


def _backward(output: Any, target: int | Tensor | None) -> Tensor:
    """Back-propagate the explained classes' scores; return those classes."""
    scores = _scores(output)
    targets = _targets(scores, target)
    scores.gather(1, targets.to(scores.device).view(-1, 1)).sum().backward()
    return targets


def _at_input(model: nn.Module, call: Call, target: int | Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """The input's values and gradients, channels first ((N, L) signals as one channel)."""
    image = _image(call)
    if image is None:
        raise ConfigError(
            "attribution.select", None, "the model's first input is not a floating tensor: name a layer (an embedding)"
        )
    x = image.detach().clone().requires_grad_(True)
    args = (x, *call.args[1:]) if call.args else ()
    kwargs = dict(call.kwargs) if call.args else {**call.kwargs, next(iter(call.kwargs)): x}
    with evaluating(model), _kept_gradients(model), torch.enable_grad():
        targets = _backward(Call(args, kwargs)(model), target)
    values, gradients = (x.detach(), x.grad) if x.dim() > 2 else (x.detach().unsqueeze(1), x.grad.unsqueeze(1))
    return values, gradients, targets


def _layer(model: nn.Module, select: Any) -> tuple[str, nn.Module]:
    chosen = select_modules(model, select, field="attribution.select")
    if len(chosen) != 1:
        raise ConfigError(
            "attribution.select", select, f"matches {len(chosen)} layers ({', '.join(list(chosen)[:3])}...); pick one"
        )
    return next(iter(chosen.items()))


@contextlib.contextmanager
def _kept_gradients(model: nn.Module) -> Iterator[None]:
    """The parameters' gradients as they were (the backward here is not the caller's)."""
    kept = [(p, p.grad) for p in model.parameters()]
    for p, _ in kept:
        p.grad = None
    try:
        yield
    finally:
        for p, grad in kept:
            p.grad = grad


class _LayerTap:
    """A forward hook keeping the layer's output, and on it a tensor hook keeping its gradient."""

    def __init__(self, layer: nn.Module) -> None:
        self.layer = layer
        self.output: Tensor | None = None  # a copy: later in-place ops (``+=``, ``relu_``) cannot touch it
        self.gradient: Tensor | None = None
        self.calls = 0
        self._hooks: list[Any] = []

    def __enter__(self) -> _LayerTap:
        self._hooks.append(self.layer.register_forward_hook(self._keep))
        return self

    def __exit__(self, *exc: object) -> None:
        while self._hooks:
            self._hooks.pop().remove()

    def _keep(self, module: nn.Module, args: tuple, output: Any) -> None:
        tensors = flatten_tensors(output)
        if not tensors:
            return
        self.calls += 1
        self.output = tensors[0].detach().clone()
        if tensors[0].requires_grad:
            self._hooks.append(tensors[0].register_hook(self._keep_gradient))

    def _keep_gradient(self, gradient: Tensor) -> None:
        self.gradient = gradient

    def check(self, name: str) -> None:
        if self.output is None:
            raise ConfigError("attribution.select", name, "did not run in the forward (or gave no floating tensor)")
        if self.output.dim() < 3:
            raise ConfigError(
                "attribution.select",
                name,
                f"gives {tuple(self.output.shape)}: no spatial or token axis to map (pick a convolution, "
                "a transformer block or an embedding)",
            )
        if self.calls > 1:
            raise ConfigError(
                "attribution.select",
                name,
                f"ran {self.calls} times in one forward (a shared module): its activations and gradients "
                "cannot be paired; pick a layer that runs once",
            )
        if not self._hooks[1:]:
            raise ConfigError("attribution.select", name, "its output takes no gradient (frozen, or under no_grad)")
        if (
            math.prod(self.output.shape[2:] if _channel_axis(self.layer, self.output) == 1 else self.output.shape[1:-1])
            == 1
        ):
            raise ConfigError(
                "attribution.select", name, f"gives {tuple(self.output.shape)}: one position, nothing to map"
            )

    def channels_first(self, name: str) -> tuple[Tensor, Tensor]:
        if self.gradient is None:
            raise ConfigError("attribution.select", name, "no gradient reached it from the explained output")
        axis = _channel_axis(self.layer, self.output)
        return self.output.movedim(axis, 1), self.gradient.movedim(axis, 1)


def _channel_axis(layer: nn.Module, output: Tensor) -> int:
    """Where the channels are. Images (4-d, 5-d): first, (N, C, H, W), unless the layer holds no
    convolution and normalises or projects its last axis (a Swin stage: (N, H, W, C)).
    Sequences (3-d): first for 1-d convolutions (N, C, L), else last: tokens × features."""
    modules = list(layer.modules())
    if output.dim() >= 4:
        widths = {getattr(m, "normalized_shape", (None,))[-1] for m in modules} | {
            getattr(m, "out_features", None) for m in modules
        }
        channels_last = (
            not any(is_kind(m, lambda kind: kind.convolution) for m in modules) and output.shape[-1] in widths
        )
        return output.dim() - 1 if channels_last else 1
    if any(isinstance(m, nn.Conv1d) for m in modules):
        return 1
    return output.dim() - 1


def _scores(output: Any) -> Tensor:
    """The class scores: (N, classes), the last position's for sequence outputs."""
    try:
        scores = logits_of(output)
    except TypeError:
        raise ConfigTypeError("attribution.model", type(output).__name__, "gives no tensor of class scores") from None
    if scores.dim() == 3:  # (N, positions, classes): the prediction at the last position
        scores = scores[:, -1]
    if scores.dim() != 2:
        raise ConfigError("attribution.model", tuple(scores.shape), "must give (N, classes) scores to explain")
    return scores


def _targets(scores: Tensor, target: int | Tensor | None) -> Tensor:
    count, classes = scores.shape
    if target is None:
        return scores.detach().argmax(dim=1)
    chosen = class_indices(target)
    if chosen.numel() == 1:
        chosen = chosen.expand(count)
    if chosen.numel() != count:
        raise ConfigError("attribution.target", target, f"must be one class or one per input ({count})")
    bad = chosen[(chosen < 0) | (chosen >= classes)]
    if bad.numel():
        raise ConfigError("attribution.target", int(bad[0]), f"is not a class index: the model has {classes} classes")
    return chosen


def class_indices(target: Any) -> Tensor:
    """``target`` as a flat tensor of class indices; a fraction, a boolean or text is refused."""
    if isinstance(target, (bool, str)):
        raise ConfigTypeError("attribution.target", target, "must be a class index (an integer) or one per input")
    try:
        found = torch.as_tensor(target)
    except (TypeError, ValueError, RuntimeError):
        raise ConfigTypeError(
            "attribution.target", target, "must be a class index (an integer) or one per input"
        ) from None
    if (
        found.dtype == torch.bool
        or found.is_complex()
        or (found.is_floating_point() and not torch.equal(found, found.round()))
    ):
        raise ConfigError("attribution.target", target, "must be a class index (an integer) or one per input")
    return found.long().reshape(-1)


def _scaled(maps: Tensor) -> Tensor:
    """Each map shifted to 0 and scaled to 1 at its top, as pytorch-grad-cam's scale_cam_image."""
    flat = maps.reshape(maps.shape[0], -1)
    flat = flat - flat.min(dim=1, keepdim=True).values
    flat = flat / (1e-7 + flat.max(dim=1, keepdim=True).values)
    return flat.reshape(maps.shape)


def _image(call: Call) -> Tensor | None:
    first = call.args[0] if call.args else next(iter(call.kwargs.values()), None)
    return first if isinstance(first, Tensor) and first.is_floating_point() else None


@dataclass(frozen=True)
class AttributionSpec:
    """What :func:`attribution_drift` (and ``compare(..., attribution=...)``) maps: the
    ``method``, the layer ``select`` picks (None: the input), the ``target`` class (default the
    reference's top class, explained in both models), and ``top_k``: the fraction of positions
    counted as the most important when overlaps are measured."""

    method: str = "gradcam"
    select: Any = None
    target: Any = None
    top_k: float = 0.1

    def __post_init__(self) -> None:
        ATTRIBUTIONS.get(self.method)
        if self.target is not None:
            class_indices(self.target)
        k = self.top_k
        if isinstance(k, bool) or not isinstance(k, (int, float)) or not 0 < k <= 1:
            raise ConfigError("attribution.top_k", k, "must be a fraction of the positions in (0, 1]")


def attribution_spec(value: Any) -> AttributionSpec:
    """An :class:`AttributionSpec` from one or a dict of its fields."""
    return settings_from(AttributionSpec, value, "attribution")


@dataclass(frozen=True)
class AttributionDrift:
    """How the maps of a candidate differ from a reference's on the same inputs and classes:
    per input, the ``cosine`` of the two maps and the ``overlap`` of their top ``top_k``
    positions (shared ÷ counted); their means; and the first inputs' maps for a picture
    (``reference_maps``, ``candidate_maps``, ``inputs``)."""

    method: str
    layer: str
    top_k: float
    cosine: list[float]
    overlap: list[float]
    reference_maps: Tensor = dataclasses.field(repr=False, compare=False)
    candidate_maps: Tensor = dataclasses.field(repr=False, compare=False)
    inputs: Any = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def mean_cosine(self) -> float:
        return float(torch.tensor(self.cosine, dtype=torch.float64).mean())

    @property
    def mean_overlap(self) -> float:
        return float(torch.tensor(self.overlap, dtype=torch.float64).mean())

    def as_dict(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "layer": self.layer,
            "top_k": self.top_k,
            "mean_cosine": self.mean_cosine,
            "mean_top_k_overlap": self.mean_overlap,
            "cosine": self.cosine,
            "top_k_overlap": self.overlap,
        }


PICTURED = 8  # inputs kept for the overlay grid


def attribution_drift(
    reference: nn.Module, candidate: nn.Module, inputs: Inputs, spec: AttributionSpec | dict
) -> AttributionDrift:
    """The maps of both models on every batch of ``inputs``, compared input by input (the
    candidate explains the class the reference explains). NaN in either map gives a NaN
    cosine, which no bound passes."""
    spec = attribution_spec(spec)
    cosines: list[float] = []
    overlaps: list[float] = []
    pictured: list[tuple[Tensor, Tensor, Any]] = []
    layer = "input"
    for batch in batches(inputs, "attribution.inputs"):
        ours = attribution(reference, batch, method=spec.method, select=spec.select, target=spec.target)
        theirs = attribution(candidate, batch, method=spec.method, select=spec.select, target=ours.targets)
        layer = ours.layer
        first, second = ours.maps.flatten(1).double(), theirs.maps.flatten(1).double()
        cosine = F.cosine_similarity(first, second, dim=1, eps=1e-12)
        both_flat = (first.abs().sum(1) == 0) & (second.abs().sum(1) == 0)  # a constant map scales to zeros
        cosines += torch.where(both_flat, torch.ones_like(cosine), cosine).tolist()
        overlaps += _overlap(first, second, spec.top_k).tolist()
        same_shape = not pictured or pictured[0][0].shape[1:] == ours.maps.shape[1:]  # token batches vary
        if same_shape and sum(len(p[0]) for p in pictured) < PICTURED:
            pictured.append((ours.maps, theirs.maps, _image(batch)))
    reference_maps = torch.cat([p[0] for p in pictured])[:PICTURED]
    candidate_maps = torch.cat([p[1] for p in pictured])[:PICTURED]
    images = [p[2] for p in pictured if p[2] is not None]
    shown = torch.cat(images)[:PICTURED].detach().cpu() if len(images) == len(pictured) else None
    return AttributionDrift(spec.method, layer, spec.top_k, cosines, overlaps, reference_maps, candidate_maps, shown)


def _overlap(first: Tensor, second: Tensor, fraction: float) -> Tensor:
    """The share of each row's top ``fraction`` positions the two rows have in common (NaN
    where either holds NaN)."""
    k = max(1, round(fraction * first.shape[1]))
    top = first.topk(k, dim=1).indices
    other = second.topk(k, dim=1).indices
    shared = torch.zeros(first.shape[0], dtype=torch.float64, device=first.device)
    for row in range(first.shape[0]):
        shared[row] = len(set(top[row].tolist()) & set(other[row].tolist())) / k
    broken = ~(torch.isfinite(first).all(1) & torch.isfinite(second).all(1))
    return torch.where(broken, torch.full_like(shared, float("nan")), shared)
