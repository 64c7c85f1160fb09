"""``surgery.prune``: pruning masks enforced by forward-pre hooks, owned by a handle."""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from dataclasses import replace as replace_fields
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from surgery.core import guards
from surgery.core.capture import SquaredNorms, gradient_statistics, input_statistics
from surgery.core.errors import ConfigError, ConfigTypeError, NoCalibrationInputError
from surgery.core.handles import Handle
from surgery.core.inputs import Inputs, present_device, run_backward_batches, run_batches, trainable
from surgery.core.layer_kinds import input_axis_of, is_kind
from surgery.core.originals import Originals, check_place
from surgery.core.selection import Selection
from surgery.core.sequential import SequentialReport, find_blocks, onloading, resolve_blocks, run_sequential
from surgery.core.targets import Skipped, Target, Targets, select_parameters
from surgery.core.transforms import Saved, SavedEntries, SavedTensor, attach_all
from surgery.core.verbs import VerbCall, verb
from surgery.ops.experts.linearizing import linearized, with_linear_experts
from surgery.ops.numerics.deployment import SparsityMask
from surgery.ops.offload.offloaded_compression import (
    OffloadedCompression,
    OffloadedVerb,
    compress_offloaded,
    stage_layers,
)
from surgery.ops.offload.offloading import Offloaded
from surgery.ops.second_order.second_order import check_layers, reconstruct_layers
from surgery.ops.sparsity.criteria import (
    CRITERIA,
    SCOPES,
    Criterion,
    LayerStats,
    as_criterion,
    compute_scores,
    masks_from_scores,
    masks_n_m,
    pack,
    parse_pattern,
    unpack,
)


@dataclass(frozen=True)
class PruneSpec:
    """How to prune, validated when built: ``PruneSpec(amount=9)`` raises at once.

    ``method`` is a registered criterion name (``surgery.register_criterion``) or a scoring
    function ``score(weight, stats) -> Tensor``; see :func:`prune` for the other fields.
    """

    amount: float = 0.5
    method: Any = "l1_unstructured"  # a registered criterion name, a Criterion or a Score function
    scope: str = "layer"
    n: float = 2.0
    dim: int = 0
    seed: int = 0
    pattern: str | None = None
    select: Any = None
    exclude: Any = None
    blocks: Any = None  # layer-by-layer methods: blocks calibrated in turn (None: found; False: layers)
    amounts: Any = None  # {layer: amount} overriding amount (scope="layer")
    onload: str | None = None  # layer-by-layer methods: the device each block is calibrated on (cuda)
    originals: str = "memory"  # where the weights' original values wait for restore(): memory or disk

    def __post_init__(self) -> None:
        amount, n = validate_arguments(self.amount, self.method, self.scope, self.n, self.seed)
        check_place(self.originals, "prune.originals")
        if self.onload is not None:
            present_device(self.onload, "prune.onload")
        if self.pattern is not None:
            check_pattern(self.pattern, amount, self.criterion)
        if self.criterion.per_output and self.scope != "layer":
            layer_wide = " (or method='wanda_layer')" if self.criterion.name == "wanda" else ""
            raise ConfigError(
                "prune.scope",
                self.scope,
                f"{self.criterion.name!r} ranks weights within each output row; use scope='layer'{layer_wide}",
            )
        if isinstance(self.dim, bool) or not isinstance(self.dim, int):
            raise ConfigTypeError(
                "prune.dim", self.dim, "must be an integer (the dimension whose slices a structured criterion prunes)"
            )
        object.__setattr__(self, "amount", amount)
        object.__setattr__(self, "n", n)
        object.__setattr__(self, "exclude", self.exclude or None)
        if self.amounts is not None and not isinstance(self.amounts, Mapping):
            raise ConfigTypeError(
                "prune.amounts", self.amounts, "must be a dict {layer: amount} (or an amounts YAML file in recipes)"
            )

    @property
    def criterion(self) -> Criterion:
        return as_criterion(self.method)


