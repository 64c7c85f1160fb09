"""``surgery.shrink``: remove coupled channels for real (smaller layers), restorably.

The coupling comes from :func:`surgery.ops.shrink.channels.trace_channels`. Channels are ranked by
importance (the L2 norm of the weights that produce them, summed over every layer producing
the same coupled channel), and in each *family* (the channels produced by the same set of
layers: one layer's outputs, or a residual stream's) the ``amount`` least important are
removed, rounded to ``round_to``. Each affected layer is replaced by a new, smaller layer of
the same class holding the kept slices; the handle keeps the original modules, so
``restore()`` puts back the very same objects.
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from surgery.core import guards
from surgery.core.errors import ConfigError, ConfigTypeError
from surgery.core.inputs import batches, evaluating
from surgery.core.layer_kinds import is_kind
from surgery.core.registry import Registry
from surgery.core.selection import Selection
from surgery.core.selection import select as select_modules
from surgery.core.verbs import VerbCall, verb
from surgery.ops.shrink.channels import (
    ChannelTrace,
    output_shapes,
    trace_channels,
)
from surgery.ops.shrink.experts import equalised
from surgery.ops.shrink.fused import shrink_experts
from surgery.ops.shrink.rebuilding import rebuild  # noqa: F401 - surgery.ops.shrink.shrinking.rebuild, its old home
from surgery.ops.shrink.replacing import ShrinkHandle, replace_layers
from surgery.ops.shrink.structure import ShrinkError

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


@verb(
    "shrink",
    ShrinkSpec,
    positional="amount",
    calibration="required",
    renamed={"example_inputs": "calibration"},
)
def shrink(model: nn.Module, spec: ShrinkSpec, call: VerbCall) -> ShrinkHandle:
    """Remove ``amount`` of the removable channels of every coupled family, for real.

    Args:
        model: modified in place: layers are replaced by smaller ones.
        amount: fraction in [0, 1] of each family's channels to remove (0 changes nothing).
        spec: a :class:`ShrinkSpec` holding the settings below (the keywords are a shorthand for it).
        calibration: one batch (tensor, tuple or dict) the coupling is traced on (the first
            batch, when given several); before 0.3 ``example_inputs=``.
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
        >>> handle = surgery.shrink(model, 0.5, calibration=torch.randn(1, 3, 224, 224))
        >>> handle.params()
        {'before': 25557032, 'after': 6563560}
    """
    example = next(iter(batches(call.calibration, "shrink.calibration")), None)
    if example is None:
        raise ConfigError("shrink.calibration", "no batch", "must hold one batch to trace the model on")
    for name, param in model.named_parameters():
        if guards.transforms_of(param):
            raise ConfigError("shrink", name, "has surgery attached (prune, quantize...); restore or bake it first")
    return shrink_experts(model, lambda: _shrink(model, spec, example))


def _shrink(model: nn.Module, spec: ShrinkSpec, example: Any) -> ShrinkHandle:
    """:func:`shrink` on a model whose experts (if any) are per-expert layers."""
    amount, importance, scope, round_to = spec.amount, spec.importance, spec.scope, spec.round_to
    allowed = _allowed(model, spec.select, spec.exclude)
    trace = trace_channels(model, example)
    if not trace.output_shapes:
        raise ShrinkError(
            "shrink: the model's output holds no tensor shrink can find (tensors, tuples, lists, "
            "dicts, dataclasses and ModelOutputs are searched), so its shape cannot be kept"
        )
    if not spec.renormalise:
        trace.keep_normalised()
    expected = trace.output_shapes
    before = _counts(model, trace)
    for _ in range(MAX_ATTEMPTS):
        removed = _choose(trace, amount, scope, round_to, importance, allowed)
        handle = replace_layers(model, trace, removed)
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
        if is_kind(old, lambda kind: kind.renormalises) and handle.kept[name][1] is not None
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
        per_row = _scores(score, weight, name).tolist()  # one copy from the device, not one per row
        seen: dict[int, int] = defaultdict(int)
        for row, slot in enumerate(layer.outputs):
            root = slots.find(slot)
            scores[root] += per_row[row]
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
        chosen = {r for key, roots in families.items() for r in sorted(roots, key=scores.__getitem__)[: quota[key]]}
        return equalised(trace, chosen, scores)
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
    return equalised(trace, removed, scores)


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
        elif is_kind(module, lambda kind: kind.convolution):
            macs += (
                layer.positions
                * module.out_channels
                * (module.in_channels // module.groups)
                * math.prod(module.kernel_size)
            )
    return {"params": sum(p.numel() for p in model.parameters()), "macs": macs}
