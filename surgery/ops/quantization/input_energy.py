"""Each selected weight's input columns' calibration energy E[x²]: the importance a weighted
observer (``imatrix_mse``) weighs rounding errors by, for methods without a Hessian (rtn)."""

from __future__ import annotations

from torch import Tensor

from surgery.core.capture import input_statistics
from surgery.core.errors import ConfigError, NoCalibrationInputError
from surgery.core.inputs import run_batches
from surgery.core.targets import Target
from surgery.ops.numerics.weight_methods import WeightProblem

FIELD = "quantize.calibration"


def input_energy(problem: WeightProblem) -> dict[str, Tensor]:
    """One calibration pass: ``{key: E[x²] per column of the weight's (outputs, columns) matrix}``."""
    if problem.calibration is None:
        raise ConfigError(FIELD, None, f"weights.observer={problem.spec.observer!r} weighs inputs; pass calibration")
    targets = problem.targets.matched
    layers = {target.module_name: target.module for target in targets.values()}
    counted = []
    seen = input_statistics(
        problem.model,
        layers,
        lambda: counted.append(run_batches(problem.model, problem.calibration, field=FIELD, progress=problem.progress)),
    )
    if not counted[0]:
        raise ConfigError(FIELD, "0 batches", "must hold at least one batch")
    return {key: _per_column(key, target, seen.get(target.module_name), problem) for key, target in targets.items()}


def _per_column(key: str, target: Target, captured: dict | None, problem: WeightProblem) -> Tensor:
    """The layer's per-input-feature E[x²] repeated over each feature's kernel entries."""
    if captured is None:
        raise NoCalibrationInputError(
            FIELD,
            target.module_name,
            "this layer received no floating-point input during calibration",
            "give batches that run through it, or exclude it",
        )
    energy = (captured["sq_norms"] / max(captured["rows"], 1)).float()
    value = problem.value(key)
    columns = value.numel() // value.shape[problem.axis(key)]
    grouped = getattr(target.module, "groups", 1) != 1
    if target.attribute != "weight" or grouped or columns % energy.numel():
        raise ConfigError(
            "quantize.weights.observer",
            problem.spec.observer,
            f"weighs each weight column by its input's energy; {key} has {columns} columns for "
            f"{energy.numel()} input features{' (a grouped convolution)' if grouped else ''}: exclude it",
        )
    return energy.repeat_interleave(columns // energy.numel())