class MaskEnforcer:
    """The pruning transform of one parameter: its pruned entries are kept at zero.

    The mask is applied in place when pruning is attached, so everything that reads the
    parameter (its module's forward, or a parent that reads ``child.weight`` directly) sees
    the pruned values; the parameter's guard re-applies it whenever the tensor changes and
    after every optimizer step, and :meth:`on_gradient` zeroes the accumulated gradient of
    pruned entries. The mask is stored packed, one bit per entry; undo keeps only the entries
    it zeroes. Once training starts (the first gradient), the flat indices of the pruned
    entries are kept too (8 bytes per pruned entry), because zeroing by index is about five
    times faster than by boolean mask and a training step pays it twice.
    """

    kind = "prune"

    def __init__(self, mask: Tensor, update: Tensor | None = None, saved: Saved | None = None) -> None:
        self.shape = mask.shape
        self.packed = pack(mask)
        self._indices: Tensor | None = None  # flat indices of the pruned entries, while training
        self.pending = update  # updated weights, written once when attached
        self.rewrites = update is not None or saved is not None
        self.saved = saved  # the originals, kept before a method wrote its values into the weight

    def mask(self) -> Tensor:
        """The boolean keep-mask (``True`` keeps the entry)."""
        return unpack(self.packed, self.shape)

    def save(self, param: Tensor) -> SavedEntries | SavedTensor:
        """The original values of the entries about to be zeroed (all of them when the kept
        weights are updated too, as kept before they were)."""
        if self.saved is not None:
            return self.saved
        if self.rewrites:
            return SavedTensor(param)
        return SavedEntries(param, ~self.mask(), lambda: ~self.mask())

    def apply(self, param: Tensor) -> None:
        """Zero the pruned entries of ``param`` in place (first writing the updated weights, once)."""
        with torch.no_grad():
            if self.pending is not None:
                param.copy_(self.pending.to(param.device, param.dtype))
                self.pending = None
            self._zero(param, train=False)

    def on_gradient(self, param: Tensor) -> None:
        """Zero the pruned entries of ``param.grad`` (a post-accumulate-grad hook), so
        momentum and Adam states of pruned weights stay zero and no step moves them."""
        grad = param.grad
        if grad is None:
            return
        if grad.layout != torch.strided:  # a sparse gradient (nn.Embedding(sparse=True))
            keep = self.mask().to(grad.device)
            param.grad = (grad.to_dense() * keep).to_sparse() if grad.is_sparse else grad.to_dense() * keep
            return
        self._zero(grad, train=True)

    def release(self) -> None:
        """Drop the training cache (the transform was restored or baked)."""
        self._indices = None

    def _zero(self, tensor: Tensor, train: bool) -> None:
        if tensor.is_contiguous() and (train or self._indices is not None):
            if self._indices is None or self._indices.device != tensor.device:
                self._indices = torch.nonzero(~self.mask().flatten()).flatten().to(tensor.device)
            tensor.view(-1).index_fill_(0, self._indices, 0)
        else:  # not yet training, or a strided layout (channels_last) a flat index cannot address
            tensor.masked_fill_(~self.mask().to(tensor.device), 0)


