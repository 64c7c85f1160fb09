"""``surgery.smooth``: SmoothQuant scale migration from activations to weights, restorable.

Large outlier channels in a layer's inputs make per-tensor activation quantization coarse.
SmoothQuant (Xiao et al. 2023) divides each input channel ``j`` by
``s_j = max|X_j|^α / max|W_:,j|^(1−α)`` and multiplies the weights that read it by ``s_j``:
the outputs do not change, and the activations get easier to quantize. The division is folded
into what produces the inputs, a normalisation layer (LayerNorm, RMSNorm: its weight and
bias), so nothing runs at inference. Pairs (a norm, the Linear / Conv1D layers reading its
output directly) are found by one traced forward, or named explicitly.

``max|X_j|`` is the paper's and its reference code's statistic (``statistic="absmax"``), the
range a symmetric per-tensor int8 grid has to cover. llm-compressor's ``SmoothQuantModifier``
uses the channel's spread instead, ``max X_j − min X_j``, against ``2·max|W_:,j|``
(``statistic="range"``, for parity with it): its scales are ours times
``((max − min) / (2·max|X|))^α``, equal only on channels symmetric about zero.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from dataclasses import replace as replace_fields
from typing import Any

import torch
from torch import Tensor, nn

from surgery.core import distributed, guards
from surgery.core._compat import view_base
from surgery.core.capture import Capture
from surgery.core.errors import ConfigError, ConfigTypeError
from surgery.core.handles import Handle
from surgery.core.inputs import Call, Inputs, batches, evaluating, outputs, run_batches
from surgery.core.layer_kinds import input_axis_of, is_kind
from surgery.core.sequential import find_blocks, materialise
from surgery.core.transforms import attach_all
from surgery.core.verbs import VerbCall, verb
from surgery.ops.experts.linear_experts import LinearExperts
from surgery.ops.experts.linearizing import with_linear_experts
from surgery.ops.experts.routing import expert_inputs, gates_in, moe_blocks
from surgery.ops.offload.offloaded_compression import OffloadedCompression, OffloadedVerb, compress_offloaded
from surgery.ops.offload.offloading import Offloaded

log = logging.getLogger("surgery")


class Rescaled:
    """A one-time rewrite of a parameter to smoothed values (``kind="smooth"``): written when
    attached; later re-applications change nothing, so training moves the smoothed weights
    freely. ``restore()`` puts the original values back."""

    kind = "smooth"
    rewrites = True

    def __init__(self, value: Tensor) -> None:
        self.pending: Tensor | None = value

    def apply(self, param: Tensor) -> None:
        if self.pending is not None:
            with torch.no_grad():
                param.copy_(self.pending.to(param.device, param.dtype))
            self.pending = None


@dataclass
class SmoothPair:
    """A normalisation layer, the layers reading its output, and the scales migrated."""

    norm: str
    layers: list[str]
    scales: Tensor = field(repr=False)


class SmoothHandle(Handle):
    """Handle returned by :func:`smooth`; ``pairs`` lists what was smoothed, with the scales."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__("smooth", model)
        self.pairs: list[SmoothPair] = []
        self.skipped: list[str] = []  # norms found but left out: smoothing them would change the outputs


class AbsMax:
    """Per-feature max |x| over every other axis (the last axis is the feature axis)."""

    def __init__(self, name: str = "", module: nn.Module | None = None) -> None:
        self.value: Tensor | None = None

    def update(self, tensor: Tensor) -> None:
        found = tensor.detach().abs().reshape(-1, tensor.shape[-1]).amax(0).float()
        self.value = found if self.value is None else torch.maximum(self.value, found)

    def result(self) -> Tensor | None:
        return None if self.value is None else distributed.maximum(self.value)


class Spread:
    """Per-feature ``max x − min x`` over every other axis (llm-compressor's statistic)."""

    def __init__(self, name: str = "", module: nn.Module | None = None) -> None:
        self.low: Tensor | None = None
        self.high: Tensor | None = None

    def update(self, tensor: Tensor) -> None:
        flat = tensor.detach().reshape(-1, tensor.shape[-1]).float()
        low, high = flat.amin(0), flat.amax(0)
        self.low = low if self.low is None else torch.minimum(self.low, low)
        self.high = high if self.high is None else torch.maximum(self.high, high)

    def result(self) -> Tensor | None:
        return None if self.low is None else distributed.maximum(self.high) - distributed.minimum(self.low)


# statistic -> (activation reducer, factor on max|W| per column)
STATISTICS = {"absmax": (AbsMax, 1.0), "range": (Spread, 2.0)}


