"""GPTAQ (Li et al. 2025, "asymmetric calibration"): GPTQ's walk, each layer fitted to the outputs
the float model gives (its inputs there) from the inputs the compressed model gives it, so the
error of the layers before it is compensated too, not carried along."""

from __future__ import annotations

from surgery.ops.numerics.weight_methods import QuantizedWeight, WeightProblem, register_weight_method
from surgery.ops.quantization.methods.gptq import GptaqSettings, solve_columns
from surgery.ops.second_order.hessians import asymmetric_hessians


def solve_gptaq(problem: WeightProblem) -> dict[str, QuantizedWeight]:
    """GPTAQ on every selected layer: the float model's inputs carried beside the compressed ones."""
    return solve_columns(problem, paired=asymmetric_hessians)


register_weight_method(
    "gptaq", solve_gptaq, needs_calibration=True, sequential=True, float_stream=True, settings=GptaqSettings
)