class PruneHandle(Handle):
    """Handle returned by :func:`prune`; also reports the masks and the sparsity it made."""

    def __init__(self, model: nn.Module, selection: Targets | None = None, spec: PruneSpec | None = None) -> None:
        super().__init__("prune", model)
        self.enforcers: dict[str, MaskEnforcer] = {}
        self.selection = selection or Targets({}, [])
        self.spec = spec
        self.sequential: SequentialReport | None = None  # a second-order method's calibration pass

    @property
    def parameters(self) -> list[str]:
        """Qualified names of the masked parameters: what :meth:`sparsity` is computed over."""
        return list(self.enforcers)

    @property
    def skipped(self) -> list[Skipped]:
        """Selected (or, by default, unselected) layers and parameters left unpruned, with why."""
        return list(self.selection.skipped)

    def export_parts(self) -> list:
        if self.state != "attached":
            return []
        return [SparsityMask(name, mask) for name, mask in self.masks().items()]

    def masks(self) -> dict[str, Tensor]:
        """Boolean keep-masks by qualified parameter name (``"layer1.0.conv1.weight"``)."""
        return {name: e.mask() for name, e in self.enforcers.items()}

    def layer_sparsity(self) -> dict[str, float]:
        """Fraction of pruned entries per masked parameter."""
        return {name: 1.0 - e.mask().float().mean().item() for name, e in self.enforcers.items()}

    def sparsity(self) -> float:
        """Fraction of pruned entries over the masked parameters together (those listed by
        :attr:`parameters`; biases, norms and layers outside the selection do not count)."""
        masks = [e.mask() for e in self.enforcers.values()]
        total = sum(m.numel() for m in masks)
        return 1.0 - sum(int(m.sum()) for m in masks) / total if total else 0.0


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
    return _attach_masks(PruneHandle(model, selection, spec), model, lambda: _enforcers(targets, masks, spilled))


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
        if target.attribute != "weight" or not _has_input_features(target):
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
        stats = {
            by_layer[layer]: LayerStats(
                layer, found["sq_norms"], found["rows"], input_axis_of(chosen[by_layer[layer]].module)
            )
            for layer, found in reduced.items()
        }
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
    )
    handle = PruneHandle(model, selection, spec)
    handle.sequential = report
    params = {name: target.param for name, target in chosen.items()}
    return _attach_masks(handle, model, lambda: _enforcers(params, masks, spilled), spilled)


def _enforcers(
    params: dict[str, nn.Parameter], masks: dict[str, Tensor], spilled: Originals | None
) -> dict[str, tuple[nn.Parameter, MaskEnforcer]]:
    """The mask of each parameter; with ``spilled``, its original kept there first (on disk)."""
    made = {}
    for name, param in params.items():
        if spilled is not None:
            spilled.keep(name, param)  # unless a calibration pass kept it before writing
        made[name] = (param, MaskEnforcer(masks[name], saved=None if spilled is None else spilled.saved(name)))
    return made


def _attach_masks(
    handle: PruneHandle,
    model: nn.Module,
    enforcers: Callable[[], dict[str, tuple[nn.Parameter, MaskEnforcer]]],
    written: Originals | None = None,
) -> PruneHandle:
    """Attach the masks ``enforcers()`` makes to ``handle``, all or nothing (weights a method
    already ``written`` into are put back from there on failure)."""
    try:
        made = enforcers()
        handle.enforcers.update({name: enforcer for name, (_, enforcer) in made.items()})
        attach_all(handle, model, made, "mask hook")
    except BaseException as err:
        handle.rollback(err)
        if written is not None:
            written.put_back()
        raise
    return handle


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
        order = _input_major(module, matrix.shape[1]) if pattern else None
        if order is not None:
            matrix, hessian = matrix[:, order], hessian[order][:, order]
        group, groups = solved.get(layer, 0), getattr(module, "groups", 1)
        solved[layer] = group + 1
        amount = _share(per_layer[f"{layer}.weight"], matrix.numel(), group, groups)
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

    return _attach_masks(handle, model, enforcers, originals)


