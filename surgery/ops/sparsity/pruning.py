"""``surgery.prune``: pruning masks enforced by forward-pre hooks, owned by a handle."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace as replace_fields
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from surgery.core import guards
from surgery.core.capture import SquaredNorms
from surgery.core.errors import ConfigError
from surgery.core.inputs import Inputs
from surgery.core.layer_kinds import input_axis_of
from surgery.core.originals import Originals
from surgery.core.selection import Selection
from surgery.core.sequential import UNROUTED, find_blocks, onloading, resolve_blocks, run_sequential
from surgery.core.targets import Target, Targets, select_parameters
from surgery.core.verbs import VerbCall, verb
from surgery.ops.experts.linearizing import linearized, with_linear_experts
from surgery.ops.offload.offloaded_compression import (
    OffloadedCompression,
    OffloadedVerb,
    compress_offloaded,
    stage_layers,
)
from surgery.ops.offload.offloading import Offloaded
from surgery.ops.second_order.second_order import check_layers, reconstruct_layers, warn_unrouted
from surgery.ops.sparsity.criteria import (
    Criterion,
    LayerStats,
    compute_scores,
    masks_from_scores,
    masks_n_m,
    parse_pattern,
)
from surgery.ops.sparsity.masks import MaskEnforcer, PruneHandle, attach_masks, mask_enforcers
from surgery.ops.sparsity.spec import PruneSpec, group_share, layer_amounts
from surgery.ops.sparsity.statistics import calibrate, calibrate_with_gradients, has_input_features, input_major_order


@verb(
    "prune",
    PruneSpec,
    positional="amount",
    offloaded=lambda source, spec, call: _prune_offloaded(source, spec, call),
    extras={"loss": None},
    experts=with_linear_experts,
)
def prune(model: nn.Module, spec: PruneSpec, call: VerbCall) -> PruneHandle | OffloadedCompression:
    """Prune the ``weight`` of the selected layers and return a handle that can undo it.

    Args:
        model: the model to modify in place; or an offloaded model's handle
            (:func:`surgery.offloaded`), pruned block by block without loading it whole
            (``scope="layer"``): the result an :class:`OffloadedCompression` that
            ``surgery.export`` streams and whose ``restore()`` reads the source files again.
        spec: a :class:`PruneSpec` holding every setting instead (then no setting is given as a keyword).
        amount: fraction in [0, 1] of weight entries (or of slices, for a structured
            criterion) to set to zero; or a :class:`PruneSpec` holding the settings under
            *Keywords* below (then give none of them as keywords).
        calibration: batches (tensors, tuples of positional inputs or dicts of keyword
            inputs) run through the model first; each criterion then receives the
            :class:`~surgery.ops.sparsity.criteria.LayerStats` of its layer's inputs (``None`` without).
            For a gradient criterion (``"taylor"``): ``(inputs, target)`` pairs, each run
            forward and backward through ``loss``.
        loss: ``loss(output, target) -> scalar`` for gradient criteria (default cross-entropy
            on the logits); e.g. ``lambda out, _: out.loss`` for a Hugging Face model given labels.
        progress: a progress bar over calibration batches (on a terminal).
        work: for an offloaded model, the folder finished blocks are written to (kept; a run
            that died part-way, started again with the same settings and calibration, goes on
            after the last finished block); default a temporary folder.

    Keywords (the fields of :class:`PruneSpec` but ``amount``):
        method: a registered criterion: ``"l1_unstructured"`` (smallest magnitudes),
            ``"random_unstructured"`` (seeded by ``seed``), ``"ln_structured"`` (whole slices
            along ``dim`` with the smallest Ln norm, ``dim=0`` = output channels/filters),
            ``"wanda"`` (|W|·‖X‖, calibrated, ranked within each output row; ``"wanda_layer"``
            ranks across the layer), ``"taylor"`` (|w·∂L/∂w|, calibrated with a
            loss), ``"sparsegpt"`` (second order: prunes layer by layer and updates the
            weights kept to make up for what was removed), any name added with
            :func:`surgery.register_criterion`; or a function ``score(weight, stats) ->
            Tensor`` (same shape as the weight; lowest pruned).
        scope: ``"layer"`` (each weight pruned by ``amount``) or ``"global"`` (one ranking
            across all selected weights).
        n: the norm order by which ``"ln_structured"`` ranks slices (default 2).
        dim: the dimension whose slices a structured criterion prunes (0: output channels).
        seed: the seed of ``"random_unstructured"``.
        select: layers to prune (see :func:`surgery.select`; their ``weight``), or any
            floating parameter by qualified name (``"**.weight_ih_l0"``); default every
            ``nn.Conv1d/2d/3d``, ``nn.Linear`` and Hugging Face ``Conv1D``. What is left out
            and why is in :attr:`PruneHandle.skipped` (and logged).
        exclude: modules never pruned, even if selected.
        pattern: ``"N:M"`` semi-structured sparsity (``"2:4"``): in every group of M
            consecutive input features of each output, the N best-scored weights are kept, for
            any criterion; ``amount`` must be ``1 - N/M``.
        blocks: for methods calibrated layer by layer (second-order ones, and activation
            criteria such as Wanda with ``scope="layer"``), the repeated blocks calibrated one
            after another (each fed by the already pruned blocks before it): default the decoder layers
            found automatically (:func:`surgery.core.sequential.find_blocks`), a selection,
            or ``False`` for layer-by-layer full forwards.
        amounts: per-layer amounts ``{layer: amount}`` overriding ``amount`` for the layers
            listed (e.g. from :meth:`surgery.Sensitivity.amounts_for` or :func:`surgery.owl_amounts`);
            ``scope="layer"`` only.
        onload: for methods calibrated layer by layer (SparseGPT, Wanda), the device
            (``"cuda"``) each block is moved to while it is calibrated and pruned, then moved
            back: a model in CPU memory pruned at the GPU's speed. ``None`` (default): where
            the model is.
        originals: where the weights' original values wait for ``restore()``: ``"memory"`` (only
            the entries zeroed, or the whole weight when a method such as SparseGPT updates the
            weights kept), or ``"disk"`` (a temporary file each, read back on restore, deleted
            with the handle): the model then needs about one copy of its weights in memory.
        unrouted: a layer no calibration token reached (an expert its router never chose) under
            a calibrated method: ``"refuse"`` (default, one line naming it) or ``"rtn"`` (pruned by
            magnitude; warned and listed in ``handle.sequential.unrouted``).

    Returns:
        A :class:`PruneHandle`: ``restore()`` puts back the exact original values,
        ``bake()`` keeps the zeros and removes every hook.

    Example:
        >>> handle = surgery.prune(model, 0.5, method="ln_structured", select="layer4.*")
        >>> handle.sparsity()
        0.5
    """
    return _prune_in_memory(model, spec, call.calibration, call.extras["loss"], call.progress)


def _prune_in_memory(model: nn.Module, spec: PruneSpec, calibration: Any, loss: Any, progress: bool) -> PruneHandle:
    """:func:`prune` on a model in memory (its fused experts already per-expert layers)."""
    select, exclude, blocks, amounts = spec.select, spec.exclude, spec.blocks, spec.amounts
    criterion = spec.criterion
    if criterion.needs_gradients and calibration is None:
        raise ConfigError(
            "prune.calibration",
            None,
            f"method {criterion.name!r} scores with gradients; pass "
            "calibration (inputs, target) pairs (and loss=, default cross-entropy)",
        )
    if criterion.needs_calibration and calibration is None:
        uses = (
            "solves each layer with its input Hessian" if criterion.reconstruct else "scores with activation statistics"
        )
        raise ConfigError("prune.calibration", None, f"method {criterion.name!r} {uses}; pass calibration batches")
    selection = prune_targets(model, select, exclude, spec.dim)
    per_layer = layer_amounts(selection, spec, amounts)
    targets = {name: target.param for name, target in selection.matched.items()}
    guards.check_editable(targets, "prune.select")
    current = {name: guards.current_value(p) for name, p in targets.items()}  # as attached transforms keep them
    if criterion.name != "random_unstructured":
        for name, value in current.items():
            if not torch.isfinite(value).all():
                raise ConfigError(
                    "prune.select",
                    name,
                    f"has NaN or Inf entries; {criterion.name} ranks by magnitude "
                    "and needs finite weights (exclude the layer, fix the weights or use "
                    "random_unstructured)",
                )
    if loss is not None and not criterion.needs_gradients:
        raise ConfigError(
            "prune.loss",
            getattr(loss, "__name__", type(loss).__name__),
            f"is only used by gradient criteria such as 'taylor', not {criterion.name!r}",
        )
    if criterion.reconstruct is not None:
        with onloading(spec.onload, "prune.onload"):
            return _prune_reconstructing(model, selection, spec, calibration, blocks, progress, per_layer)
    if _sequential(criterion, spec):
        with onloading(spec.onload, "prune.onload"):
            return _prune_sequentially(model, selection, spec, calibration, blocks, progress, per_layer)
    if spec.onload is not None:
        raise ConfigError(
            "prune.onload",
            spec.onload,
            f"moves each block to a device while a method calibrated layer by layer (sparsegpt, wanda, "
            f"scope='layer') works on it; {criterion.name!r} with scope={spec.scope!r} calibrates no blocks",
        )
    if blocks is not None:
        raise ConfigError(
            "prune.blocks",
            blocks,
            f"applies to methods calibrated layer by layer (sparsegpt, wanda, "
            f"scope='layer'), not {criterion.name!r} with scope={spec.scope!r}",
        )
    if calibration is None:
        stats = {}
    elif criterion.needs_gradients:
        stats = calibrate_with_gradients(model, selection, calibration, loss or F.cross_entropy, progress)
    else:
        stats = calibrate(model, selection, calibration, progress)
    masks = _masks(spec, selection.matched, current, stats, per_layer)
    spilled = Originals("disk") if spec.originals == "disk" else None  # in memory: only the zeroed entries kept
    return attach_masks(PruneHandle(model, selection, spec), model, lambda: mask_enforcers(targets, masks, spilled))


def _prune_offloaded(source: Offloaded, spec: PruneSpec, call: VerbCall) -> OffloadedCompression:
    """Layer-wise methods, stage by stage (:mod:`surgery.ops.offload.offloaded_compression`)."""
    calibration, work, progress = call.calibration, call.work, call.progress
    criterion = spec.criterion
    if spec.scope != "layer" or criterion.needs_gradients:
        why = f"scope={spec.scope!r}" if spec.scope != "layer" else f"method={criterion.name!r} (gradients)"
        raise ConfigError(
            "prune.scope" if spec.scope != "layer" else "prune.method",
            why,
            "ranks across the whole model at once; an offloaded model is pruned block by block "
            "with scope='layer' (or handle.materialise() it first)",
        )
    if criterion.needs_calibration and calibration is None:
        raise ConfigError("prune.calibration", None, f"method {criterion.name!r} needs calibration batches")
    if spec.onload is not None:
        raise ConfigError(
            "prune.onload",
            spec.onload,
            "an offloaded model brings each block to the device offloaded(device=) names; set it there",
        )
    model = source.model
    with linearized(model):  # each expert's layers, as in memory
        selection = prune_targets(model, spec.select, spec.exclude, spec.dim)
    layer_amounts(selection, spec, spec.amounts)  # checked once, against the whole model
    keys: dict[str, list[str]] = {}
    for key, target in selection.matched.items():
        keys.setdefault(target.module_name, []).append(key)
    layered = criterion.reconstruct is not None or _sequential(criterion, spec)

    def run(skeleton: nn.Module, layers: list[str], block: str | None, calls: Any) -> PruneHandle:
        amounts = None if spec.amounts is None else {k: v for k, v in spec.amounts.items() if k in layers}
        staged = replace_fields(
            spec,
            select=[key for layer in layers for key in keys[layer]],
            exclude=None,
            blocks=([block] if block else False) if layered else None,
            amounts=amounts or None,
            originals="memory",
        )
        return prune(skeleton, staged, calibration=calls, progress=False)

    verb = OffloadedVerb("prune", run, repr(spec))
    blocks = resolve_blocks(model, spec.blocks, "prune.blocks") if layered else find_blocks(model)
    layers = stage_layers(model, keys)
    calibration = calibration if criterion.needs_calibration else None
    return compress_offloaded(source, verb, layers, calibration, blocks=blocks, work=work, progress=progress)


def _sequential(criterion: Criterion, spec: PruneSpec) -> bool:
    """Scored by activation statistics alone, one layer at a time: calibrated layer by layer
    on the already pruned model (a global ranking needs every layer's statistics at once)."""
    return criterion.needs_calibration and not criterion.needs_gradients and spec.scope == "layer"


def _masks(
    spec: PruneSpec,
    chosen: dict[str, Target],
    current: dict[str, Tensor],
    stats: Mapping[str, LayerStats | None],
    per_layer: dict[str, float],
) -> dict[str, Tensor]:
    """Keep-masks by parameter name for the weights in ``current``, from the criterion's scores."""
    criterion = spec.criterion
    scores = compute_scores(criterion, current, stats, n=spec.n, dim=spec.dim, scope=spec.scope, seed=spec.seed)
    inputs = [input_axis_of(chosen[name].module) if chosen[name].attribute == "weight" else 1 for name in current]
    if spec.pattern is not None:
        masks = masks_n_m(scores, list(current), inputs, *parse_pattern(spec.pattern))
    else:
        masks = masks_from_scores(
            list(current.values()),
            scores,
            [per_layer[name] for name in current] if spec.scope == "layer" else spec.amount,
            scope=spec.scope,
            structured=criterion.structured,
            dim=spec.dim,
            output_axes=[1 - axis for axis in inputs] if criterion.per_output else None,
        )
    return dict(zip(current, masks))


def _prune_sequentially(
    model: nn.Module,
    selection: Targets,
    spec: PruneSpec,
    calibration: Inputs,
    blocks: Selection | bool | None,
    progress: bool,
    per_layer: dict[str, float],
) -> PruneHandle:
    """An activation-statistics criterion (Wanda) scored stage by stage: each layer's input
    norms come from the already pruned layers before it, as in the paper's code."""
    criterion, chosen = spec.criterion, selection.matched
    for name, target in chosen.items():
        if target.attribute != "weight" or not has_input_features(target):
            raise ConfigError(
                "prune.select",
                name,
                f"has no input statistics, which {criterion.name!r} needs (only "
                "the weight of a Linear, convolution or Conv1D layer has them); exclude it",
            )
    by_layer = {target.module_name: name for name, target in chosen.items()}
    masks: dict[str, Tensor] = {}
    homes = {name: target.param.device for name, target in chosen.items()}  # its block may be onloaded
    spilled = Originals("disk") if spec.originals == "disk" else None  # in memory: only the zeroed entries kept

    def solve(reduced: dict[str, Any]) -> dict[str, Tensor]:
        names = [by_layer[layer] for layer in reduced]
        current = {name: guards.current_value(chosen[name].param) for name in names}
        stats = {by_layer[layer]: _stats_of(layer, found, chosen[by_layer[layer]]) for layer, found in reduced.items()}
        found = _masks(spec, chosen, current, stats, per_layer)
        masks.update({name: mask.to(homes[name]) for name, mask in found.items()})  # kept where the weight is
        return {name: current[name] * found[name].to(current[name].device) for name in names}

    report = run_sequential(
        model,
        {layer: chosen[name].module for layer, name in by_layer.items()},
        calibration,
        solve,
        params=lambda layer: (by_layer[layer], chosen[by_layer[layer]].param),
        blocks=blocks,
        field="prune.calibration",
        progress=progress,
        reduce=SquaredNorms,
        originals=spilled,
        settings=spec,
        unrouted=spec.unrouted,
    )
    handle = PruneHandle(model, selection, spec)
    handle.sequential = report
    params = {name: target.param for name, target in chosen.items()}
    return attach_masks(handle, model, lambda: mask_enforcers(params, masks, spilled), spilled)


def _stats_of(layer: str, found: Any, target: Target) -> LayerStats:
    """A layer's captured statistics; one no calibration input reached (``unrouted="rtn"``) has every
    input feature weighed alike, so a criterion of weights times input norms ranks by magnitude."""
    axis = input_axis_of(target.module)
    if found is UNROUTED:
        warn_unrouted("prune.calibration", layer, "the criterion")
        value = guards.current_value(target.param)
        return LayerStats(layer, torch.ones(value.shape[axis], device=value.device), 0, axis)
    return LayerStats(layer, found["sq_norms"], found["rows"], axis)


def _prune_reconstructing(
    model: nn.Module,
    selection: Targets,
    spec: PruneSpec,
    calibration: Inputs,
    blocks: Selection | bool | None,
    progress: bool,
    per_layer: dict[str, float],
) -> PruneHandle:
    """A second-order criterion: each layer's mask and updated weights from its input Hessian,
    layer after layer on the already pruned model, attached as one restorable handle."""
    criterion = spec.criterion
    if spec.scope != "layer":
        raise ConfigError(
            "prune.scope",
            spec.scope,
            f"{criterion.name} prunes each layer by amount against its own Hessian; use scope='layer'",
        )
    check_layers(selection.matched, "prune.select", criterion.name)
    pattern = parse_pattern(spec.pattern) if spec.pattern is not None else None

    solved: dict[str, int] = {}  # layer -> groups solved so far (a grouped convolution comes in parts)

    def solver(layer: str, matrix: Tensor, hessian: Tensor) -> tuple[Tensor, tuple[Tensor, ...]]:
        module = selection_modules[layer]
        order = input_major_order(module, matrix.shape[1]) if pattern else None
        if order is not None:
            matrix, hessian = matrix[:, order], hessian[order][:, order]
        group, groups = solved.get(layer, 0), getattr(module, "groups", 1)
        solved[layer] = group + 1
        amount = group_share(per_layer[f"{layer}.weight"], matrix.numel(), group, groups)
        new, keep = criterion.reconstruct(matrix, hessian, amount, pattern=pattern, name=layer)
        if order is not None:
            new, keep = new[:, order.argsort()], keep[:, order.argsort()]
        return new, (keep,)

    selection_modules = {t.module_name: t.module for t in selection.matched.values()}
    if pattern is not None:  # the layers' group sizes checked before any work
        masks_n_m(  # shapes only (on meta): no memory
            [torch.zeros(p.param.shape, device="meta") for p in selection.matched.values()],
            list(selection.matched),
            [input_axis_of(t.module) for t in selection.matched.values()],
            *pattern,
        )
    originals = Originals(spec.originals)
    results, report = reconstruct_layers(
        model,
        selection.matched,
        calibration,
        solver,
        originals,
        blocks=blocks,
        field="prune.calibration",
        progress=progress,
        settings=spec,
        unrouted=spec.unrouted,
    )
    handle = PruneHandle(model, selection, spec)
    handle.sequential = report

    def enforcers() -> dict[str, tuple[nn.Parameter, MaskEnforcer]]:
        made = {}
        for name, target in selection.matched.items():  # the updated weights are in the model already
            (keep,) = results[name]
            keep = keep if input_axis_of(target.module) != 0 else keep.t()  # stored (in, out): HF Conv1D
            mask = keep.reshape(target.param.shape).contiguous()
            made[name] = (target.param, MaskEnforcer(mask, saved=originals.saved(name)))
        return made

    return attach_masks(handle, model, enforcers, originals)


def prune_targets(model: nn.Module, include: Selection, exclude: Selection, dim: int = 0) -> Targets:
    """The weights :func:`prune` would mask, and those it would skip (also the dry run's)."""
    targets = select_parameters(model, include, exclude, verb="prune")
    for name, target in targets.matched.items():
        weight = target.param
        if not -weight.dim() <= dim < weight.dim():
            raise ConfigError("prune.dim", dim, f"must index a dimension of {name} {tuple(weight.shape)}")
    return targets
