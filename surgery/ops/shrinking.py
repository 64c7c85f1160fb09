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

import logging
import math
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from surgery.core import compiled, guards
from surgery.core.channels import ChannelTrace, LayerChannels, trace_channels
from surgery.core.errors import ConfigError, ConfigTypeError
from surgery.core.handles import Handle
from surgery.core.inputs import Inputs, batches
from surgery.core.selection import Selection, select as select_modules

SCOPES = ("layer", "global")
log = logging.getLogger("surgery")


class ShrinkHandle(Handle):
    """Handle returned by :func:`shrink`: the plan, parameter counts and MACs before and after."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__("shrink", model)
        self.replaced: dict[str, tuple[nn.Module, nn.Module]] = {}  # name -> (original, smaller)
        self.kept: dict[str, tuple[Tensor | None, Tensor | None]] = {}  # name -> (input, output) indices kept
        self.families: list[dict[str, Any]] = []
        self.frozen_ops: list[str] = []
        self.counts: dict[str, dict[str, int]] = {}

    def plan(self) -> dict[str, dict[str, Any]]:
        """Every new layer's class and constructor arguments, JSON-serialisable."""
        return {name: describe(new) for name, (_, new) in self.replaced.items()}

    def params(self) -> dict[str, int]:
        """Parameter counts ``{"before", "after"}``."""
        return self.counts.get("params", {})

    def macs(self) -> dict[str, int]:
        """Multiply-accumulates of one forward on the example inputs, ``{"before", "after"}``."""
        return self.counts.get("macs", {})


def shrink(model: nn.Module, amount: float, *, example_inputs: Inputs, select: Selection = None,
           exclude: Selection = None, importance: str | Callable[[Tensor], Tensor] = "l2",
           scope: str = "layer", round_to: int = 1) -> ShrinkHandle:
    """Remove ``amount`` of the removable channels of every coupled family, for real.

    Args:
        model: modified in place: layers are replaced by smaller ones.
        amount: fraction in [0, 1] of each family's channels to remove (0 changes nothing).
        example_inputs: one batch (tensor, tuple or dict) the coupling is traced on.
        select, exclude: layers whose output channels may be removed (default all).
        importance: ``"l2"`` (norm of each channel's producing weights) or a function of the
            producing weight matrix (outputs × rest) giving one score per output.
        scope: ``"layer"`` (each family by ``amount``) or ``"global"`` (one ranking).
        round_to: keep channel counts multiples of this (e.g. 8 for fast kernels).

    Example:
        >>> handle = surgery.shrink(model, 0.5, example_inputs=torch.randn(1, 3, 224, 224))
        >>> handle.params()
        {'before': 25557032, 'after': 6563560}
    """
    model = compiled.prepare(model)
    amount, round_to = _validate(amount, scope, round_to, importance)
    example = next(iter(batches(example_inputs, "shrink.example_inputs")))
    for name, param in model.named_parameters():
        if guards.transforms_of(param):
            raise ConfigError("shrink", name, "has surgery attached (prune, quantize...); restore or bake it first")
    allowed = set(select_modules(model, select, exclude=exclude, field="shrink.select", exclude_field="shrink.exclude")
                  ) if select is not None or exclude is not None else None
    trace = trace_channels(model, example)
    before = _counts(model, trace)
    removed = _choose(trace, amount, scope, round_to, importance, allowed)
    handle = ShrinkHandle(model)
    handle.frozen_ops = list(trace.unknown)
    try:
        for name, layer in trace.layers.items():
            keep_in = _kept(layer.inputs, removed, trace)
            keep_out = _kept(layer.outputs, removed, trace) if not layer.passthrough else keep_in
            if keep_in is None and keep_out is None:
                continue
            smaller = _smaller(layer, keep_in, keep_out)
            if smaller is None:
                continue
            smaller.train(layer.module.training)  # a new module starts in training mode
            original = layer.module
            paths = _paths_of(model, original)  # a module registered under several names is replaced at each
            for path in paths:
                _swap(model, path, smaller)
            handle.replaced[name] = (original, smaller)
            handle.kept[name] = (keep_in, keep_out)
            handle.add(f"put back {name}", lambda ps=paths, o=original: [_swap(model, p, o) for p in ps])
    except BaseException as err:
        handle.rollback(err)
        raise
    handle.families = _families_report(trace, removed)
    if amount > 0 and not removed:
        log.warning("shrink: nothing removed: %s", "every channel is frozen (by %s, or by reaching the outputs)" %
                    (", ".join(trace.unknown) or "no traced op") if not any(f["channels"] > f["frozen"]
                                                                             for f in handle.families)
                    else f"amount {amount:g} rounds to zero channels in every family (round_to={round_to})")
    handle.counts = {key: {"before": before[key], "after": value} for key, value in _counts(model, trace).items()}
    return handle