def layer_amounts(selection: Targets, spec: PruneSpec, amounts: Mapping[str, float] | None) -> dict[str, float]:
    """The amount of each selected parameter: ``amounts[layer]`` where given, else ``spec.amount``."""
    per_layer = {name: spec.amount for name in selection.matched}
    if amounts is None:
        return per_layer
    if not isinstance(amounts, Mapping):
        raise ConfigTypeError(
            "prune.amounts", amounts, "must be a dict {layer: amount} (or an amounts YAML file in recipes)"
        )
    if spec.scope != "layer" or spec.pattern is not None:
        raise ConfigError("prune.amounts", dict(amounts), "sets one amount per layer: use scope='layer' and no pattern")
    layers = {target.module_name: name for name, target in selection.matched.items()}
    for layer, amount in amounts.items():
        if isinstance(amount, bool) or not isinstance(amount, (int, float)) or not 0.0 <= amount <= 1.0:
            raise ConfigError(f"prune.amounts[{layer!r}]", amount, "must be a number in [0, 1]")
        if layer not in layers:
            if amount == 0:  # amounts may list layers this run leaves dense anyway (an excluded head)
                continue
            close = difflib.get_close_matches(str(layer), list(layers), n=3)
            raise ConfigError(
                "prune.amounts",
                layer,
                "is not a selected layer",
                f"closest: {', '.join(close)}" if close else f"selected: {', '.join(list(layers)[:5])}...",
            )
        per_layer[layers[layer]] = float(amount)
    return per_layer


def _share(amount: float, size: int, group: int, groups: int) -> float:
    """The amount for one of ``groups`` equal parts of a weight such that the parts together
    prune exactly ``round(amount × numel)`` entries (rounding once, over the whole weight)."""
    if groups == 1:
        return amount
    total = amount * size * groups
    return (round(total * (group + 1) / groups) - round(total * group / groups)) / size


