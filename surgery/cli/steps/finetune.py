"""The ``finetune`` step: :func:`surgery.finetune` on the data's training split, with every
earlier step attached, and its learning curve in the report."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from torch import nn

from surgery.cli.fields import positive_int
from surgery.cli.outputs import classification_loss
from surgery.cli.steps.base import Row, Step, StepRun, register_step
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


class FinetuneStep(Step):
    """Training with the earlier steps attached (masks hold, quantizers learn)."""

    name, settings, needs_labels = "finetune", FinetuneConfig, True

    def apply(self, model: nn.Module, settings: FinetuneConfig, run: StepRun) -> Handle:
        batches, evaluate = run.training(settings.batch_size)
        spec = settings if settings.seed is not None else dataclasses.replace(settings, seed=run.config.seed)
        teacher = run.reference if settings.distill is not None else None  # the unmodified model
        return finetune(model, batches, spec, evaluate=evaluate, loss=classification_loss, teacher=teacher)

    def preview(self, model: nn.Module, settings: FinetuneConfig) -> list[Row]:
        trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        detail = (
            f"trains {len(trainable)} parameters ({sum(p.numel() for _, p in trainable)} values), "
            f"{settings.epochs} epoch(s)"
        )
        return [("finetune", "matched", "(model)", type(model).__name__, detail)]

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


register_step(FinetuneStep())
