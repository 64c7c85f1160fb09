"""The ``prune`` step: :func:`surgery.prune` with a recipe's ``prune:`` settings."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import yaml
from torch import nn

from surgery.cli.fields import positive_int, read_amounts_yaml
from surgery.cli.outputs import classification_loss
from surgery.cli.steps.base import Calibration, Row, Step, StepRun, register_step, target_rows
from surgery.cli.steps.step_checks import StepChecks
from surgery.cli.steps.step_report import StepReport
from surgery.core.errors import ConfigError
from surgery.core.handles import Handle
from surgery.ops.offload.offloading import Offloaded
from surgery.ops.sparsity.owl import check_settings, owl_amounts
from surgery.ops.sparsity.pruning import prune, prune_targets
from surgery.ops.sparsity.spec import PruneSpec

log = logging.getLogger("surgery")
OWL_ALLOCATION = "owl_allocation.yaml"  # with prune.owl: each block's sparsity and outlier ratio, each layer's amount


@dataclass(frozen=True)
class OwlSettings:
    """``prune.owl``: OWL's λ (the most a block's sparsity moves from ``prune.amount``) and M
    (the multiple of the mean Wanda score above which a score is an outlier)."""

    lam: float = 0.08
    m: float = 5.0


@dataclass(frozen=True)
class PruneConfig(PruneSpec):
    """``prune:``: the fields of :class:`~surgery.PruneSpec` (``amounts`` may also be the path
    of an ``amounts.yaml`` from ``recipe=sensitivity``), the calibration batches calibrated
    methods (wanda, sparsegpt, taylor) get, and ``owl``: each block's amount allocated by OWL
    around ``amount`` (written as ``owl_allocation.yaml``)."""

    calibration_batches: int = 8
    owl: OwlSettings | None = None

    def __post_init__(self) -> None:
        if self.amounts is not None and not isinstance(self.amounts, dict):
            object.__setattr__(self, "amounts", _read_amounts(self.amounts))
        if isinstance(self.owl, dict):
            object.__setattr__(self, "owl", OwlSettings(**self.owl))
        super().__post_init__()
        positive_int("prune.calibration_batches", self.calibration_batches)
        if self.owl is not None:
            check_settings(self.amount, self.owl.lam, self.owl.m, field="prune.owl", sparsity_field="prune.amount")
            if self.amounts is not None or self.scope != "layer" or self.pattern is not None:
                raise ConfigError(
                    "prune.owl",
                    dataclasses.asdict(self.owl),
                    "plans each block's amount itself: use prune.scope=layer, no prune.pattern and no prune.amounts",
                )


def _read_amounts(path: Any) -> dict[str, float]:
    """``prune.amounts`` given as a file's path: its ``{layer: amount}`` mapping."""
    if not isinstance(path, str):
        raise ConfigError("prune.amounts", path, "must be {layer: amount} or the path of an amounts.yaml")
    loaded = read_amounts_yaml(path, "prune.amounts")
    if not isinstance(loaded, dict) or not all(isinstance(k, str) for k in loaded):
        raise ConfigError("prune.amounts", path, "must hold a mapping {layer: amount}")
    return loaded


class PruneReport(StepReport):
    """What the ``prune`` step reports."""

    outputs = (OWL_ALLOCATION,)

    def report(self, handle: Handle, settings: PruneConfig, run: StepRun, report: dict[str, Any]) -> None:
        """``report.json`` ``prune.unrouted``: each layer no calibration token reached, pruned by magnitude."""
        sequential = getattr(handle, "sequential", None)
        if sequential is not None and sequential.unrouted:
            report["prune"] = {"unrouted": dict.fromkeys(sequential.unrouted, "magnitude")}

    def sparsity(self, handle: Handle) -> dict[str, Any] | None:
        over = {"parameters": len(handle.parameters), "entries": sum(m.numel() for m in handle.masks().values())}
        return {"overall": handle.sparsity(), "layers": handle.layer_sparsity(), "over": over}

    def summary(self, report: dict[str, Any]) -> list[str]:
        """The sparsity over the selected weights and the non-zero parameters left."""
        over = report.get("sparsity_over") or {}
        if not over.get("parameters"):  # an offloaded run measures no masks
            return []
        params = report["params"]
        unrouted = (report.get("prune") or {}).get("unrouted") or {}
        return [
            f"prune: sparsity {report['sparsity']:.4f} over {over['entries']:,} selected entries; "
            f"params {params['nonzero']:,}/{params['total']:,} non-zero",
            *(
                [f" {len(unrouted)} layer(s) no calibration token reached, pruned by magnitude (unrouted=rtn)"]
                if unrouted
                else []
            ),
        ]


class PruneChecks(StepChecks):
    """How the ``prune`` step answers the dry run and the checks."""

    def neutral(self, model: nn.Module, settings: PruneConfig, run: StepRun) -> Handle:
        """Amount 0 everywhere by magnitude, no pattern: nothing changes."""
        neutral = {"amount": 0.0, "method": "l1_unstructured", "pattern": None, "amounts": None, "blocks": None}
        neutral["owl"] = None
        return prune(model, dataclasses.replace(settings, **neutral))

    def preview(self, model: nn.Module, settings: PruneConfig) -> list[Row]:
        return target_rows("prune", prune_targets(model, settings.select, settings.exclude, settings.dim), {}, "")


class PruneStep(Step):
    """Masks on the selected weights, scored by the settings' criterion."""

    name, settings, offloadable = "prune", PruneConfig, True
    reporting = PruneReport()
    checking = PruneChecks()

    def apply(self, model: nn.Module, settings: PruneConfig, run: StepRun) -> Handle:
        loss = classification_loss if settings.criterion.needs_gradients else None
        settings = _with_owl_amounts(model, settings, run)
        return prune(model, settings, calibration=run.calibration, loss=loss, work=run.work)

    def calibration(self, settings: PruneConfig) -> Calibration | None:
        criterion = settings.criterion
        if not criterion.needs_calibration and settings.owl is None:
            return None
        return Calibration(settings.calibration_batches, labelled=criterion.needs_gradients, field="prune.method")


def _with_owl_amounts(model: nn.Module | Offloaded, settings: PruneConfig, run: StepRun) -> PruneConfig:
    """With ``prune.owl``: the settings with OWL's amounts (written to ``owl_allocation.yaml``)."""
    if settings.owl is None:
        return settings
    allocation = owl_amounts(
        model,
        run.calibration,
        settings.amount,
        lam=settings.owl.lam,
        m=settings.owl.m,
        select=settings.select,
        exclude=settings.exclude,
        blocks=settings.blocks,
    )
    if run.folder is not None:
        found = {"blocks": allocation.blocks, "outlier_ratios": allocation.outlier_ratios, "amounts": dict(allocation)}
        (run.folder / OWL_ALLOCATION).write_text(yaml.safe_dump(found, sort_keys=False))
    log.info("prune.owl: block sparsities %s", ", ".join(f"{v:.3f}" for v in allocation.blocks.values()))
    return dataclasses.replace(settings, amounts=dict(allocation), owl=None)


register_step(PruneStep())