def _input_major(module: nn.Module, columns: int) -> Tensor | None:
    """For a convolution, the column order that puts the input channels of each kernel position
    next to each other (``N:M`` groups run along input channels); ``None`` for linear layers."""
    if not is_kind(module, lambda kind: kind.convolution):
        return None
    positions = math.prod(module.kernel_size)
    return torch.arange(columns).view(columns // positions, positions).t().flatten()


def calibrate(
    model: nn.Module, selection: Targets, calibration: Inputs, progress: bool = True
) -> dict[str, LayerStats]:
    """Run ``calibration`` through ``model`` (eval mode, no grad) and return, by parameter name,
    the input statistics of each selected layer weight (Linear, convolution, Hugging Face
    ``Conv1D``); other parameters (e.g. an LSTM's ``weight_hh_l0``) get none."""
    weights = {name: t for name, t in selection.matched.items() if t.attribute == "weight" and _has_input_features(t)}
    layers = {target.module_name: target.module for target in weights.values()}
    count = []

    def run() -> None:
        count.append(run_batches(model, calibration, field="prune.calibration", progress=progress))

    seen = input_statistics(model, layers, run)
    if not count[0]:
        raise ConfigError("prune.calibration", "0 batches", "must hold at least one batch")
    stats: dict[str, LayerStats] = {}
    for name, target in weights.items():
        captured = seen.get(target.module_name)
        if captured is None:
            raise NoCalibrationInputError(
                "prune.calibration",
                target.module_name,
                "this layer received no floating-point input during calibration",
                "give batches that run through it, or exclude it",
            )
        stats[name] = LayerStats(
            target.module_name, captured["sq_norms"], captured["rows"], input_axis_of(target.module)
        )
    return stats


def calibrate_with_gradients(
    model: nn.Module, selection: Targets, pairs: Inputs, loss: Callable, progress: bool = True
) -> dict[str, LayerStats]:
    """:func:`calibrate` on ``(inputs, target)`` pairs run forward and backward through
    ``loss``: each layer's statistics also carry its weight's Taylor saliency and squared
    gradients (parameters' ``.grad`` and ``requires_grad`` are left as they were)."""
    weights = {name: t for name, t in selection.matched.items() if t.attribute == "weight" and _has_input_features(t)}
    layers = {target.module_name: target.module for target in weights.values()}
    count = []

    def run() -> None:
        count.append(run_backward_batches(model, pairs, loss, field="prune.calibration", progress=progress))

    def run_with_gradients() -> None:
        nonlocal gradients
        gradients = gradient_statistics(model, layers, run)

    gradients: dict[str, dict] = {}
    with trainable(model):  # before the capture: its tensor hooks need weights that require gradients
        seen = input_statistics(model, layers, run_with_gradients)
    if not count[0]:
        raise ConfigError("prune.calibration", "0 batches", "must hold at least one (inputs, target) pair")
    stats: dict[str, LayerStats] = {}
    for name, target in weights.items():
        captured, grads = seen.get(target.module_name), gradients.get(target.module_name) or {}
        if captured is None:
            raise NoCalibrationInputError(
                "prune.calibration",
                target.module_name,
                "this layer received no floating-point input during calibration",
                "give batches that run through it, or exclude it",
            )
        stats[name] = LayerStats(
            target.module_name,
            captured["sq_norms"],
            captured["rows"],
            input_axis_of(target.module),
            grads.get("taylor"),
            grads.get("grad_sq"),
        )
    return stats


def _has_input_features(target: Target) -> bool:
    """A layer whose kind has an input-channel axis (Linear, convolutions, HF Conv1D, registered kinds)."""
    return is_kind(target.module, lambda kind: kind.input_axis is not None)


def check_pattern(pattern: object, amount: float, criterion: Criterion) -> None:
    """An N:M pattern fixes the amount (``1 - N/M``) and ranks entries within groups."""
    kept, group = parse_pattern(pattern)
    if criterion.structured:
        raise ConfigError(
            "prune.pattern",
            pattern,
            f"applies to criteria that score each weight; {criterion.name!r} scores whole slices",
        )
    if abs(amount - (1 - kept / group)) > 1e-9:
        raise ConfigError(
            "prune.amount",
            amount,
            f"disagrees with pattern {pattern!r}, which prunes "
            f"{1 - kept / group:g} of every group; pass amount={1 - kept / group:g}",
        )


def validate_arguments(amount: object, method: object, scope: str, n: object, seed: object) -> tuple[float, float]:
    """Check prune's settings (also used by the CLI config); return ``(amount, norm order)``."""
    if isinstance(amount, bool) or not isinstance(amount, (int, float)):
        raise ConfigTypeError("prune.amount", amount, "must be a number in [0, 1]")
    if amount != amount or not 0.0 <= amount <= 1.0:  # NaN, or out of range (huge integers too)
        raise ConfigError("prune.amount", amount, "must be a number in [0, 1]")
    if not callable(method) and not isinstance(method, Criterion) and method not in CRITERIA:
        CRITERIA.get(method)  # raises, listing the registered criteria
    if scope not in SCOPES:
        raise ConfigError("prune.scope", scope, f"must be one of {', '.join(SCOPES)}")
    norm = {"inf": math.inf, "fro": 2.0}.get(n, n) if isinstance(n, str) else n
    if isinstance(norm, int) and not isinstance(norm, bool) and norm > 1e308:
        norm = math.inf  # an integer too large for a float: the max norm, as 'inf'
    if isinstance(norm, bool) or not isinstance(norm, (int, float)) or math.isnan(norm) or norm <= 0:
        raise ConfigError("prune.n", n, "must be a positive number, 'inf' or 'fro'")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ConfigTypeError("prune.seed", seed, "must be an integer")
    if not -(2**63) <= seed < 2**63:
        raise ConfigError("prune.seed", seed, "must fit in 64 bits")
    return float(amount), float(norm)


def prune_targets(model: nn.Module, include: Selection, exclude: Selection, dim: int = 0) -> Targets:
    """The weights :func:`prune` would mask, and those it would skip (also the dry run's)."""
    targets = select_parameters(model, include, exclude, verb="prune")
    for name, target in targets.matched.items():
        weight = target.param
        if not -weight.dim() <= dim < weight.dim():
            raise ConfigError("prune.dim", dim, f"must index a dimension of {name} {tuple(weight.shape)}")
    return targets
