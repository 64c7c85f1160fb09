"""The ``finetune`` step: :func:`surgery.finetune` on the data's training split, with every
earlier step attached, and its learning curve in the report."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from surgery.cli.fields import positive_int
from surgery.cli.formatting import fmt, pyplot, save_figure
from surgery.cli.outputs import classification_loss
from surgery.cli.steps.base import Row, Step, StepRun, register_step
from surgery.cli.steps.step_checks import StepChecks
from surgery.cli.steps.step_report import StepReport
from surgery.core.handles import Handle
from surgery.ops.training.finetuning import FinetuneHandle, FinetuneSpec, finetune


@dataclass(frozen=True)
class FinetuneConfig(FinetuneSpec):
    """``finetune:``: the fields of :class:`~surgery.FinetuneSpec` (``seed: null`` takes the
    run's seed; ``distill:`` learns from the unmodified model too), and the training
    ``batch_size`` (labelled data only)."""

    epochs: int = 3
    seed: int | None = None
    batch_size: int = 32

    def __post_init__(self) -> None:
        super().__post_init__()
        positive_int("finetune.batch_size", self.batch_size)


class FinetuneReport(StepReport):
    """What the ``finetune`` step reports."""

    def report(self, handle: Handle, settings: FinetuneConfig, run: StepRun, report: dict[str, Any]) -> None:
        if not isinstance(handle, FinetuneHandle) or not handle.curve:
            return
        fields = {f.name: getattr(settings, f.name) for f in dataclasses.fields(settings)}
        if settings.distill is not None:
            distill = dataclasses.asdict(settings.distill)
            distill["layers"] = list(handle.distilled)
            distill["projections"] = {n.replace("/", "."): list(p.weight.shape) for n, p in handle.projections.items()}
            fields["distill"] = distill
        report["finetune"] = {**fields, "steps": handle.curve[-1].step, "curve": [vars(p) for p in handle.curve]}
        if "accuracy" in report:  # before fine-tuning = after the surgery steps before it
            report["accuracy"]["before_finetune"] = handle.curve[0].score

    def summary(self, report: dict[str, Any]) -> list[str]:
        """How long it trained (the accuracy line says what it reached)."""
        if "finetune" not in report:
            return []
        tuned = report["finetune"]
        return [
            f"finetune: {tuned['steps']} steps of {tuned['optimizer']} (lr {tuned['lr']}), the earlier steps attached"
        ]

    def markdown(self, report: dict[str, Any]) -> list[str]:
        """The fine-tuning curve."""
        if "finetune" not in report:
            return []
        tuned = report["finetune"]
        lines = [
            "",
            "## Fine-tuning",
            "",
            f"{tuned['steps']} steps of {tuned['optimizer']} (lr {tuned['lr']}, "
            f"{tuned['epochs']} epochs, batch {tuned['batch_size']}), the earlier steps attached.",
            "",
            "| step | mean training loss | accuracy |",
            "| --- | --- | --- |",
        ]
        return lines + [f"| {p['step']} | {fmt(p['loss'])} | {fmt(p['score'])} |" for p in tuned["curve"]]

    def plots(self, report: dict[str, Any]) -> dict[str, Callable[[dict[str, Any], Path], None]]:
        curve = report.get("finetune", {}).get("curve", [])
        return {"finetune.png": plot_finetune} if any(p["score"] is not None for p in curve) else {}


class FinetuneChecks(StepChecks):
    """How the ``finetune`` step answers the dry run and the checks."""

    def preview(self, model: nn.Module, settings: FinetuneConfig) -> list[Row]:
        trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        detail = (
            f"trains {len(trainable)} parameters ({sum(p.numel() for _, p in trainable)} values), "
            f"{settings.epochs} epoch(s)"
        )
        return [("finetune", "matched", "(model)", type(model).__name__, detail)]


class FinetuneStep(Step):
    """Training with the earlier steps attached (masks hold, quantizers learn)."""

    name, settings, needs_labels = "finetune", FinetuneConfig, True
    reporting = FinetuneReport()
    checking = FinetuneChecks()

    def apply(self, model: nn.Module, settings: FinetuneConfig, run: StepRun) -> Handle:
        batches, evaluate = run.training(settings.batch_size)
        spec = settings if settings.seed is not None else dataclasses.replace(settings, seed=run.config.seed)
        teacher = run.reference if settings.distill is not None else None  # the unmodified model
        return finetune(
            model, calibration=batches, spec=spec, evaluate=evaluate, loss=classification_loss, teacher=teacher
        )


def plot_finetune(report: dict[str, Any], path: Path) -> None:
    """Accuracy (and training loss) against optimizer steps while fine-tuning, with the
    unmodified model's accuracy as a reference line."""
    plt = pyplot()
    curve = report["finetune"]["curve"]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    steps, scores = [p["step"] for p in curve], [p["score"] for p in curve]
    ax.plot(steps, scores, marker="o", color="#4C72B0", label="accuracy (modified, fine-tuning)")
    if "accuracy" in report:
        ax.axhline(report["accuracy"]["reference"], color="#55A868", linestyle="--", label="accuracy (unmodified)")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("top-1 accuracy")
    ax.grid(alpha=0.3)
    losses = [(p["step"], p["loss"]) for p in curve if p["loss"] is not None]
    if losses:
        twin = ax.twinx()
        twin.plot(*zip(*losses), color="#DD8452", alpha=0.6, label="training loss")
        twin.set_ylabel("training loss")
        twin.legend(loc="center right")
    ax.legend(loc="lower right")
    earlier = ", ".join(report["steps"][:-1]) or "it"
    ax.set_title(f"{report['recipe']}: fine-tuning {report['model']} with {earlier} attached")
    save_figure(fig, path)


register_step(FinetuneStep())
