"""How a shrink is applied and undone: :class:`ShrinkHandle` (the recorded structure, counts,
restore) and the replacement of each layer that loses channels by a smaller one (or, for a norm
of another constructor, its resizing in place)."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import Tensor, nn

from surgery.core import guards
from surgery.core._compat import forward_hook_functions, get_slot, set_slot
from surgery.core.errors import AlreadyModifiedError
from surgery.core.handles import Handle
from surgery.core.targets import Coverage, coverage_of
from surgery.ops.shrink import structure
from surgery.ops.shrink.channels import AttentionHeads, ChannelTrace
from surgery.ops.shrink.smaller import describe, rebuildable, smaller
from surgery.ops.shrink.structure import NORM_WIDTH

_WARNED: set[str] = set()


def _warn_plan_once() -> None:
    """One DeprecationWarning per process for ``ShrinkHandle.plan()``."""
    if "plan" not in _WARNED:
        _WARNED.add("plan")
        warnings.warn(
            "ShrinkHandle.plan() is renamed ShrinkHandle.structure() (the recorded shrunk structure "
            "rebuild reads); plan() goes in a later release",
            DeprecationWarning,
            stacklevel=3,
        )


class ShrinkHandle(Handle):
    """Handle returned by :func:`shrink`: the recorded structure, parameter counts and MACs before and after."""

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
        self.config_changes: dict[str, tuple[Any, Any]] = {}  # model.config field -> (old, new): experts width
        self.fingerprint = structure.fingerprint(model)  # of the original: made before anything is replaced

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

    @property
    def coverage(self) -> Coverage | None:
        """The share of the model's parameters shrink changed (every parameter of a smaller layer,
        every sliced one); ``None`` when it changed none or is no longer attached."""
        model = self.model
        changed = {
            f"{name}.{attr}": param
            for name, (_, new) in self.replaced.items()
            for attr, param in new.named_parameters(recurse=False)
        }
        changed.update(
            {f"{name}.{attr}": new for name, params in self.parameters.items() for attr, (_, new) in params.items()}
        )
        if model is None or not changed or self.state != "attached":
            return None
        return coverage_of(model, changed, [], left_reason="not changed by shrink")

    def structure(self) -> dict[str, dict[str, Any]]:
        """Every new layer's class and constructor arguments, and every changed attribute
        (attention head counts), JSON-serialisable, sealed under ``"$model"`` with the original
        model's fingerprint and a digest of the entries (:mod:`surgery.ops.shrink.structure`): what
        :func:`surgery.rebuild` reads."""
        found = {name: describe(new) for name, (_, new) in self.replaced.items()}
        for name in {**self.attributes, **self.parameters, **self.buffers}:
            module = self.model.get_submodule(name)
            found[name] = {"class": f"{type(module).__module__}.{type(module).__qualname__}"}
            if name in self.attributes:
                found[name]["attributes"] = {
                    attr: list(new) if isinstance(new, tuple) else new
                    for attr, (_, new) in self.attributes[name].items()
                }
            for kind in ("parameters", "buffers"):
                if name in getattr(self, kind):
                    found[name][kind] = {attr: list(new.shape) for attr, (_, new) in getattr(self, kind)[name].items()}
        return structure.seal(found, self.fingerprint)

    def plan(self) -> dict[str, dict[str, Any]]:
        """Deprecated alias of :meth:`structure` (warns once)."""
        _warn_plan_once()
        return self.structure()

    def params(self) -> dict[str, int]:
        """Parameter counts ``{"before", "after"}``."""
        return self.counts.get("params", {})

    def macs(self) -> dict[str, int]:
        """Multiply-accumulates of one forward on the example inputs, ``{"before", "after"}``."""
        return self.counts.get("macs", {})


def replace_layers(model: nn.Module, trace: ChannelTrace, removed: set[int]) -> ShrinkHandle:
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
            new = smaller(layer.module, keep_in, keep_out)
            if new is None:
                continue
            _like(new, layer.module)
            original = layer.module
            paths = _paths_of(model, original)  # a module registered under several names is replaced at each
            for path in paths:
                _swap(model, path, new)
            handle.replaced[name] = (original, new)
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


def _kept(slots_of: list[int] | None, removed: set[int], trace: ChannelTrace) -> Tensor | None:
    if slots_of is None:
        return None
    keep = [i for i, slot in enumerate(slots_of) if trace.slots.find(slot) not in removed]
    return None if len(keep) == len(slots_of) else torch.tensor(keep, dtype=torch.long)


def _paths_of(model: nn.Module, module: nn.Module) -> list[str]:
    return [name for name, found in model.named_modules(remove_duplicate=False) if found is module]


def _swap(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)