def is_norm(module: nn.Module) -> bool:
    """A last-axis normalisation with a per-feature weight: ``nn.LayerNorm`` (affine), or any
    ``*RMSNorm`` class with a 1-d ``weight`` (Llama, T5, ``nn.RMSNorm``)."""
    weight = getattr(module, "weight", None)
    if not isinstance(weight, nn.Parameter) or weight.dim() != 1:
        return False
    return is_kind(module, lambda kind: kind.renormalises) or type(module).__name__.endswith("RMSNorm")


def _reads_last_axis(module: nn.Module) -> bool:
    """A matrix-like layer reading features on the last axis (Linear, HF Conv1D), as its kind says."""
    return is_kind(module, lambda k: not k.convolution and k.activation_axis == -1 and k.input_axis is not None)


def whole(tensor: Tensor) -> Tensor:
    """The tensor ``tensor`` is a view of all of (a mixture-of-experts block's ``x.view(-1, H)``),
    else ``tensor`` itself: the same values either way."""
    base = view_base(tensor)
    return base if base is not None and base.numel() == tensor.numel() else tensor


def readers_of(named: dict[str, nn.Module]) -> dict[str, list[str]]:
    """The modules a traced forward checks the inputs of, each with the layers that read that input:
    a Linear / Conv1D layer itself; a mixture-of-experts block's router or gate (a raw weight
    Parameter read by ``F.linear``, or a Linear) itself; an experts module every expert's input
    layers (they read the gathered rows of its input, the same values)."""
    found = {name: [name] for name, module in named.items() if _reads_last_axis(module)}
    found.update({name: [name] for name in gates_in(named)})
    for name, module in named.items():
        if isinstance(module, LinearExperts):
            found[name] = expert_inputs(name, module)
    return found


def find_pairs(model: nn.Module, sample: Inputs, *, views: bool = False) -> dict[str, list[str]]:
    """``{norm: [layers]}``: each normalisation layer whose output tensor itself is the input of
    Linear / Conv1D layers, seen in one forward on the first
    batch of ``sample``; with ``views``, also a view of it that keeps every channel (a language
    model's head reading the last positions). Inside a mixture-of-experts block, a reshape of all
    of it counts too (the block reads ``x.view(-1, H)``), and its router and experts module are
    readers (every expert's input layers read its gathered rows)."""
    named = dict(model.named_modules())
    produced: dict[int, tuple[str, Tensor]] = {}  # id(output) -> (norm, output): kept alive, so ids stay unique
    pairs: dict[str, list[str]] = {}
    hooks = []

    def record_output(name: str):
        def hook(module: nn.Module, args: tuple, output: object) -> None:
            if isinstance(output, Tensor):
                produced[id(output)] = (name, output)

        return hook

    def match_input(layers: list[str], reshaped: bool):
        def hook(module: nn.Module, args: tuple) -> None:
            arg = args[0] if args and isinstance(args[0], Tensor) else None
            found = None if arg is None else produced.get(id(whole(arg) if reshaped else arg))
            if found is None and views and arg is not None and view_base(arg) is not None:
                base = produced.get(id(view_base(arg)))
                keeps = base is not None and arg.shape[-1] == base[1].shape[-1] and arg.stride(-1) == base[1].stride(-1)
                found = (base[0], base[1]) if keeps else None
            if found is not None:
                known = pairs.setdefault(found[0], [])
                known.extend(layer for layer in layers if layer not in known)

        return hook

    try:
        readers, blocks = readers_of(named), moe_blocks(named)
        for name, module in named.items():
            if is_norm(module):
                hooks.append(module.register_forward_hook(record_output(name)))
            elif name in readers:
                reshaped = any(name.startswith(f"{block}.") for block in blocks)
                hooks.append(module.register_forward_pre_hook(match_input(readers[name], reshaped)))
        first = next(iter(batches(sample, "smooth.calibration")))
        with evaluating(model), torch.no_grad():
            first(model)
    finally:
        for hook in reversed(hooks):
            hook.remove()
    return pairs


@dataclass(frozen=True)
class SmoothSpec:
    """How to smooth, validated when built: ``SmoothSpec(alpha=2)`` raises at once. The fields
    are :func:`smooth`'s arguments but the calibration batches (see there)."""

    alpha: float = 0.5
    pairs: Any = None  # {norm: [layers reading its output]}; None: found by a traced forward
    statistic: str = "absmax"

    def __post_init__(self) -> None:
        alpha = self.alpha
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 <= alpha <= 1.0:
            raise ConfigError("smooth.alpha", alpha, "must be a number in [0, 1] (0.5 is SmoothQuant's default)")
        if self.statistic not in STATISTICS:
            raise ConfigError("smooth.statistic", self.statistic, f"must be one of {', '.join(STATISTICS)}")


