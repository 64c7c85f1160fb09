"""The ``smooth`` step: :func:`surgery.smooth` (SmoothQuant) with a recipe's ``smooth:`` settings."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from surgery.cli.fields import positive_int
from surgery.cli.steps.base import Calibration, Row, Step, StepRun, register_step
from surgery.cli.steps.step_checks import StepChecks
from surgery.core.handles import Handle
from surgery.ops.equivalence.smoothing import SmoothSpec, smooth


@dataclass(frozen=True)
class SmoothConfig(SmoothSpec):
    """``smooth:``: the fields of :class:`~surgery.SmoothSpec`, and the calibration batches
    each channel's range is measured on."""

    calibration_batches: int = 4

    def __post_init__(self) -> None:
        super().__post_init__()
        positive_int("smooth.calibration_batches", self.calibration_batches)


class SmoothChecks(StepChecks):
    """How the ``smooth`` step answers the dry run and the checks."""

    def neutral(self, model: nn.Module, settings: SmoothConfig, run: StepRun) -> Handle:
        """Smoothing keeps outputs only up to float rounding, and the identity check asks for
        equal bits: its neutral form attaches nothing."""
        return Handle("smooth", model)

    def preview(self, model: nn.Module, settings: SmoothConfig) -> list[Row]:
        if settings.pairs is None:
            return [("smooth", "matched", "(norms)", "", "norm → layer pairs found by a traced forward at run time")]
        return [
            ("smooth", "matched", norm, type(model.get_submodule(norm)).__name__, f"scales {', '.join(layers)}")
            for norm, layers in dict(settings.pairs).items()
        ]


class SmoothStep(Step):
    """Activation outliers moved into the following weights; the outputs stay the same (up to
    float rounding), so a later ``quantize`` step loses less."""

    name, settings, offloadable = "smooth", SmoothConfig, True
    checking = SmoothChecks()

    def apply(self, model: nn.Module, settings: SmoothConfig, run: StepRun) -> Handle:
        return smooth(model, settings, calibration=run.calibration, work=run.work)

    def calibration(self, settings: SmoothConfig) -> Calibration | None:
        return Calibration(settings.calibration_batches, field="smooth")


register_step(SmoothStep())
