"""The command line's steps: the protocol and registry (:mod:`.base`) and the built-in steps,
each one file that registers itself: prune, prune_experts, quantize, rewrite, smooth, awq, rotate, kv_cache,
shrink, finetune, sensitivity, plan."""

from surgery.cli.steps import (  # noqa: F401
    awq,
    finetune,
    kv_cache,
    plan,
    prune,
    prune_experts,
    quantize,
    rewrite,
    rotate,
    sensitivity,
    shrink,
    smooth,
)
from surgery.cli.steps.base import STEPS, Calibration, Row, Step, StepRun, register_step, step_named
from surgery.cli.steps.step_checks import StepChecks
from surgery.cli.steps.step_report import StepReport

__all__ = [
    "STEPS",
    "Calibration",
    "Row",
    "Step",
    "StepChecks",
    "StepReport",
    "StepRun",
    "register_step",
    "step_named",
]