@verb(
    "smooth",
    SmoothSpec,
    positional="alpha",
    calibration="required",
    offloaded=lambda source, spec, call: _smooth_offloaded(source, spec, call.calibration, call.work, call.progress),
    experts=with_linear_experts,
    expert_statistics=False,
)
def smooth(model: nn.Module, spec: SmoothSpec, call: VerbCall) -> SmoothHandle | OffloadedCompression:
    """Migrate activation outliers into weights (SmoothQuant); return a handle that undoes it.

    Args:
        model: the model to modify in place (outputs stay the same up to float rounding); or
            an offloaded model's handle (:func:`surgery.offloaded`), smoothed block by block
            (each block's pairs given explicitly to it), the result an
            :class:`OffloadedCompression`.
        spec: a :class:`SmoothSpec` holding every setting instead (then no setting is given as a keyword).
        alpha: migration strength in [0, 1]: 0 leaves activations as they are, 1 moves all of
            their range into the weights; 0.5 is the paper's default, 0.75-0.85 for models with
            strong outliers.
        calibration: batches run through the model to measure each channel's max |x|.
        pairs: ``{norm: [layers reading its output]}``; default found by a traced forward
            (every LayerNorm / RMSNorm feeding Linear or Hugging Face Conv1D layers directly).
        statistic: ``"absmax"`` (``max|X_j|``, the paper's) or ``"range"`` (``max − min``
            against ``2·max|W|``, llm-compressor's); see the module docstring.
        progress: a progress bar over calibration batches (on a terminal).
        work: for an offloaded model, the folder finished blocks are written to (as for
            :func:`surgery.quantize`).

    Returns:
        A :class:`SmoothHandle`: ``restore()`` gives back every original value bit for bit;
        ``bake()`` keeps the smoothed model. Quantize afterwards, e.g. W8A8 with
        ``where="input"``.

    Example:
        >>> handle = surgery.smooth(model, 0.8, calibration=batches)
        >>> surgery.quantize(model, activations=GridSpec(bits=8), where="input", calibration=batches)
    """
    return _smooth_in_memory(model, spec, call.calibration, call.progress)


def _smooth_in_memory(model: nn.Module, spec: SmoothSpec, calibration: Inputs, progress: bool) -> SmoothHandle:
    """:func:`smooth` on a model in memory (its fused experts already per-expert layers)."""
    alpha, pairs = spec.alpha, spec.pairs
    reducer, weight_factor = STATISTICS[spec.statistic]
    calibration = materialise(calibration, "smooth.calibration", model, spec)  # read more than once
    found = find_pairs(model, calibration) if pairs is None else _check_pairs(model, pairs)
    if not found:
        raise ConfigError(
            "smooth.pairs",
            None if pairs is None else dict(pairs),
            "found no normalisation layer "
            "(LayerNorm, RMSNorm) whose output feeds Linear or Conv1D layers directly; name the pairs "
            "as {norm: [layers]}",
        )
    named = dict(model.named_modules())
    maxima = _input_maxima(model, named, found, calibration, reducer, progress)
    handle = SmoothHandle(model)
    gates = gates_in(named)
    rescaled = {
        norm: _rescaled(
            named,
            norm,
            layers,
            _scales(named, norm, layers, maxima[_every_token(named, layers)], alpha, weight_factor, gates),
        )
        for norm, layers in found.items()
    }
    for updates, _ in rescaled.values():
        _check_free(updates)
    kept = _keeping_outputs(model, calibration[0], rescaled, explicit=pairs is not None)
    if not kept:
        raise ConfigError(
            "smooth.pairs",
            sorted(found),
            "none of these can be smoothed without changing the model's "
            "outputs (their norm's output is also used elsewhere, e.g. a post-norm residual, or the norm "
            "does not scale by its weight)",
        )
    updates: dict[str, tuple[nn.Parameter, Rescaled]] = {}
    handle.skipped = [norm for norm in found if norm not in kept]
    for norm in kept:
        handle.pairs.append(SmoothPair(norm, list(found[norm]), rescaled[norm][1]))
        updates.update(rescaled[norm][0])
    with handle.applying():
        attach_all(handle, model, updates, "smooth hook")
    return handle


