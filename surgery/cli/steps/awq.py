"""The ``awq`` step: :func:`surgery.awq` with a recipe's ``awq:`` settings (then ``quantize``)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from surgery.cli.fields import positive_int
from surgery.cli.steps.base import Calibration, Row, Step, StepRun, register_step
from surgery.cli.steps.step_checks import StepChecks
from surgery.core.handles import Handle
from surgery.ops.equivalence.awq import AwqSpec, awq
from surgery.ops.numerics.grid import GridSpec


@dataclass(frozen=True)
class AwqConfig(AwqSpec):
    """``awq:``: the fields of :class:`~surgery.AwqSpec` (``weights``: the grid the search rounds
    onto, the one a later ``quantize`` step uses), and the calibration batches."""

    calibration_batches: int = 8

    def __post_init__(self) -> None:
        if isinstance(self.weights, dict):
            object.__setattr__(self, "weights", GridSpec.build(self.weights, "awq.weights"))
        super().__post_init__()
        positive_int("awq.calibration_batches", self.calibration_batches)


class AwqChecks(StepChecks):
    """How the ``awq`` step answers the dry run and the checks."""

    def preview(self, model: nn.Module, settings: AwqConfig) -> list[Row]:
        return [("awq", "matched", "(blocks)", type(model).__name__, "groups found by a traced forward at run time")]


class AwqStep(Step):
    """Weights scaled (and clipped) for the grid a later ``quantize`` rounds them onto; the
    outputs move only by the clipping."""

    name, settings, offloadable = "awq", AwqConfig, True
    checking = AwqChecks()

    def apply(self, model: nn.Module, settings: AwqConfig, run: StepRun) -> Handle:
        return awq(model, settings, calibration=run.calibration, work=run.work)

    def calibration(self, settings: AwqConfig) -> Calibration | None:
        return Calibration(settings.calibration_batches, field="awq")


register_step(AwqStep())
