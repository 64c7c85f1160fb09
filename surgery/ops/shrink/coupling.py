"""What a channel trace records (:func:`surgery.ops.shrink.channels.trace_channels`): slots of
coupled channels (union-find, some frozen), which slots each layer reads and produces, the
attention modules traced as units, and the parameters sliced per channel."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from surgery.core.layer_kinds import is_kind
from surgery.ops.shrink.heads import HeadLayout


class Slots:
    """Union-find over channel slots, with a frozen flag per class."""

    def __init__(self) -> None:
        self.parent: list[int] = []
        self.frozen: set[int] = set()

    def new(self, count: int) -> list[int]:
        start = len(self.parent)
        self.parent.extend(range(start, start + count))
        return list(range(start, start + count))

    def find(self, slot: int) -> int:
        while self.parent[slot] != slot:
            self.parent[slot] = self.parent[self.parent[slot]]
            slot = self.parent[slot]
        return slot

    def union(self, a: int, b: int) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[rb] = ra
            if rb in self.frozen:
                self.frozen.add(ra)

    def freeze(self, slots: list[int]) -> None:
        for slot in slots:
            self.frozen.add(self.find(slot))

    def is_frozen(self, slot: int) -> bool:
        return self.find(slot) in self.frozen


@dataclass
class Channels:
    """A tensor's channels: the slot of each index along ``dim``."""

    slots: list[int]
    dim: int


@dataclass
class LayerChannels:
    """What the trace found for one layer: the slot of each output channel (producers: Conv,
    Linear), of each input channel it reads, and whether it passes channels through (norms,
    depthwise convolutions: their parameters are indexed by the same slots)."""

    name: str
    module: nn.Module
    outputs: list[int] | None = None
    inputs: list[int] | None = None
    passthrough: bool = False
    positions: int = 0  # output values per output channel, summed over calls (for MACs)


@dataclass
class AttentionHeads:
    """An attention module traced as one unit: its projections' rows are coupled per *unit*
    (a head; with grouped key/value heads, one key/value head and the query heads it serves)."""

    name: str
    module: nn.Module
    layout: HeadLayout
    counts: dict[str, int]  # heads per projection

    @property
    def units(self) -> int:
        return min(self.counts.values())


@dataclass
class ChannelTrace:
    """The result of :func:`trace_channels`."""

    slots: Slots
    layers: dict[str, LayerChannels] = field(default_factory=dict)
    attention: dict[str, AttentionHeads] = field(default_factory=dict)
    output_shapes: list[tuple[int, ...]] = field(default_factory=list)
    module_inputs: dict[str, list[int]] = field(default_factory=dict)  # any module's first input's slots
    parameters: dict[tuple[str, str], Channels] = field(default_factory=dict)  # (module, name) sliced per channel
    unsliceable: set[tuple[str, str]] = field(default_factory=set)  # parameters also used by other ops
    equal_widths: dict[str, list[str]] = field(default_factory=dict)  # layers whose inputs keep one count

    def can_keep_whole(self, name: str) -> bool:
        """Whether :meth:`keep_whole` of module ``name`` would freeze anything not yet frozen."""
        return any(not self.slots.is_frozen(s) for s in self._whole(name))

    def keep_normalised(self) -> None:
        """Freeze every channel a LayerNorm/RMSNorm normalises (its statistics then never change)."""
        for layer in self.layers.values():
            if renormalises(layer.module) and layer.inputs is not None:
                self.slots.freeze(layer.inputs)

    def keep_whole(self, name: str) -> None:
        """Freeze every channel module ``name`` reads or its layers produce (none is removed)."""
        self.slots.freeze(self._whole(name))
        self.unknown.append(f"{name or 'the model'} (fails when its channels shrink: kept whole)")

    def _whole(self, name: str) -> list[int]:
        inside = [layer for key, layer in self.layers.items() if not name or key == name or key.startswith(f"{name}.")]
        return self.module_inputs.get(name, []) + [s for layer in inside for s in (layer.outputs or [])]

    unknown: list[str] = field(default_factory=list)  # why slots were frozen, for the report


def renormalises(module: nn.Module) -> bool:
    """Statistics over every channel (LayerNorm, RMSNorm): fewer channels change them."""
    return is_kind(module, lambda kind: kind.renormalises)