def _smooth_offloaded(
    source: Offloaded, spec: SmoothSpec, calibration: Inputs, work: Any, progress: bool
) -> OffloadedCompression:
    """Each block's pairs smoothed on the block alone, fed by the unchanged blocks before it (the
    maxima are those of the unchanged model, as in memory)."""
    model = source.model
    calls = materialise(calibration, "smooth.calibration", model, spec)
    found = find_pairs(model, calls) if spec.pairs is None else _check_pairs(model, spec.pairs)
    if not found:
        raise ConfigError(
            "smooth.pairs", None, "found no normalisation layer whose output feeds Linear or Conv1D layers"
        )
    named = dict(model.named_modules())
    layers = {name: named[name] for norm, readers in found.items() for name in (norm, *readers)}

    def run(skeleton: nn.Module, staged: list[str], block: str | None, calls: Any) -> SmoothHandle:
        pairs = {norm: found[norm] for norm in found if norm in staged}
        return smooth(skeleton, replace_fields(spec, pairs=pairs), calibration=calls, progress=False)

    verb = OffloadedVerb("smooth", run, repr(spec), sequential=False)
    return compress_offloaded(source, verb, layers, calls, blocks=find_blocks(model), work=work, progress=progress)


def _rescaled(
    named: dict[str, nn.Module], norm: str, layers: list[str], scales: Tensor
) -> tuple[dict[str, tuple[nn.Parameter, Rescaled]], Tensor]:
    """The new values of one pair: the norm's weight and bias divided by ``scales``, the input
    columns of the layers reading it multiplied."""
    updates: dict[str, tuple[nn.Parameter, Rescaled]] = {}
    for attribute in ("weight", "bias"):
        param = getattr(named[norm], attribute, None)
        if isinstance(param, nn.Parameter):
            updates[f"{norm}.{attribute}"] = (param, Rescaled(param.detach() / scales.to(param.dtype)))
    for layer in layers:
        weight = named[layer].weight
        column = scales.view(-1, 1) if input_axis_of(named[layer]) == 0 else scales
        updates[f"{layer}.weight"] = (weight, Rescaled(weight.detach() * column.to(weight.dtype)))
    return updates, scales


def _check_free(updates: dict[str, tuple[nn.Parameter, Rescaled]]) -> None:
    for name, (param, _) in updates.items():
        kinds = [t.kind for t in guards.transforms_of(param)]
        if "smooth" in kinds:
            raise ConfigError("smooth.pairs", name, "is already smoothed; restore() or bake() that handle first")
        if kinds:
            raise ConfigError(
                "smooth.pairs",
                name,
                f"already has {', '.join(kinds)} attached; smooth first, then "
                "prune or quantize (SmoothQuant rescales the weights those were computed on)",
            )


def _keeping_outputs(
    model: nn.Module, first: Call, rescaled: dict[str, tuple[dict, Tensor]], explicit: bool
) -> list[str]:
    """The pairs whose smoothing leaves the model's outputs on ``first`` as they are (to float
    rounding): all at once if they do together, else one by one. A post-norm block (BERT),
    whose norm output is also the residual, or a norm computing ``x * (1 + w)`` (Gemma) is
    left out and logged; a pair named explicitly raises instead."""
    reference = _flat_outputs(model, first)
    # rounding the rescaled weights to their dtype moves the outputs: 1e-3 is far above float32's
    # and float16's, and below bfloat16's (8 ulps there); a post-norm residual moves them by far more
    lowest = max(
        (param.dtype for updates, _ in rescaled.values() for param, _ in updates.values()),
        key=lambda dtype: torch.finfo(dtype).eps,
    )
    tolerance = max(1e-3, 8 * torch.finfo(lowest).eps)

    def unchanged(norms: list[str]) -> bool:
        originals = {
            name: (param, param.detach().clone()) for norm in norms for name, (param, _) in rescaled[norm][0].items()
        }
        try:
            with torch.no_grad():
                for norm in norms:
                    for param, update in rescaled[norm][0].values():
                        param.copy_(update.pending.to(param.dtype))
            candidate = _flat_outputs(model, first)
        finally:
            with torch.no_grad():
                for param, original in originals.values():
                    param.copy_(original)
        scale = reference.abs().max().clamp(min=1e-12)
        return candidate.shape == reference.shape and bool(((candidate - reference).abs().max() / scale) < tolerance)

    norms = list(rescaled)
    if unchanged(norms):
        return norms
    kept = []
    for norm in norms:
        if unchanged([norm]):
            kept.append(norm)
        elif explicit:
            raise ConfigError(
                "smooth.pairs",
                norm,
                "smoothing it changes the model's outputs (its output is also "
                "used elsewhere, e.g. a post-norm residual, or it does not scale by its weight)",
            )
        else:
            log.warning(
                "smooth: %s left out: smoothing it changes the model's outputs (its output is also used "
                "elsewhere, e.g. a post-norm residual, or it does not scale by its weight)",
                norm,
            )
    return kept