def _validate(amount: object, scope: str, round_to: object, importance: object) -> tuple[float, int]:
    if isinstance(amount, bool) or not isinstance(amount, (int, float)) or not 0.0 <= amount <= 1.0:
        raise ConfigError("shrink.amount", amount, "must be a number in [0, 1]")
    if scope not in SCOPES:
        raise ConfigError("shrink.scope", scope, f"must be one of {', '.join(SCOPES)}")
    if isinstance(round_to, bool) or not isinstance(round_to, int) or round_to < 1:
        raise ConfigError("shrink.round_to", round_to, "must be an integer >= 1")
    if importance != "l2" and not callable(importance):
        raise ConfigTypeError("shrink.importance", importance, "must be 'l2' or a function weight -> scores")
    return float(amount), round_to


def _producer_weight(module: nn.Module) -> Tensor:
    return module.weight.detach().reshape(module.weight.shape[0], -1).float()


def _choose(trace: ChannelTrace, amount: float, scope: str, round_to: int, importance: Any,
            allowed: set[str] | None) -> set[int]:
    """The slot classes to remove."""
    slots = trace.slots
    scores: dict[int, float] = defaultdict(float)
    producers: dict[int, set[str]] = defaultdict(set)
    for name, layer in trace.layers.items():
        if layer.outputs is None or layer.passthrough or layer.outputs is layer.inputs:
            continue
        weight = _producer_weight(layer.module)
        per_row = weight.norm(dim=1) if importance == "l2" else importance(weight).float().reshape(-1)
        for row, slot in enumerate(layer.outputs):
            root = slots.find(slot)
            scores[root] += float(per_row[row])
            producers[root].add(name)
    families: dict[frozenset, list[int]] = defaultdict(list)
    for root, names in producers.items():
        if root in slots.frozen or (allowed is not None and not names <= allowed):
            continue
        families[frozenset(names)].append(root)
    removed: set[int] = set()
    groups = [sorted(roots, key=lambda r: scores[r]) for roots in families.values()]
    if scope == "global":
        groups = [sorted((r for g in groups for r in g), key=lambda r: scores[r])]
    for roots in groups:
        count = math.floor(amount * len(roots) / round_to) * round_to
        count = min(count, len(roots) - 1)  # a family keeps at least one channel
        removed.update(roots[:max(count, 0)])
    return removed


def _kept(slots_of: list[int] | None, removed: set[int], trace: ChannelTrace) -> Tensor | None:
    if slots_of is None:
        return None
    keep = [i for i, slot in enumerate(slots_of) if trace.slots.find(slot) not in removed]
    return None if len(keep) == len(slots_of) else torch.tensor(keep, dtype=torch.long)


def _smaller(layer: LayerChannels, keep_in: Tensor | None, keep_out: Tensor | None) -> nn.Module | None:
    """A new layer of the same class holding the kept slices (None: nothing changes)."""
    module = layer.module
    factory = {"device": next(module.parameters(), torch.empty(0)).device}
    with torch.no_grad():
        if isinstance(module, nn.Linear):
            weight = module.weight.detach()
            weight = weight if keep_out is None else weight[keep_out]
            weight = weight if keep_in is None else weight[:, keep_in]
            new = nn.Linear(weight.shape[1], weight.shape[0], bias=module.bias is not None, dtype=weight.dtype, **factory)
            new.weight.copy_(weight)
            if module.bias is not None:
                new.bias.copy_(module.bias if keep_out is None else module.bias[keep_out])
            return new
        if isinstance(module, nn.modules.conv._ConvNd):
            depthwise = module.groups > 1
            weight = module.weight.detach()
            weight = weight if keep_out is None else weight[keep_out]
            if not depthwise and keep_in is not None:
                weight = weight[:, keep_in]
            channels_in = weight.shape[0] if depthwise else weight.shape[1]
            new = type(module)(channels_in, weight.shape[0], module.kernel_size, stride=module.stride,
                               padding=module.padding, dilation=module.dilation,
                               groups=weight.shape[0] if depthwise else 1, bias=module.bias is not None,
                               padding_mode=module.padding_mode, dtype=weight.dtype, **factory)
            new.weight.copy_(weight)
            if module.bias is not None:
                new.bias.copy_(module.bias if keep_out is None else module.bias[keep_out])
            return new
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and keep_out is not None:
            new = type(module)(len(keep_out), eps=module.eps, momentum=module.momentum, affine=module.affine,
                               track_running_stats=module.track_running_stats, **factory)
            for attr in ("weight", "bias", "running_mean", "running_var"):
                value = getattr(module, attr)
                if value is not None:
                    getattr(new, attr).copy_(value[keep_out])
            if module.num_batches_tracked is not None:
                new.num_batches_tracked.copy_(module.num_batches_tracked)
            return new
        if isinstance(module, nn.LayerNorm) and keep_out is not None:
            new = nn.LayerNorm(len(keep_out), eps=module.eps, elementwise_affine=module.elementwise_affine,
                               bias=module.bias is not None, **factory)
            if module.weight is not None:
                new.weight.copy_(module.weight[keep_out])
            if module.bias is not None:
                new.bias.copy_(module.bias[keep_out])
            return new
    return None


