"""The command line's steps: the protocol and registry (:mod:`.base`) and the built-in steps,
each one file that registers itself: prune, quantize, rewrite, smooth, shrink, finetune, sensitivity."""

from surgery.cli.steps import awq, finetune, prune, quantize, rewrite, sensitivity, shrink, smooth  # noqa: F401
from surgery.cli.steps.base import STEPS, Calibration, Row, Step, StepRun, register_step, step_named

__all__ = ["STEPS", "Calibration", "Row", "Step", "StepRun", "register_step", "step_named"]