def _flat_outputs(model: nn.Module, call: Call) -> Tensor:
    with evaluating(model), torch.no_grad():
        found = outputs(model, call)
    return torch.cat([t.detach().float().flatten() for t in found]) if found else torch.zeros(0)


def _check_pairs(model: nn.Module, pairs: Mapping[str, Iterable[str]]) -> dict[str, list[str]]:
    if not isinstance(pairs, Mapping):
        raise ConfigTypeError("smooth.pairs", pairs, "must be a dict {norm: [layers reading its output]}")
    named = dict(model.named_modules())
    gates = gates_in(named)
    checked: dict[str, list[str]] = {}
    for norm, layers in pairs.items():
        if norm not in named or not is_norm(named[norm]):
            raise ConfigError("smooth.pairs", norm, "is not a LayerNorm or RMSNorm of the model")
        layers = [layers] if isinstance(layers, str) else list(layers)
        features = named[norm].weight.numel()
        for layer in layers:
            module = named.get(layer)
            if module is None or not (_reads_last_axis(module) or layer in gates):
                raise ConfigError(
                    "smooth.pairs",
                    layer,
                    "is not a Linear or Conv1D layer, or a mixture-of-experts router, of the model",
                )
            inputs = module.weight.shape[input_axis_of(module)]
            if inputs != features:
                raise ConfigError("smooth.pairs", layer, f"reads {inputs} features; {norm} produces {features}")
        if not layers:
            raise ConfigError("smooth.pairs", norm, "lists no layer")
        checked[norm] = layers
    return checked


def _every_token(named: dict[str, nn.Module], layers: list[str]) -> str:
    """The first of ``layers`` that reads every token (not an expert's layer, which reads only the rows
    routed to it): the one whose input statistic is the norm's output's."""
    experts = [name for name, module in named.items() if isinstance(module, LinearExperts)]
    return next((layer for layer in layers if not any(layer.startswith(f"{e}.") for e in experts)), layers[0])


def _input_maxima(
    model: nn.Module,
    named: dict[str, nn.Module],
    found: dict[str, list[str]],
    calibration: Inputs,
    reducer: type,
    progress: bool,
) -> dict[str, Tensor]:
    layers = {_every_token(named, pair): named[_every_token(named, pair)] for pair in found.values()}
    with Capture(model, layers, ("inputs",), reducer) as seen:
        count = run_batches(model, calibration, field="smooth.calibration", progress=progress)
    if not count:
        raise ConfigError("smooth.calibration", "0 batches", "must hold at least one batch")
    maxima = seen.inputs
    for layer in layers:
        if maxima.get(layer) is None:
            raise ConfigError("smooth.calibration", layer, "this layer received no input during calibration")
    return maxima


def _scales(
    named: dict[str, nn.Module],
    norm: str,
    layers: list[str],
    activation: Tensor,
    alpha: float,
    weight_factor: float = 1.0,
    gates: Mapping[str, nn.Module] | None = None,
) -> Tensor:
    """``s_j = max|X_j|^α / max|W_:,j|^(1−α)`` (``activation`` is the chosen statistic,
    ``max|W|`` times ``weight_factor``), clamped away from zero; 1 for dead channels. A
    mixture-of-experts router (in ``gates``) stays float: it takes the scales, but its weights
    have no say in them."""
    layers = [layer for layer in layers if layer not in (gates or {})] or layers
    weights = [named[layer].weight.detach().float() for layer in layers]
    columns = (
        torch.stack([w.abs().amax(1 - input_axis_of(named[layer])) for w, layer in zip(weights, layers)]).amax(0)
        * weight_factor
    )
    scales = activation.clamp(min=1e-5).pow(alpha) / columns.clamp(min=1e-5).pow(1 - alpha)
    scales = torch.where((activation == 0) | (columns == 0), torch.ones_like(scales), scales)
    if not torch.isfinite(scales).all():
        raise ConfigError("smooth.calibration", norm, "gave non-finite scales (NaN or Inf inputs?)")
    return scales
