"""``surgery.shrink``: remove coupled channels for real (smaller layers), restorably.

The coupling comes from :func:`surgery.core.channels.trace_channels`. Channels are ranked by
importance (the L2 norm of the weights that produce them, summed over every layer producing
the same coupled channel), and in each *family* (the channels produced by the same set of
layers: one layer's outputs, or a residual stream's) the ``amount`` least important are
removed, rounded to ``round_to``. Each affected layer is replaced by a new, smaller layer of
the same class holding the kept slices; the handle keeps the original modules, so
``restore()`` puts back the very same objects.
"""

from __future__ import annotations

import importlib
import json
import logging
import math
import os
import sys
import warnings
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from surgery.core import compiled, guards
from surgery.core._compat import BATCH_NORMS, CONVOLUTIONS, forward_hook_functions, get_slot, set_slot
from surgery.core.channels import (
    RENORMALISING,
    AttentionHeads,
    ChannelTrace,
    LayerChannels,
    output_shapes,
    rebuildable,
    trace_channels,
)
from surgery.core.errors import AlreadyModifiedError, ConfigError, ConfigTypeError, SurgeryError
from surgery.core.handles import Handle
from surgery.core.inputs import Inputs, batches, evaluating
from surgery.core.registry import Registry
from surgery.core.selection import Selection
from surgery.core.selection import select as select_modules
from surgery.ops.build import rules
from surgery.ops.build.intercept import RuleNeverFiredWarning, intercept
from surgery.ops.shrink import plans
from surgery.ops.shrink.plans import NORM_WIDTH

SCOPES = ("layer", "global")
MAX_ATTEMPTS = 8  # modules kept whole after failing a check forward, before giving up
IMPORTANCE: Registry[Callable[[Tensor], Tensor]] = Registry("shrink.importance")


def register_importance(name: str, fn: Callable[[Tensor], Tensor], *, replace: bool = False) -> Callable:
    """Add a channel importance for ``shrink(..., importance=name)``: ``fn`` maps a producing
    layer's weight matrix (output channels × everything else) to one score per output channel;
    the lowest-scoring coupled channels are removed.

    Example:
        >>> surgery.register_importance("linf", lambda w: w.abs().amax(dim=1))
    """
    return IMPORTANCE.register(name, fn, replace=replace)


register_importance("l2", lambda weight: weight.norm(dim=1))
register_importance("l1", lambda weight: weight.abs().sum(dim=1))
log = logging.getLogger("surgery")


class ShrinkError(SurgeryError, RuntimeError):
    """The shrunk model does not run or changed its output shapes (the model was restored)."""


class ShrinkHandle(Handle):
    """Handle returned by :func:`shrink`: the plan, parameter counts and MACs before and after."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__("shrink", model)
        self.replaced: dict[str, tuple[nn.Module, nn.Module]] = {}  # name -> (original, smaller)
        self.kept: dict[str, tuple[Tensor | None, Tensor | None]] = {}  # name -> (input, output) indices kept
        self.attributes: dict[str, dict[str, tuple[Any, Any]]] = {}  # module -> attribute -> (old, new)
        self.parameters: dict[str, dict[str, tuple[Tensor, Tensor]]] = {}  # module -> name -> (old, sliced)
        self.buffers: dict[str, dict[str, tuple[Tensor, Tensor]]] = {}  # norms resized in place
        self.families: list[dict[str, Any]] = []
        self.frozen_ops: list[str] = []
        self.renormalised: list[str] = []  # LayerNorm/RMSNorm layers that normalise over fewer channels
        self.counts: dict[str, dict[str, int]] = {}
        self.fingerprint = plans.fingerprint(model)  # of the original: made before anything is replaced

    def restore(self) -> None:
        """Put the original layers, parameters and head counts back (the same objects).

        Raises:
            AlreadyModifiedError: when surgery applied later still sits on a smaller layer
                (restore or bake it first: undo in reverse order).
        """
        if self.state == "attached":
            for name, (_, new) in self.replaced.items():
                hooked = any(guards.transforms_of(p) for p in new.parameters(recurse=False)) or forward_hook_functions(
                    new
                )
                if hooked:
                    raise AlreadyModifiedError(
                        f"shrink: {name} has surgery applied after the shrink (prune, quantize, "
                        "hooks); restore or bake that first (undo in reverse order)"
                    )
        super().restore()

    def plan(self) -> dict[str, dict[str, Any]]:
        """Every new layer's class and constructor arguments, and every changed attribute
        (attention head counts), JSON-serialisable, sealed under ``"$model"`` with the original
        model's fingerprint and a digest of the entries (:mod:`surgery.ops.shrink.plans`)."""
        plan = {name: describe(new) for name, (_, new) in self.replaced.items()}
        for name in {**self.attributes, **self.parameters, **self.buffers}:
            module = self.model.get_submodule(name)
            plan[name] = {"class": f"{type(module).__module__}.{type(module).__qualname__}"}
            if name in self.attributes:
                plan[name]["attributes"] = {
                    attr: list(new) if isinstance(new, tuple) else new
                    for attr, (_, new) in self.attributes[name].items()
                }
            for kind in ("parameters", "buffers"):
                if name in getattr(self, kind):
                    plan[name][kind] = {attr: list(new.shape) for attr, (_, new) in getattr(self, kind)[name].items()}
        return plans.seal(plan, self.fingerprint)

    def params(self) -> dict[str, int]:
        """Parameter counts ``{"before", "after"}``."""
        return self.counts.get("params", {})

    def macs(self) -> dict[str, int]:
        """Multiply-accumulates of one forward on the example inputs, ``{"before", "after"}``."""
        return self.counts.get("macs", {})