def _paths_of(model: nn.Module, module: nn.Module) -> list[str]:
    return [name for name, found in model.named_modules(remove_duplicate=False) if found is module]


def _swap(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)


def describe(module: nn.Module) -> dict[str, Any]:
    """A layer's class and the constructor arguments that rebuild it at its shape."""
    if isinstance(module, nn.Linear):
        args = {"in_features": module.in_features, "out_features": module.out_features, "bias": module.bias is not None}
    elif isinstance(module, nn.modules.conv._ConvNd):
        args = {"in_channels": module.in_channels, "out_channels": module.out_channels,
                "kernel_size": list(module.kernel_size), "stride": list(module.stride),
                "padding": module.padding if isinstance(module.padding, str) else list(module.padding),
                "dilation": list(module.dilation), "groups": module.groups, "bias": module.bias is not None,
                "padding_mode": module.padding_mode}
    elif isinstance(module, nn.modules.batchnorm._BatchNorm):
        args = {"num_features": module.num_features, "eps": module.eps, "momentum": module.momentum,
                "affine": module.affine, "track_running_stats": module.track_running_stats}
    else:
        args = {"normalized_shape": list(module.normalized_shape), "eps": module.eps,
                "elementwise_affine": module.elementwise_affine, "bias": module.bias is not None}
    return {"class": f"{type(module).__module__}.{type(module).__qualname__}", "args": args}


def _families_report(trace: ChannelTrace, removed: set[int]) -> list[dict[str, Any]]:
    found: dict[frozenset, dict[str, int]] = {}
    slots = trace.slots
    for name, layer in trace.layers.items():
        if layer.outputs is None or layer.passthrough:
            continue
        roots = {slots.find(s) for s in layer.outputs}
        key = frozenset(roots)
        entry = found.setdefault(key, {"layers": [], "channels": len(roots),
                                       "removed": len(roots & removed), "frozen": len(roots & slots.frozen)})
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
        elif isinstance(module, nn.modules.conv._ConvNd):
            macs += layer.positions * module.out_channels * (module.in_channels // module.groups) * \
                math.prod(module.kernel_size)
    return {"params": sum(p.numel() for p in model.parameters()), "macs": macs}


def _layer_class(path: str) -> type:
    known = {f"{cls.__module__}.{cls.__qualname__}": cls for cls in (
        nn.Linear, nn.Conv1d, nn.Conv2d, nn.BatchNorm1d, nn.BatchNorm2d, nn.LayerNorm)}
    if path not in known:
        raise ConfigError("rebuild.plan", path, f"is not a layer shrink makes; allowed: {', '.join(known)}")
    return known[path]


def rebuild(factory: Callable[[], nn.Module], plan: dict[str, dict[str, Any]], *, device: str | torch.device = "cpu"
            ) -> nn.Module:
    """The original class at the shrunk shapes, ready for ``load_state_dict(strict=True)`` of
    the baked state dict.

    ``factory()`` runs on the ``meta`` device (no full-size weights are allocated), the layers
    the plan names are replaced by new layers of the planned shapes, and the model is then
    materialised on ``device`` with uninitialised values: load the baked weights next.

    Example:
        >>> model = surgery.rebuild(torchvision.models.resnet50, handle.plan())
        >>> model.load_state_dict(baked.state_dict(), strict=True)
    """
    if not isinstance(plan, dict):
        raise ConfigTypeError("rebuild.plan", plan, "must be the dict ShrinkHandle.plan() returns (or its JSON)")
    with torch.device("meta"):
        model = factory()
    if not isinstance(model, nn.Module):
        raise ConfigTypeError("rebuild.factory", type(model).__name__, "must return an nn.Module")
    named = dict(model.named_modules())
    for name, entry in plan.items():
        if name not in named:
            raise ConfigError("rebuild.plan", name, "is not a module of the model the factory builds")
        cls = _layer_class(entry.get("class", "") if isinstance(entry, dict) else "")
        if not isinstance(named[name], cls):
            raise ConfigError("rebuild.plan", name, f"is a {type(named[name]).__name__} in this model; the plan has "
                              f"a {cls.__name__}")
        args = {k: tuple(v) if isinstance(v, list) and k != "normalized_shape" else v for k, v in entry["args"].items()}
        with torch.device("meta"):
            new = cls(**args)
        new.train(named[name].training)
        for path in _paths_of(model, named[name]):
            _swap(model, path, new)
    return model.to_empty(device=device)
