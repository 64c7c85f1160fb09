"""What ``quantize`` selects and how it attaches its quantizers to weights and activations."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

from surgery.core import guards
from surgery.core._compat import CONVOLUTIONS, forward_hook_functions
from surgery.core.errors import AlreadyModifiedError, CheckpointError, ConfigError
from surgery.core.inputs import batches
from surgery.core.layer_kinds import channel_axis
from surgery.core.originals import Originals
from surgery.core.selection import Selection, describe, select
from surgery.core.targets import Targets, default_layer, is_hf_conv1d, select_parameters
from surgery.core.transforms import attach_all
from surgery.ops.numerics.fake_quant import g_idx_problem
from surgery.ops.numerics.grid import GridSpec
from surgery.ops.numerics.observers import NonFiniteError
from surgery.ops.numerics.weight_methods import QuantizedWeight, WeightProblem, method_of, settings_of, weight_axis
from surgery.ops.quantization.placement import ACTIVATIONS, Site, saved_sites, tensor_sites
from surgery.ops.quantization.qat import ShadowWeight, attach_shadows
from surgery.ops.quantization.qparams import QuantizeHandle, _check_qparam_values
from surgery.ops.quantization.quantizers import (
    ActivationQuantizer,
    PerCallQuantizer,
    WeightQuantizer,
    activation_key,
    activation_sides,
)
from surgery.ops.quantization.spec import QuantizeSpec
from surgery.ops.quantization.targets import DeployTarget


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
            channel_axis(module, "activation_axis", name, "quantize.activations")
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
    method: Any = "rtn",
    unrouted: str = "refuse",
) -> None:
    for key, target in targets.matched.items():
        if not torch.isfinite(guards.current_value(target.param)).all():
            raise NonFiniteError(
                "quantize.weights", key, "has NaN or Inf entries; only finite weights can be quantized"
            )
    store = Originals(originals)
    attached: set[str] = set()  # until attached, a weight the method wrote into is put back by the handle
    handle.add("put back weights a method wrote but never attached", lambda: store.put_back(skip=attached))
    chosen = method_of(method)
    settings = settings_of(method)
    problem = WeightProblem(
        model,
        targets,
        spec,
        calibration,
        blocks,
        progress,
        originals=store,
        settings=settings,
        method=chosen.name,
        unrouted=unrouted,
    )
    _check_whole_blocks(problem, spec)
    solved = chosen(problem)
    handle.sequential = problem.sequential
    quantizers = {}
    for key, target in targets.matched.items():
        found = _checked_answer(spec, chosen.name, key, solved)
        _check_g_idx(spec, chosen.name, key, found, target.param)
        store.keep(key, target.param)  # unless the method kept it before writing
        saved = store.saved(key)
        scale = _scale_as_stored(found.scale, target.param.dtype, spec)
        quantizer = WeightQuantizer(spec, scale, found.zero_point, found.axis, found.value, saved, found.g_idx)
        quantizers[key] = (target.param, quantizer)
    for key, (_param, quantizer) in quantizers.items():
        handle.weights[key] = quantizer
    attach_all(handle, model, quantizers, "weight quantization hook")
    attached.update(quantizers)


def _scale_as_stored(scale: Tensor, dtype: torch.dtype, spec: GridSpec) -> Tensor:
    """An integer grid's scale rounded to a half-precision weight's dtype, the dtype
    compressed-tensors stores ``weight_scale`` in: then ``(q - zero point) x scale`` is exact
    before its one rounding to that dtype, so the simulation and an export's runtime compute the
    same weights bit for bit. Float32 weights, floating-point grids and two-level grids keep
    float32 scales."""
    if spec.is_float or spec.super_group or dtype not in (torch.bfloat16, torch.float16):
        return scale  # a two-level grid's scale is its super group's times an integer, kept exact
    return scale.to(dtype).float().clamp_min(torch.finfo(dtype).smallest_normal)


def _check_whole_blocks(problem: WeightProblem, spec: GridSpec) -> None:
    """A floating-point grid's blocks, and a two-level grid's super groups, must tile each
    weight's inputs (an integer grid's last group may be shorter)."""
    size, name = (spec.super_group, "super_group") if spec.super_group else (spec.group_size, "group_size")
    if not size or not (spec.is_float or spec.super_group):
        return
    for key, target in problem.targets.matched.items():
        value = target.param
        inputs = value.numel() // value.shape[problem.axis(key)]
        if inputs % size:
            kind = "super groups" if spec.super_group else f"{spec.format} blocks"
            hint = (
                "exclude the layer (e.g. gguf:Q8_0 for it)"
                if spec.super_group
                else "pick a divisor or exclude the layer"
            )
            raise ConfigError(
                f"quantize.weights.{name}",
                size,
                f"does not divide the {inputs} inputs of {key}: {kind} must be whole; {hint}",
            )


def _checked_answer(spec: GridSpec, method: str, key: str, solved: Any) -> QuantizedWeight:
    """A weight method's grid for ``key``, checked as saved parameters are: a missing weight,
    or a scale that is not positive and finite, would quantize silently to garbage."""
    found = solved.get(key) if isinstance(solved, dict) else None
    if not isinstance(found, QuantizedWeight):
        raise ConfigError(
            "quantize.method",
            method,
            f"returned no QuantizedWeight for {key} (got {type(found).__name__})",
        )
    try:
        _check_qparam_values(key, found.scale, found.zero_point, spec)
    except CheckpointError as err:
        raise ConfigError("quantize.method", method, str(err).removeprefix("quantize.qparams: ")) from None
    return found


def _check_g_idx(spec: GridSpec, method: str, key: str, found: QuantizedWeight, weight: Tensor) -> None:
    """A method's group index (``g_idx``) must give each input column a group of ``group_size``
    columns: any other would quantize silently with the wrong scales."""
    if found.g_idx is None:
        return
    if not spec.group_size or found.axis is None:
        raise ConfigError("quantize.method", method, f"returned a g_idx for {key} without group_size")
    problem = g_idx_problem(found.g_idx, weight.numel() // weight.shape[found.axis], spec.group_size)
    if problem is not None:
        raise ConfigError("quantize.method", method, f"returned a g_idx for {key} that {problem}")


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
            else channel_axis(module, "activation_axis", name, "quantize.activations")
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
