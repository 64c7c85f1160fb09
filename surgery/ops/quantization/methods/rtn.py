"""Round to nearest (RTN): scales from each weight's own range, per tensor, channel or group."""

from __future__ import annotations

from surgery.ops.numerics.observers import Grid, Observer
from surgery.ops.numerics.weight_methods import QuantizedWeight, WeightProblem, register_weight_method


def round_to_nearest(problem: WeightProblem) -> dict[str, QuantizedWeight]:
    """Each weight's grid from its observed range: one scale per tensor, per output channel
    (``per_channel``) or per ``group_size`` consecutive inputs of each output."""
    spec, found = problem.spec, {}
    grid = Grid(spec, per_row=True) if spec.group_size else None
    for key in problem.targets.matched:
        value = problem.value(key)  # e.g. with pruned entries zero, as enforced
        if grid is not None:
            axis = problem.axis(key)
            scale, zero_point = grid.group_qparams(value.movedim(axis, 0).reshape(value.shape[axis], -1))
            found[key] = QuantizedWeight(scale, zero_point, axis)
            continue
        axis = problem.axis(key) if spec.per_channel else None
        observer = Observer(spec, axis, key)
        observer.observe(value)
        found[key] = QuantizedWeight(*observer.qparams(), axis)
    return found


register_weight_method("rtn", round_to_nearest, trainable=True)
