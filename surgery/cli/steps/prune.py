"""The ``prune`` step: :func:`surgery.prune` with a recipe's ``prune:`` settings."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from surgery.cli.fields import positive_int, read_plan_yaml
from surgery.cli.outputs import classification_loss
from surgery.cli.steps.base import Calibration, Row, Step, StepRun, register_step, target_rows
from surgery.core.errors import ConfigError
from surgery.core.handles import Handle
from surgery.ops.offloading import Offloaded
from surgery.ops.pruning import PruneSpec, prune, prune_targets


@dataclass(frozen=True)
class PruneConfig(PruneSpec):
    """``prune:``: the fields of :class:`~surgery.PruneSpec` (``amounts`` may also be the path
    of a ``plan.yaml`` from ``recipe=sensitivity``), and the calibration batches calibrated
    methods (wanda, sparsegpt, taylor) get."""

    calibration_batches: int = 8

    def __post_init__(self) -> None:
        if self.amounts is not None and not isinstance(self.amounts, dict):
            object.__setattr__(self, "amounts", _read_plan(self.amounts))
        super().__post_init__()
        positive_int("prune.calibration_batches", self.calibration_batches)


def _read_plan(path: Any) -> dict[str, float]:
    if not isinstance(path, str):
        raise ConfigError("prune.amounts", path, "must be {layer: amount} or the path of a plan.yaml")
    loaded = read_plan_yaml(path, "prune.amounts")
    if not isinstance(loaded, dict) or not all(isinstance(k, str) for k in loaded):
        raise ConfigError("prune.amounts", path, "must hold a mapping {layer: amount}")
    return loaded


class PruneStep(Step):
    """Masks on the selected weights, scored by the settings' criterion."""

    name, settings, offloadable = "prune", PruneConfig, True

    def apply(self, model: nn.Module, settings: PruneConfig, run: StepRun) -> Handle:
        gradients = settings.criterion.needs_gradients
        return prune(model, settings, calibration=run.calibration, loss=classification_loss if gradients else None)

    def apply_offloaded(self, source: Offloaded, settings: PruneConfig, run: StepRun, work: Path | None) -> Handle:
        return prune(source, settings, calibration=run.calibration, work=work)

    def neutral(self, model: nn.Module, settings: PruneConfig, run: StepRun) -> Handle:
        """Amount 0 everywhere by magnitude, no pattern: nothing changes."""
        neutral = {"amount": 0.0, "method": "l1_unstructured", "pattern": None, "amounts": None, "blocks": None}
        return prune(model, dataclasses.replace(settings, **neutral))

    def calibration(self, settings: PruneConfig) -> Calibration | None:
        criterion = settings.criterion
        if not criterion.needs_calibration:
            return None
        return Calibration(settings.calibration_batches, labelled=criterion.needs_gradients, field="prune.method")

    def preview(self, model: nn.Module, settings: PruneConfig) -> list[Row]:
        return target_rows("prune", prune_targets(model, settings.select, settings.exclude, settings.dim), {}, "")


register_step(PruneStep())