@dataclass(frozen=True)
class ShrinkSpec:
    """How to shrink, validated when built: ``ShrinkSpec(amount=1.5)`` raises at once. The
    fields are :func:`shrink`'s arguments but the example inputs (see there)."""

    amount: float = 0.5
    select: Any = None
    exclude: Any = None
    importance: Any = "l2"  # a registered name, or a function of a family's weights
    scope: str = "layer"
    round_to: int = 1
    renormalise: bool = True

    def __post_init__(self) -> None:
        amount, round_to = _validate(self.amount, self.scope, self.round_to, self.importance)
        if not isinstance(self.renormalise, bool):
            raise ConfigTypeError("shrink.renormalise", self.renormalise, "must be true or false")
        object.__setattr__(self, "amount", amount)
        object.__setattr__(self, "round_to", round_to)
        object.__setattr__(self, "exclude", self.exclude or None)


def shrink(
    model: nn.Module,
    amount: float | ShrinkSpec,
    *,
    example_inputs: Inputs,
    select: Selection = None,
    exclude: Selection = None,
    importance: str | Callable[[Tensor], Tensor] = "l2",
    scope: str = "layer",
    round_to: int = 1,
    renormalise: bool = True,
) -> ShrinkHandle:
    """Remove ``amount`` of the removable channels of every coupled family, for real.

    Args:
        model: modified in place: layers are replaced by smaller ones.
        amount: fraction in [0, 1] of each family's channels to remove (0 changes nothing).
        example_inputs: one batch (tensor, tuple or dict) the coupling is traced on.
        select, exclude: layers (or containers of layers) whose output channels may be removed
            (default all).
        importance: ``"l2"`` (norm of each channel's producing weights), ``"l1"``, a name
            added with :func:`register_importance`, or a function of the producing weight
            matrix (outputs × rest) giving one score per output.
        scope: ``"layer"`` (each family by ``amount``) or ``"global"`` (one ranking; every
            family still keeps at least ``round_to`` channels).
        round_to: keep channel counts multiples of this (e.g. 8 for fast kernels); heads and
            groups go whole whatever it is.
        renormalise: let LayerNorm/RMSNorm layers lose channels. Their statistics are then
            taken over fewer channels, so the result is not exactly "the removed channels
            zeroed" (the layers are listed in ``handle.renormalised``, with a warning);
            ``False`` keeps every channel they normalise.

    Example:
        >>> handle = surgery.shrink(model, 0.5, example_inputs=torch.randn(1, 3, 224, 224))
        >>> handle.params()
        {'before': 25557032, 'after': 6563560}
    """
    model = compiled.prepare(model)
    spec = (
        amount
        if isinstance(amount, ShrinkSpec)
        else ShrinkSpec(amount, select, exclude, importance, scope, round_to, renormalise)
    )
    amount, select, exclude, importance, scope, round_to, renormalise = (
        spec.amount,
        spec.select,
        spec.exclude,
        spec.importance,
        spec.scope,
        spec.round_to,
        spec.renormalise,
    )
    example = next(iter(batches(example_inputs, "shrink.example_inputs")), None)
    if example is None:
        raise ConfigError("shrink.example_inputs", "no batch", "must hold one batch to trace the model on")
    for name, param in model.named_parameters():
        if guards.transforms_of(param):
            raise ConfigError("shrink", name, "has surgery attached (prune, quantize...); restore or bake it first")
    allowed = _allowed(model, select, exclude)
    trace = trace_channels(model, example)
    if not trace.output_shapes:
        raise ShrinkError(
            "shrink: the model's output holds no tensor shrink can find (tensors, tuples, lists, "
            "dicts, dataclasses and ModelOutputs are searched), so its shape cannot be kept"
        )
    if not renormalise:
        trace.keep_normalised()
    expected = trace.output_shapes
    before = _counts(model, trace)
    for _ in range(MAX_ATTEMPTS):
        removed = _choose(trace, amount, scope, round_to, importance, allowed)
        handle = _apply(model, trace, removed)
        try:
            culprit = _check_runs(model, example, expected, trace, handle)
        except BaseException:  # an interrupt too: nothing is left half-shrunk
            handle.restore()
            raise
        if culprit is None:
            break
        trace.keep_whole(culprit)  # and try again without touching it
    else:
        raise ShrinkError(
            f"shrink: the shrunk model still fails after keeping {MAX_ATTEMPTS} modules whole; the model is restored"
        )
    handle.frozen_ops = list(trace.unknown)
    handle.families = _families_report(trace, removed)
    handle.renormalised = [
        name
        for name, (old, new) in handle.replaced.items()
        if isinstance(old, RENORMALISING) and handle.kept[name][1] is not None
    ]
    if handle.renormalised:
        log.warning(
            "shrink: %d LayerNorm/RMSNorm layers now normalise over fewer channels, so their statistics "
            "change (handle.renormalised; renormalise=False keeps their channels)",
            len(handle.renormalised),
        )
    if amount > 0 and not removed:
        log.warning("shrink: nothing removed: %s", _why_nothing(trace, handle, amount, round_to, allowed))
    handle.counts = {key: {"before": before[key], "after": value} for key, value in _counts(model, trace).items()}
    return handle


