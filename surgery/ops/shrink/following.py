"""How channels follow a tensor through the ops a trace sees: the channel axis a layer reads,
where an op moves or keeps it, and the ties of groups and attention heads."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from surgery.core._compat import tree_leaves
from surgery.core.layer_kinds import is_kind
from surgery.ops.shrink.coupling import AttentionHeads, Channels, ChannelTrace, LayerChannels, Slots, renormalises


def moved_axis(name: str, args: tuple, kwargs: dict, x: Tensor, axis: int) -> int | None:
    """Where ``axis`` of ``x`` goes in a permute/transpose, or in a view/reshape/flatten that
    keeps it whole: the leading axes up to it unchanged (``(B, C, H, W) -> (B, C, H*W)``), or it
    stays the last axis (channels-last window partitions)."""
    rest = args[1:]
    if name in {"permute"}:
        dims = kwargs.get("dims", rest[0] if len(rest) == 1 and isinstance(rest[0], (list, tuple)) else rest)
        dims = [d % x.dim() for d in dims]
        return dims.index(axis) if sorted(dims) == list(range(x.dim())) else None
    if name in {"transpose", "swapaxes", "swapdims"} and len(rest) == 2:
        a, b = (d % x.dim() for d in rest)
        return b if axis == a else a if axis == b else axis
    return None


def indexed_axis(index: Any, x: Tensor, axis: int) -> int | None:
    """Where ``axis`` goes in ``x[index]`` when the index leaves it whole (ints, slices and
    ``None`` on other axes, a full ``:`` on it), else ``None``."""
    items = list(index) if isinstance(index, tuple) else [index]
    if any(isinstance(item, Tensor) for item in items):
        return _gathered_axis(items, x, axis)
    if (
        any(
            not (item is None or item is Ellipsis or isinstance(item, (int, slice))) or isinstance(item, bool)
            for item in items
        )
        or items.count(Ellipsis) > 1
    ):
        return None
    if Ellipsis in items:
        at = items.index(Ellipsis)
        used = sum(item is not None for item in items if item is not Ellipsis)
        items[at : at + 1] = [slice(None)] * (x.dim() - used)
    dim, out = 0, 0
    for item in items:
        if item is None:
            out += 1
            continue
        if dim == axis:
            return out if item == slice(None) else None
        dim += 1
        out += not isinstance(item, int)
    return out + (axis - dim) if axis >= dim else None


def _gathered_axis(items: list, x: Tensor, axis: int) -> int | None:
    """Where the last axis goes when ``x`` is indexed by tensors (gathering tokens, ``x[token]``)
    on leading axes only: it stays the last axis (``-1``); anything else is not followed."""
    if axis != x.dim() - 1 or any(item is Ellipsis or item is None for item in items):
        return None
    if any(isinstance(item, Tensor) and item.dtype not in (torch.long, torch.int, torch.bool) for item in items):
        return None
    used = sum(item.dim() if isinstance(item, Tensor) and item.dtype == torch.bool else 1 for item in items)
    return -1 if used < x.dim() else None


def kept_axis(x: Tensor, result: Tensor, axis: int) -> int | None:
    """The channel axis of a reshaped tensor, when the reshape keeps it whole."""
    if result.numel() != x.numel():
        return None
    if result.dim() > axis and result.shape[: axis + 1] == x.shape[: axis + 1]:
        return axis
    if axis == x.dim() - 1 and result.shape[-1] == x.shape[-1]:
        return result.dim() - 1
    return None


def read_axis(module: nn.Module, x: Tensor | None) -> int | None:
    """The axis of ``x`` whose channels ``module`` reads (``None``: not one it can follow)."""
    if x is None or x.dim() < 2:
        return None
    if is_kind(module, lambda kind: kind.activation_axis == -1 and kind.normalises is None):
        return x.dim() - 1
    if renormalises(module):
        if len(module.normalized_shape) != 1:
            return None
        width = module.normalized_shape[0]
        if type(module).forward in (nn.LayerNorm.forward, nn.RMSNorm.forward):
            return x.dim() - 1
        last, first = x.shape[-1] == width, x.shape[1] == width  # a subclass: channels first (LayerNorm2d) or last
        return x.dim() - 1 if last and not first else 1 if first and not last else None
    return 1


def union_groups(slots: Slots, channels: list[int], groups: int, sizes: tuple[int, ...] | None = None) -> None:
    """Tie the channels of each of ``groups`` groups together. ``channels`` is one list per
    part laid end to end (a grouped convolution's inputs then outputs), each part split into
    ``groups`` equal runs of ``sizes[part]``."""
    sizes = sizes or (len(channels) // groups,)
    start = 0
    for size in sizes:
        for group in range(groups):
            for slot in channels[start + group * size : start + (group + 1) * size]:
                slots.union(channels[group * sizes[0]], slot)
        start += size * groups


def couple_heads(
    trace: ChannelTrace, unit: AttentionHeads, output: Any, known: dict[int, Channels], keep_alive: list[Tensor]
) -> None:
    """After an attention module ran: tie each head's rows across its projections, give the
    output projection (or the module's merged output) the query's head slots."""
    layout, slots = unit.layout, trace.slots
    head_dim = getattr(unit.module, layout.head_dim)
    rows: dict[str, LayerChannels] = {}
    for projection in layout.projections:
        layer = trace.layers.get(f"{unit.name}.{projection}")
        if layer is None or layer.outputs is None:  # not called: the layout does not describe this forward
            return
        rows[projection] = layer
    trace.attention[unit.name] = unit
    first: dict[int, int] = {}
    for projection, layer in rows.items():
        per_unit = unit.counts[projection] // unit.units
        for row, slot in enumerate(layer.outputs):
            head = (row % (unit.counts[projection] * head_dim)) // head_dim
            group = head // per_unit
            slots.union(first.setdefault(group, slot), slot)
    query = rows[layout.projections[0]].outputs
    merged = query[: len(query) // layout.packed]
    if layout.output is not None:
        reader = trace.layers.get(f"{unit.name}.{layout.output}")
        if reader is not None:
            if reader.inputs is None:
                reader.inputs = list(merged)
            for a, b in zip(reader.inputs, merged):
                slots.union(a, b)
        return
    for tensor in tree_leaves(output):
        if isinstance(tensor, Tensor) and tensor.dim() > 1 and tensor.shape[-1] == len(merged):
            keep_alive.append(tensor)
            known[id(tensor)] = Channels(list(merged), tensor.dim() - 1)
            return
