"""How the channel trace follows one expert of a mixture-of-experts layer (an
:class:`~surgery.ops.experts.linear_experts.ExpertMLP`): traced as one unit, like an attention module.

An expert computes ``down_proj(gating(gate_proj(x), up_proj(x)))`` where the gating is the fused
module's own activation (it concatenates or interleaves gate and up, then splits them again: ops
the trace cannot follow). Row ``i`` of ``gate_proj`` and of ``up_proj`` meet only each other in the
gating, and make column ``i`` of ``down_proj``: one coupled channel. ``down_proj``'s rows (the hidden width the routed sum adds up) stay whole.
Every expert of one experts
module must keep as many channels as the others (the fused parameter holds one width), so the
trace records them as a group of equal width (:attr:`ChannelTrace.equal_widths`).
"""

from __future__ import annotations

from torch import nn

from surgery.ops.experts.linear_experts import ExpertMLP
from surgery.ops.shrink.coupling import ChannelTrace


def is_expert(module: nn.Module) -> bool:
    """One expert's layers, traced as a unit."""
    return isinstance(module, ExpertMLP)


def couple_expert(trace: ChannelTrace, name: str, module: ExpertMLP) -> None:
    """After an expert ran: tie gate and up rows one to one, make them ``down_proj``'s inputs."""
    up = trace.layers.get(f"{name}.up_proj")
    down = trace.layers.get(f"{name}.down_proj")
    gate = trace.layers.get(f"{name}.gate_proj") if module.gated else up
    if up is None or down is None or gate is None or up.outputs is None or gate.outputs is None:
        return
    if len(gate.outputs) != len(up.outputs):
        trace.slots.freeze(gate.outputs + up.outputs)
        return
    for a, b in zip(gate.outputs, up.outputs):
        trace.slots.union(a, b)
    if down.outputs is not None:  # summed into the hidden stream by routing the trace may not see
        trace.slots.freeze(down.outputs)
    if down.inputs is None:
        down.inputs = list(up.outputs)
    elif len(down.inputs) == len(up.outputs):
        for a, b in zip(down.inputs, up.outputs):
            trace.slots.union(a, b)
    group = trace.equal_widths.setdefault(name.rpartition(".")[0], [])
    if f"{name}.down_proj" not in group:
        group.append(f"{name}.down_proj")


def equalised(trace: ChannelTrace, removed: set[int], scores: dict[int, float]) -> set[int]:
    """``removed`` with every group of :attr:`ChannelTrace.equal_widths` losing the same count:
    the fewest any of its layers loses (one kept whole loses none); each keeps its most important."""
    removed = set(removed)
    slots = trace.slots
    for layers in trace.equal_widths.values():
        chosen = []
        for name in layers:
            roots = {slots.find(s) for s in trace.layers[name].inputs or []}
            chosen.append(sorted(roots & removed, key=scores.__getitem__))
        fewest = min(len(roots) for roots in chosen)
        for roots in chosen:
            removed.difference_update(roots[fewest:])
    return removed