def _allowed(model: nn.Module, select: Selection, exclude: Selection) -> set[str] | None:
    """The layers whose channels may go: selected names and everything inside them."""
    if select is None and exclude is None:
        return None
    chosen = set(select_modules(model, select, exclude=exclude, field="shrink.select", exclude_field="shrink.exclude"))
    if select is not None and not chosen:
        raise ConfigError("shrink.select", select, "matches no module")
    excluded = set(select_modules(model, exclude, field="shrink.exclude")) if exclude is not None else set()
    names = [name for name, _ in model.named_modules()]
    inside = lambda name, group: any(name == g or name.startswith(f"{g}.") or not g for g in group)
    return {name for name in names if (select is None or inside(name, chosen)) and not inside(name, excluded)}


def _why_nothing(
    trace: ChannelTrace, handle: ShrinkHandle, amount: float, round_to: int, allowed: set[str] | None
) -> str:
    if not any(f["channels"] > f["frozen"] for f in handle.families):
        causes = ", ".join(trace.unknown)
        return f"every channel is frozen ({'by ' + causes + ', ' if causes else ''}or by reaching the outputs)"
    if allowed is not None:
        return (
            "no family whose producing layers are all selected (shrink.select / shrink.exclude) has removable channels"
        )
    return f"amount {amount:g} rounds to zero channels in every family (round_to={round_to})"


def _apply(model: nn.Module, trace: ChannelTrace, removed: set[int]) -> ShrinkHandle:
    """Replace every layer that loses channels, set the head counts; undone on any error."""
    handle = ShrinkHandle(model)
    with handle.applying():
        for name, layer in trace.layers.items():
            keep_in = _kept(layer.inputs, removed, trace)
            keep_out = _kept(layer.outputs, removed, trace) if not layer.passthrough else keep_in
            if keep_in is None and keep_out is None:
                continue
            if not rebuildable(type(layer.module)):  # a norm with its own constructor (timm's BatchNormAct2d)
                _resize_norm(handle, name, layer.module, keep_out)
                continue
            smaller = _smaller(layer, keep_in, keep_out)
            if smaller is None:
                continue
            _like(smaller, layer.module)
            original = layer.module
            paths = _paths_of(model, original)  # a module registered under several names is replaced at each
            for path in paths:
                _swap(model, path, smaller)
            handle.replaced[name] = (original, smaller)
            handle.kept[name] = (keep_in, keep_out)
            handle.add(f"put back {name}", lambda ps=paths, o=original: [_swap(model, p, o) for p in ps])
        for name, unit in trace.attention.items():
            _update_heads(handle, name, unit, removed, trace)
        for (owner, attr), channels in trace.parameters.items():
            _slice_parameter(handle, owner, attr, _kept(channels.slots, removed, trace), channels.dim)
    return handle


