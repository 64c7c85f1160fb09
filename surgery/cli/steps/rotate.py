"""The ``rotate`` step: :func:`surgery.rotate` (QuaRot-style Hadamard rotations of a Llama's
residual stream) with a recipe's ``rotate:`` settings, before ``quantize``."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from surgery.cli.fields import positive_int
from surgery.cli.steps.base import Calibration, Row, Step, StepRun, register_step
from surgery.cli.steps.step_checks import StepChecks
from surgery.core.errors import ConfigError
from surgery.core.handles import Handle
from surgery.ops.equivalence.rotation import RotateSpec, rotate


@dataclass(frozen=True)
class RotateConfig(RotateSpec):
    """``rotate:``: the fields of :class:`~surgery.RotateSpec` (the random signs' ``seed``,
    ``online``, refused here: see below, and ``learn``: null, true, or a dict of
    :class:`~surgery.LearnSpec`'s fields, the rotation trained on every calibration batch through
    the quantized forward, SpinQuant's R1 and R2), and the calibration batches, the first of which
    traces the stream's readers and checks the outputs."""

    online: bool = False
    calibration_batches: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.online is not False:
            raise ConfigError(
                "rotate.online",
                self.online,
                "rotates down_proj's inputs with a hook that no checkpoint holds, and a run bakes its "
                "model; rotate with online=false here, or call surgery.rotate(online=True) from Python",
            )
        positive_int("rotate.calibration_batches", self.calibration_batches)


class RotateChecks(StepChecks):
    """How the ``rotate`` step answers the dry run and the checks."""

    def preview(self, model: nn.Module, settings: RotateConfig) -> list[Row]:
        return [
            ("rotate", "matched", "(stream)", type(model).__name__, "readers and writers found by a traced forward")
        ]


class RotateStep(Step):
    """The residual stream rotated by a random Hadamard matrix, fused into the weights: the
    same function (to float rounding), with fewer outliers for a later ``quantize`` step."""

    name, settings, offloadable = "rotate", RotateConfig, True
    checking = RotateChecks()

    def apply(self, model: nn.Module, settings: RotateConfig, run: StepRun) -> Handle:
        return rotate(
            model, RotateSpec(settings.seed, False, settings.learn), calibration=run.calibration, work=run.work
        )

    def calibration(self, settings: RotateConfig) -> Calibration | None:
        return Calibration(settings.calibration_batches, field="rotate")


register_step(RotateStep())
