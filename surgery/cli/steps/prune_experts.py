"""The ``prune_experts`` step: :func:`surgery.prune_experts` with a recipe's ``prune_experts:``
settings, and its report: experts per layer before and after, and per experts layer the experts
removed, each expert's score and the calibration tokens its router sent it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from surgery.cli.fields import positive_int
from surgery.cli.steps.base import Calibration, Row, Step, StepRun, register_step
from surgery.cli.steps.step_checks import StepChecks
from surgery.cli.steps.step_report import StepReport
from surgery.core.errors import ConfigError
from surgery.core.handles import Handle
from surgery.ops.experts.expert_pruning import ExpertPruneHandle, PruneExpertsSpec, prune_experts, remove_experts
from surgery.ops.experts.layouts import fused_experts


@dataclass(frozen=True)
class PruneExpertsConfig(PruneExpertsSpec):
    """``prune_experts:``: the fields of :class:`~surgery.PruneExpertsSpec` (the share,
    ``0 < amount < 1``, or count, an integer, of each layer's experts removed; the criterion
    scoring them, ``reap``, ``frequency``, ``random`` or a registered one; the seed of
    ``random``), and the calibration batches scored on."""

    amount: float = 0.25  # the command line reads every number as a float: 2.0 is a count
    calibration_batches: int = 8

    def __post_init__(self) -> None:
        if isinstance(self.amount, bool) or not isinstance(self.amount, (int, float)) or self.amount <= 0:
            raise ConfigError(
                "prune_experts.amount", self.amount, "must be a fraction in (0, 1) or a count of experts >= 1"
            )
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ConfigError("prune_experts.seed", self.seed, "must be an integer")
        super().__post_init__()
        positive_int("prune_experts.calibration_batches", self.calibration_batches)


class PruneExpertsReport(StepReport):
    """What the ``prune_experts`` step reports."""

    def report(self, handle: Handle, settings: PruneExpertsConfig, run: StepRun, report: dict[str, Any]) -> None:
        if isinstance(handle, ExpertPruneHandle):
            report["prune_experts"] = {
                "criterion": handle.criterion,
                "num_experts": handle.num_experts,
                "layers": {
                    name: {
                        "removed": handle.removed[name],
                        "scores": handle.scores.get(name),
                        "tokens_per_expert": handle.tokens_per_expert.get(name),
                    }
                    for name in handle.kept
                },
            }

    def summary(self, report: dict[str, Any]) -> list[str]:
        """Experts per layer before and after, by which criterion, over how many layers."""
        found = report.get("prune_experts")
        if not found:
            return []
        counts = found["num_experts"]
        return [
            f"prune_experts: {counts['before']} -> {counts['after']} experts in each of "
            f"{len(found['layers'])} layer(s), lowest {found['criterion']} score removed"
        ]


class PruneExpertsChecks(StepChecks):
    """How the ``prune_experts`` step answers the dry run and the checks."""

    def fresh_build(
        self, handle: Handle, build: Callable[[], nn.Module], architecture: Callable[[], nn.Module]
    ) -> Callable[[], nn.Module]:
        """The model's class with the experts this step kept (values come from the checkpoint)."""
        kept = dict(handle.kept) if isinstance(handle, ExpertPruneHandle) else None
        if kept is None:
            return build

        def smaller() -> nn.Module:
            """A fresh model with this step's experts kept (the removal baked)."""
            model = build()
            remove_experts(model, kept).bake()
            return model

        return smaller

    def preview(self, model: nn.Module, settings: PruneExpertsConfig) -> list[Row]:
        return [
            (
                "prune_experts",
                "matched",
                name,
                type(model.get_submodule(name)).__name__,
                f"{layout.num_experts} experts",
            )
            for name, layout in fused_experts(model).items()
        ]


class PruneExpertsStep(Step):
    """Whole experts removed from every mixture-of-experts layer: the model gets smaller."""

    name, settings = "prune_experts", PruneExpertsConfig
    reporting = PruneExpertsReport()
    checking = PruneExpertsChecks()

    def apply(self, model: nn.Module, settings: PruneExpertsConfig, run: StepRun) -> Handle:
        amount = settings.amount  # the command line reads every number as a float: 2.0 is a count
        amount = int(amount) if float(amount).is_integer() else amount
        spec = PruneExpertsSpec(amount, settings.criterion, settings.seed)
        return prune_experts(model, spec, calibration=run.calibration)

    def calibration(self, settings: PruneExpertsConfig) -> Calibration | None:
        if settings.criterion == "random":
            return None
        return Calibration(settings.calibration_batches, field="prune_experts.calibration")


register_step(PruneExpertsStep())