def _resize_norm(handle: ShrinkHandle, name: str, module: nn.Module, keep: Tensor | None) -> None:
    """Keep a norm layer's channels ``keep`` in place: its per-channel parameters and buffers are
    sliced and its width attributes updated (the same object stays; restore puts the old back)."""
    if keep is None:
        return
    width = next(
        len(getattr(module, attr)) if attr == "normalized_shape" else getattr(module, attr)
        for attr in NORM_WIDTH
        if hasattr(module, attr)
    )
    changes = {
        attr: (getattr(module, attr), (len(keep),) if kind is tuple else len(keep))
        for attr, kind in NORM_WIDTH.items()
        if hasattr(module, attr)
    }
    if isinstance(module, nn.GroupNorm):
        changes["num_groups"] = (module.num_groups, len(keep) // (width // module.num_groups))
    for attr, (_, new) in changes.items():
        setattr(module, attr, new)
    handle.attributes[name] = changes
    handle.add(f"put back the width of {name}", lambda: [setattr(module, a, old) for a, (old, _) in changes.items()])
    for kind in ("parameters", "buffers"):
        own = getattr(module, f"named_{kind}")(recurse=False, remove_duplicate=False)
        for attr, tensor in list(own):
            if tensor is None or tensor.dim() == 0 or tensor.shape[0] != width:
                continue
            with torch.no_grad():
                sliced = tensor.detach().index_select(0, keep.to(tensor.device)).clone()
            value = nn.Parameter(sliced, requires_grad=tensor.requires_grad) if kind == "parameters" else sliced
            set_slot(module, attr, value, kind)
            getattr(handle, kind).setdefault(name, {})[attr] = (tensor, value)
            handle.add(f"put back {name}.{attr}", lambda a=attr, t=tensor, k=kind: set_slot(module, a, t, k))


def _slice_parameter(handle: ShrinkHandle, owner: str, attr: str, keep: Tensor | None, dim: int) -> None:
    """Keep the entries of a per-channel parameter (a layer scale, a position embedding) whose
    channels stay; the original Parameter object goes back on restore."""
    if keep is None:
        return
    module = handle.model.get_submodule(owner)
    original = get_slot(module, attr)
    with torch.no_grad():
        smaller = nn.Parameter(
            original.detach().index_select(dim, keep.to(original.device)).clone(), requires_grad=original.requires_grad
        )
    set_slot(module, attr, smaller)
    handle.parameters.setdefault(owner, {})[attr] = (original, smaller)
    handle.add(f"put back {owner}.{attr}", lambda: set_slot(module, attr, original))


def _like(new: nn.Module, old: nn.Module) -> None:
    """Give a new layer what the old one had beyond its values: training mode, dtype, and
    which parameters were frozen."""
    new.train(old.training)  # a new module starts in training mode
    dtype = next(
        (t.dtype for t in [*old.parameters(recurse=False), *old.buffers(recurse=False)] if t.is_floating_point()), None
    )
    if dtype is not None:
        new.to(dtype=dtype)
    frozen = {name for name, p in old.named_parameters(recurse=False) if not p.requires_grad}
    for name, param in new.named_parameters(recurse=False):
        param.requires_grad_(name not in frozen)


def _update_heads(
    handle: ShrinkHandle, name: str, unit: AttentionHeads, removed: set[int], trace: ChannelTrace
) -> None:
    """Set an attention module's head-count attributes to the heads its projections kept."""
    layout, module = unit.layout, unit.module
    query = trace.layers[f"{name}.{layout.projections[0]}"].outputs or []
    units = {trace.slots.find(s) for s in query}
    kept = len(units - removed)
    if kept == unit.units:
        return
    head_dim = getattr(module, layout.head_dim)
    counts = {p: kept * (c // unit.units) for p, c in unit.counts.items()}
    changes = {attr: (getattr(module, attr), counts[p]) for attr, p in layout.heads.items()}
    changes.update({attr: (getattr(module, attr), counts[p] * head_dim) for attr, p in layout.derived.items()})
    if not changes:
        return
    for attr, (_, new) in changes.items():
        setattr(module, attr, new)
    handle.attributes[name] = changes
    handle.add(
        f"put back the head counts of {name}",
        lambda: [setattr(module, attr, old) for attr, (old, _) in changes.items()],
    )


def _check_runs(
    model: nn.Module, example: Any, expected: list[tuple[int, ...]], trace: ChannelTrace, handle: ShrinkHandle
) -> str | None:
    """Run the shrunk model once. ``None`` when it runs and gives outputs of the original shapes;
    when a module fails (code that reshapes by a channel count the trace cannot see, like an
    attention whose inner width is read from its input), the handle is undone and the name of
    the innermost failing module that can be kept whole is returned. Raises when none can."""
    running: list[str] = []
    names = {id(module): name for name, module in model.named_modules()}

    def entered(module: nn.Module, args: tuple) -> None:
        running.append(names.get(id(module), "?"))

    def left(module: nn.Module, args: tuple, output: Any) -> None:
        running.pop()

    hooks = [
        torch.nn.modules.module.register_module_forward_pre_hook(entered),
        torch.nn.modules.module.register_module_forward_hook(left),
    ]
    try:
        with evaluating(model), torch.no_grad():
            shapes = output_shapes(example(model))
    except Exception as err:
        handle.restore()
        failing = [name for name in reversed(running) if trace.can_keep_whole(name)]
        if not failing:
            raise ShrinkError(
                f"shrink: the shrunk model fails on the example inputs ({type(err).__name__}: "
                f"{str(err).splitlines()[0] if str(err) else ''}) and no module can be kept whole to "
                "avoid it: exclude its layers (shrink.exclude) or register its head layout "
                "(surgery.register_heads); the model is restored"
            ) from err
        log.info(
            "shrink: %s fails when its channels shrink (%s: %s); keeping it whole",
            failing[0],
            type(err).__name__,
            str(err).splitlines()[0] if str(err) else "",
        )
        return failing[0]
    finally:
        for hook in hooks:
            hook.remove()
    if shapes != expected:
        handle.restore()
        raise ShrinkError(
            f"shrink: the shrunk model's output shapes {shapes} differ from the original {expected}; "
            "the model is restored"
        )
    return None


def _validate(amount: object, scope: str, round_to: object, importance: object) -> tuple[float, int]:
    if isinstance(amount, bool) or not isinstance(amount, (int, float)) or not 0.0 <= amount <= 1.0:
        raise ConfigError("shrink.amount", amount, "must be a number in [0, 1]")
    if scope not in SCOPES:
        raise ConfigError("shrink.scope", scope, f"must be one of {', '.join(SCOPES)}")
    if isinstance(round_to, bool) or not isinstance(round_to, int) or round_to < 1:
        raise ConfigError("shrink.round_to", round_to, "must be an integer >= 1")
    if not callable(importance):
        IMPORTANCE.get(importance)  # a one-line error naming the registered ones
    return float(amount), round_to


def _producer_weight(module: nn.Module) -> Tensor:
    """The weights producing each output channel, one row per channel."""
    weight = module.weight.detach().float()
    return weight.t() if isinstance(module, nn.Embedding) else weight.reshape(weight.shape[0], -1)


def _choose(
    trace: ChannelTrace, amount: float, scope: str, round_to: int, importance: Any, allowed: set[str] | None
) -> set[int]:
    """The slot classes (channels, or whole heads/groups: *units*) to remove."""
    slots = trace.slots
    score = importance if callable(importance) else IMPORTANCE.get(importance)
    scores: dict[int, float] = defaultdict(float)
    producers: dict[int, set[str]] = defaultdict(set)
    width: dict[int, int] = {}  # channels per unit, in the first layer producing it
    for name, layer in trace.layers.items():
        if layer.outputs is None or layer.passthrough or layer.outputs is layer.inputs:
            continue
        weight = _producer_weight(layer.module)
        per_row = _scores(score, weight, name)
        seen: dict[int, int] = defaultdict(int)
        for row, slot in enumerate(layer.outputs):
            root = slots.find(slot)
            scores[root] += float(per_row[row])
            producers[root].add(name)
            seen[root] += 1
        for root, count in seen.items():
            width.setdefault(root, count)
    families: dict[frozenset, list[int]] = defaultdict(list)
    for root, names in producers.items():
        if root in slots.frozen or (allowed is not None and not names <= allowed):
            continue
        families[frozenset(names)].append(root)
    quota = {
        key: _removable(len(roots), amount, 1 if any(width[r] > 1 for r in roots) else round_to)
        for key, roots in families.items()
    }
    if scope == "layer":
        return {r for key, roots in families.items() for r in sorted(roots, key=scores.__getitem__)[: quota[key]]}
    ranked = sorted(((scores[r], r, key) for key, roots in families.items() for r in roots), key=lambda t: t[0])
    total = sum(quota.values())
    limit = {
        key: _removable(len(roots), 1.0, 1 if any(width[r] > 1 for r in roots) else round_to)
        for key, roots in families.items()
    }  # the most a family may lose
    removed: set[int] = set()
    taken: dict[frozenset, int] = defaultdict(int)
    for _, root, key in ranked:
        if len(removed) >= total:
            break
        if taken[key] < limit[key]:
            removed.add(root)
            taken[key] += 1
    for key, roots in families.items():  # whole multiples of round_to in every family
        extra = taken[key] - _removable(
            len(roots), taken[key] / len(roots), 1 if any(width[r] > 1 for r in roots) else round_to
        )
        if extra > 0:
            mine = sorted((r for r in roots if r in removed), key=scores.__getitem__, reverse=True)
            removed.difference_update(mine[:extra])
    return removed


def _removable(count: int, amount: float, round_to: int) -> int:
    """How many of ``count`` units go at ``amount``: the kept count is rounded up to a multiple
    of ``round_to`` (a family smaller than ``round_to`` stays whole) and at least one is kept."""
    keep = count - math.floor(amount * count + 1e-9)
    keep = min(count, max(round_to, math.ceil(keep / round_to) * round_to)) if count >= round_to else count
    return max(count - max(keep, 1), 0)


def _scores(score: Callable, weight: Tensor, name: str) -> Tensor:
    """One finite importance per output channel of layer ``name``, or a one-line error."""
    label = getattr(score, "__name__", repr(score))
    try:
        per_row = torch.as_tensor(score(weight)).detach().float().reshape(-1)
    except Exception as err:  # the user's function failed or returned something unusable
        raise ConfigError("shrink.importance", label, f"failed on {name}: {type(err).__name__}: {err}") from None
    if per_row.numel() != weight.shape[0]:
        raise ConfigError(
            "shrink.importance",
            label,
            f"must give one finite score per output channel of {name} "
            f"({weight.shape[0]}); got {per_row.numel()} values",
        )
    if not torch.isfinite(per_row).all():
        raise ConfigError(
            "shrink.importance",
            label,
            f"must give one finite score per output channel of {name} ({weight.shape[0]}); got NaN/inf",
        )
    return per_row


def _kept(slots_of: list[int] | None, removed: set[int], trace: ChannelTrace) -> Tensor | None:
    if slots_of is None:
        return None
    keep = [i for i, slot in enumerate(slots_of) if trace.slots.find(slot) not in removed]
    return None if len(keep) == len(slots_of) else torch.tensor(keep, dtype=torch.long)


def _smaller(layer: LayerChannels, keep_in: Tensor | None, keep_out: Tensor | None) -> nn.Module | None:
    """A new layer of the same class holding the kept slices (None: nothing changes)."""
    module = layer.module
    factory = {"device": next(module.parameters(), torch.empty(0)).device}
    for kinds, build, needs_outputs in _SMALLER:
        if isinstance(module, kinds) and (keep_out is not None or not needs_outputs):
            with torch.no_grad():
                return build(module, keep_in, keep_out, factory)
    return None


def _sliced_weight(module: nn.Module, keep_in: Tensor | None, keep_out: Tensor | None, inputs: bool) -> Tensor:
    weight = module.weight.detach()
    weight = weight if keep_out is None else weight[keep_out]
    return weight if keep_in is None or not inputs else weight[:, keep_in]


def _copy_bias(module: nn.Module, new: nn.Module, keep_out: Tensor | None) -> nn.Module:
    if module.bias is not None:
        new.bias.copy_(module.bias if keep_out is None else module.bias[keep_out])
    return new


def _smaller_linear(module: nn.Linear, keep_in: Tensor | None, keep_out: Tensor | None, factory: dict) -> nn.Module:
    weight = _sliced_weight(module, keep_in, keep_out, inputs=True)
    new = type(module)(weight.shape[1], weight.shape[0], bias=module.bias is not None, dtype=weight.dtype, **factory)
    new.weight.copy_(weight)
    return _copy_bias(module, new, keep_out)


def _smaller_conv(module: nn.Module, keep_in: Tensor | None, keep_out: Tensor | None, factory: dict) -> nn.Module:
    weight = _sliced_weight(module, keep_in, keep_out, inputs=module.groups == 1)
    groups = 1 if module.groups == 1 else weight.shape[0] // (module.out_channels // module.groups)
    new = type(module)(
        weight.shape[1] * groups,
        weight.shape[0],
        module.kernel_size,
        stride=module.stride,
        padding=module.padding,
        dilation=module.dilation,
        groups=groups,
        bias=module.bias is not None,
        padding_mode=module.padding_mode,
        dtype=weight.dtype,
        **factory,
    )
    new.weight.copy_(weight)
    return _copy_bias(module, new, keep_out)


def _smaller_batchnorm(module: nn.Module, keep_in: Tensor | None, keep_out: Tensor, factory: dict) -> nn.Module:
    new = type(module)(
        len(keep_out),
        eps=module.eps,
        momentum=module.momentum,
        affine=module.affine,
        track_running_stats=module.track_running_stats,
        **factory,
    )
    for attr in ("weight", "bias", "running_mean", "running_var"):
        value = getattr(module, attr)
        if value is not None:
            getattr(new, attr).copy_(value[keep_out])
    if module.num_batches_tracked is not None:
        new.num_batches_tracked.copy_(module.num_batches_tracked)
    return new


def _smaller_embedding(module: nn.Embedding, keep_in: Tensor | None, keep_out: Tensor, factory: dict) -> nn.Module:
    new = type(module)(
        module.num_embeddings,
        len(keep_out),
        padding_idx=module.padding_idx,
        max_norm=module.max_norm,
        norm_type=module.norm_type,
        scale_grad_by_freq=module.scale_grad_by_freq,
        sparse=module.sparse,
        dtype=module.weight.dtype,
        **factory,
    )
    new.weight.copy_(module.weight[:, keep_out])
    return new


def _smaller_groupnorm(module: nn.GroupNorm, keep_in: Tensor | None, keep_out: Tensor, factory: dict) -> nn.Module:
    new = type(module)(
        len(keep_out) // (module.num_channels // module.num_groups),
        len(keep_out),
        eps=module.eps,
        affine=module.affine,
        **factory,
    )
    if module.affine:
        new.weight.copy_(module.weight[keep_out])
        new.bias.copy_(module.bias[keep_out])
    return new


def _smaller_layernorm(module: nn.LayerNorm, keep_in: Tensor | None, keep_out: Tensor, factory: dict) -> nn.Module:
    new = type(module)(
        len(keep_out),
        eps=module.eps,
        elementwise_affine=module.elementwise_affine,
        bias=module.bias is not None,
        **factory,
    )
    if module.weight is not None:
        new.weight.copy_(module.weight[keep_out])
    return _copy_bias(module, new, keep_out)


# (layer types, builder of the smaller layer, whether it applies only when output channels go)
_SMALLER = (
    (nn.Linear, _smaller_linear, False),
    (CONVOLUTIONS, _smaller_conv, False),
    (BATCH_NORMS, _smaller_batchnorm, True),
    (nn.Embedding, _smaller_embedding, True),
    (nn.GroupNorm, _smaller_groupnorm, True),
    (nn.LayerNorm, _smaller_layernorm, True),
)


def _paths_of(model: nn.Module, module: nn.Module) -> list[str]:
    return [name for name, found in model.named_modules(remove_duplicate=False) if found is module]


def _swap(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)


def describe(module: nn.Module) -> dict[str, Any]:
    """A layer's class and the constructor arguments that rebuild it at its shape."""
    if isinstance(module, nn.Linear):
        args = {"in_features": module.in_features, "out_features": module.out_features, "bias": module.bias is not None}
    elif isinstance(module, CONVOLUTIONS):
        args = {
            "in_channels": module.in_channels,
            "out_channels": module.out_channels,
            "kernel_size": list(module.kernel_size),
            "stride": list(module.stride),
            "padding": module.padding if isinstance(module.padding, str) else list(module.padding),
            "dilation": list(module.dilation),
            "groups": module.groups,
            "bias": module.bias is not None,
            "padding_mode": module.padding_mode,
        }
    elif isinstance(module, nn.Embedding):
        args = {
            "num_embeddings": module.num_embeddings,
            "embedding_dim": module.embedding_dim,
            "padding_idx": module.padding_idx,
            "max_norm": module.max_norm,
            "norm_type": module.norm_type,
            "scale_grad_by_freq": module.scale_grad_by_freq,
            "sparse": module.sparse,
        }
    elif isinstance(module, nn.GroupNorm):
        args = {
            "num_groups": module.num_groups,
            "num_channels": module.num_channels,
            "eps": module.eps,
            "affine": module.affine,
        }
    elif isinstance(module, BATCH_NORMS):
        args = {
            "num_features": module.num_features,
            "eps": module.eps,
            "momentum": module.momentum,
            "affine": module.affine,
            "track_running_stats": module.track_running_stats,
        }
    else:
        args = {
            "normalized_shape": list(module.normalized_shape),
            "eps": module.eps,
            "elementwise_affine": module.elementwise_affine,
            "bias": module.bias is not None,
        }
    return {"class": f"{type(module).__module__}.{type(module).__qualname__}", "args": args}


def _families_report(trace: ChannelTrace, removed: set[int]) -> list[dict[str, Any]]:
    found: dict[frozenset, dict[str, int]] = {}
    slots = trace.slots
    for name, layer in trace.layers.items():
        if layer.outputs is None or layer.passthrough:
            continue
        roots = {slots.find(s) for s in layer.outputs}
        key = frozenset(roots)
        entry = found.setdefault(
            key,
            {
                "layers": [],
                "channels": len(roots),
                "removed": len(roots & removed),
                "frozen": len(roots & slots.frozen),
            },
        )
        entry["layers"].append(name)
    return list(found.values())


def _counts(model: nn.Module, trace: ChannelTrace) -> dict[str, int]:
    """Parameters, and the multiply-accumulates of the traced forward computed from each
    Conv/Linear layer's current shape (no extra forward)."""
    named = dict(model.named_modules())
    macs = 0
    for name, layer in trace.layers.items():
        module = named.get(name)
        if isinstance(module, nn.Linear):
            macs += layer.positions * module.out_features * module.in_features
        elif isinstance(module, CONVOLUTIONS):
            macs += (
                layer.positions
                * module.out_channels
                * (module.in_channels // module.groups)
                * math.prod(module.kernel_size)
            )
    return {"params": sum(p.numel() for p in model.parameters()), "macs": macs}


def _layer_class(path: str) -> type:
    """The class a plan names: a layer shrink makes (a subclass keeping its base's constructor,
    such as torchvision's ``LayerNorm2d``, included)."""
    module_name, _, name = path.rpartition(".") if isinstance(path, str) else ("", "", "")
    known = module_name == "torch" or module_name.startswith(("torch.", "torchvision.", "timm.", "transformers."))
    try:  # a module outside the libraries shrink knows is imported only if it is already loaded
        module = importlib.import_module(module_name) if known else sys.modules.get(module_name)
        cls = getattr(module, name, None)
    except ImportError:
        cls = None
    if not isinstance(cls, type) or not rebuildable(cls):
        raise ConfigError(
            "rebuild.plan",
            path,
            "is not a layer shrink makes (Linear, Conv1d/2d, Embedding, "
            "BatchNorm, LayerNorm, GroupNorm, RMSNorm, or a subclass keeping their constructor)",
        )
    return cls


def rebuild(
    factory: Callable[[], nn.Module],
    plan: dict[str, dict[str, Any]],
    *,
    device: str | torch.device = "cpu",
    meta: bool = True,
) -> nn.Module:
    """The original class at the shrunk shapes, ready for ``load_state_dict(strict=True)`` of
    the baked state dict.

    ``factory()`` runs inside :func:`surgery.intercept`: each layer the plan names is swapped
    for a layer of the planned shape as the constructor attaches it, and planned attributes
    (attention head counts) are set then, so the constructor's own code after that point sees
    the smaller model. Layers are recognised by the order they are attached in, learnt from a
    first build with parameters on ``meta``. With ``meta=True`` (default) the real build also
    puts every parameter on ``meta`` as it is registered (no full-size weight is kept;
    buffers stay real) and the model is materialised on ``device`` uninitialised: load the baked
    weights next.

    Example:
        >>> model = surgery.rebuild(torchvision.models.resnet50, handle.plan())
        >>> model.load_state_dict(baked.state_dict(), strict=True)
    """
    if not callable(factory):
        raise ConfigTypeError("rebuild.factory", type(factory).__name__, "must be a callable returning the model")
    plan, expected = plans.read_entries(_read_plan(plan))
    for entry in plan.values():
        if "args" in entry:
            _layer_class(entry["class"])
    order, model = _attach_order(factory)
    plans.check_model(model, expected, factory)
    named = dict(model.named_modules())
    for name, entry in plan.items():
        if name not in named:
            raise ConfigError("rebuild.plan", name, "is not a module of the model the factory builds")
        if not _is_planned_class(named[name], entry):
            raise ConfigError(
                "rebuild.plan",
                name,
                f"is a {type(named[name]).__name__} in this model; the plan has a {entry['class'].rpartition('.')[2]}",
            )
        plans.check_attributes(name, named[name], entry.get("attributes", {}))
        if id(named[name]) not in order and "args" in entry:
            raise ConfigError(
                "rebuild.plan", name, "is not attached by the constructor; only submodules can be replaced"
            )
    wanted = {order[id(named[name])]: (name, entry) for name, entry in plan.items() if id(named[name]) in order}
    counter = _AttachCounter()
    made: dict[str, nn.Module] = {}

    def planned(parent: nn.Module, local: str, child: nn.Module) -> bool:
        return counter.next(child) in wanted

    def build(child: nn.Module) -> nn.Module:
        name, entry = wanted[counter.last]
        if not _is_planned_class(child, entry):
            raise ShrinkError(
                f"rebuild: {name} does not have its planned shape: the second build attached a "
                f"{type(child).__name__} where the first had a {entry['class'].rpartition('.')[2]}; "
                "the factory does not build the same model twice"
            )
        made[name] = _planned(child, entry, meta)
        return made[name]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuleNeverFiredWarning)
        with intercept(*([rules.swap(planned, build)] if wanted else []), *_meta_parameters(meta)):
            model = factory()
    for name, entry in plan.items():  # the model itself is never attached: changed once it is built
        if name not in made and name in dict(model.named_modules()):
            made[name] = _planned(model.get_submodule(name), entry, meta)
    _check_rebuilt(model, plan, made)
    return _materialise(model, device) if meta else model.to(device)


def _read_plan(plan: Any) -> dict[str, Any]:
    """A plan dict, its JSON text, or the path of a ``model.plan.json``."""
    if isinstance(plan, (str, os.PathLike)):
        text = str(plan)
        if not text.lstrip().startswith("{"):
            try:
                text = Path(text).read_text()
            except OSError as err:
                raise ConfigError(
                    "rebuild.plan", str(plan)[:80], f"is neither plan JSON nor a readable file ({type(err).__name__})"
                ) from None
        try:
            plan = json.loads(text)
        except json.JSONDecodeError as err:
            raise ConfigError("rebuild.plan", str(plan)[:80], f"is not valid JSON ({err})") from None
        except RecursionError:
            raise ConfigError("rebuild.plan", str(plan)[:80], "is nested too deeply to be a plan") from None
    if not isinstance(plan, dict):
        raise ConfigTypeError(
            "rebuild.plan",
            type(plan).__name__,
            "must be the dict ShrinkHandle.plan() returns, its JSON, or a model.plan.json path",
        )
    return plan


def _plain(value: Any) -> Any:
    """``value`` as JSON holds it (tuples as lists)."""
    return list(value) if isinstance(value, tuple) else value


def _is_planned_class(module: nn.Module, entry: dict[str, Any]) -> bool:
    if "args" in entry:
        return isinstance(module, _layer_class(entry["class"]))
    return f"{type(module).__module__}.{type(module).__qualname__}" == entry["class"]


def _planned(module: nn.Module, entry: dict[str, Any], meta: bool) -> nn.Module:
    """``module`` as the plan entry has it: a new layer of the planned shape, or the same module
    with planned attributes and per-channel parameters (uninitialised) set."""
    if "args" in entry:
        args = {k: tuple(v) if isinstance(v, list) and k != "normalized_shape" else v for k, v in entry["args"].items()}
        try:
            new = _layer_class(entry["class"])(**args)
        except (TypeError, ValueError, RuntimeError) as err:
            raise ConfigError(
                "rebuild.plan",
                entry["class"].rpartition(".")[2],
                f"cannot be built with {args}: {type(err).__name__}: {err}",
            ) from None
        new.train(module.training)
        return new
    for attr, value in entry.get("attributes", {}).items():
        setattr(module, attr, tuple(value) if isinstance(getattr(module, attr, None), tuple) else value)
    for attr, shape in entry.get("parameters", {}).items():
        old = get_slot(module, attr)
        device = "meta" if meta else old.device
        set_slot(module, attr, nn.Parameter(torch.empty(shape, dtype=old.dtype, device=device), old.requires_grad))
    for attr, shape in entry.get("buffers", {}).items():  # real storage: a buffer is not moved to meta
        old = get_slot(module, attr, "buffers")
        set_slot(module, attr, torch.empty(shape, dtype=old.dtype, device=old.device), "buffers")
    return module


def _meta_parameters(meta: bool) -> list[rules.Rule]:
    """Parameters go to ``meta`` as they are registered (no weight is filled or kept); buffers
    stay real, so values the constructor computes (position ids, masks) survive."""
    if not meta:
        return []
    return [rules.on_parameter("*", lambda p: nn.Parameter(p.detach().to("meta"), requires_grad=p.requires_grad))]


def _materialise(model: nn.Module, device: str | torch.device) -> nn.Module:
    """Uninitialised storage on ``device`` for every ``meta`` parameter (tied ones stay tied)."""
    made: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False, remove_duplicate=False)):
            if param is not None and param.is_meta:
                if id(param) not in made:
                    made[id(param)] = nn.Parameter(
                        torch.empty_like(param, device=device), requires_grad=param.requires_grad
                    )
                set_slot(module, name, made[id(param)])
    return model.to(device)


class _AttachCounter:
    """Numbers the modules a build attaches, in order, each object once."""

    def __init__(self) -> None:
        self.seen: dict[int, nn.Module] = {}  # holds every module: a freed one's id could be reused
        self.count = -1
        self.last = -1

    def next(self, child: nn.Module) -> int:
        if id(child) in self.seen:
            return -1
        self.seen[id(child)] = child
        self.count += 1
        self.last = self.count
        return self.count


def _attach_order(factory: Callable[[], nn.Module]) -> tuple[dict[int, int], nn.Module]:
    """A build on ``meta``: the attach number of every module, keyed by ``id``."""
    counter = _AttachCounter()
    numbers: dict[int, int] = {}

    def record(parent: nn.Module, local: str, child: nn.Module) -> bool:
        number = counter.next(child)
        if number >= 0:
            numbers[id(child)] = number
        return False

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuleNeverFiredWarning)
        with intercept(rules.swap(record, lambda old: old), *_meta_parameters(True)):
            model = factory()
    if not isinstance(model, nn.Module):
        raise ConfigTypeError("rebuild.factory", type(model).__name__, "must return an nn.Module")
    alive = {id(module) for module in model.modules()}  # ids of modules the build dropped may be reused
    return {key: number for key, number in numbers.items() if key in alive}, model


def _check_rebuilt(model: nn.Module, plan: dict[str, dict[str, Any]], made: dict[str, nn.Module]) -> None:
    """Every planned layer is where the plan puts it, with its planned shape: a factory that
    builds in another order fails here."""
    named = dict(model.named_modules())
    for name, entry in plan.items():
        module = named.get(name)
        same = (
            module is not None
            and made.get(name) is module
            and (
                describe(module)["args"] == entry["args"]
                if "args" in entry
                else (
                    all(
                        _plain(getattr(module, attr, None)) == value
                        for attr, value in entry.get("attributes", {}).items()
                    )
                    and all(
                        list(get_slot(module, attr, kind).shape) == shape
                        for kind in ("parameters", "buffers")
                        for attr, shape in entry.get(kind, {}).items()
                    )
                )
            )
        )
        if not same:
            raise ShrinkError(
                f"rebuild: {name} does not have its planned shape after the build; the factory does "
                "not build the same model twice (random architecture?)"
            )
