"""Round to nearest (RTN): scales from each weight's own range, per tensor, channel or group."""

from __future__ import annotations

from surgery.ops.numerics.fake_quant import Grid
from surgery.ops.numerics.observers import Observer, relative_importance
from surgery.ops.numerics.weight_methods import QuantizedWeight, WeightProblem, register_weight_method
from surgery.ops.quantization.input_energy import input_energy


def round_to_nearest(problem: WeightProblem) -> dict[str, QuantizedWeight]:
    """Each weight's grid from its observed range: one scale per tensor, per output channel
    (``per_channel``) or per ``group_size`` consecutive inputs of each output."""
    spec, found = problem.spec, {}
    grid = Grid(spec, per_row=True)
    energy = input_energy(problem) if spec.weighted else {}  # imatrix_mse: one calibration pass
    for key in problem.targets.matched:
        value = problem.value(key)  # e.g. with pruned entries zero, as enforced
        importance = relative_importance(energy[key]) if key in energy else None
        if spec.group_size or importance is not None:  # by groups, or by channels against their inputs
            axis = problem.axis(key)
            rows = value.movedim(axis, 0).reshape(value.shape[axis], -1)
            scale, zero_point = (
                grid.group_qparams(rows, importance) if spec.group_size else grid.qparams_of(rows, importance)
            )
            found[key] = QuantizedWeight(scale, zero_point, axis)
            continue
        axis = problem.axis(key) if spec.per_channel else None
        observer = Observer(spec, axis, key)
        observer.observe(value)
        found[key] = QuantizedWeight(*observer.qparams(), axis)
    return found


register_weight_method("rtn", round_to_nearest, trainable=True)
