"""The ``quantize`` step: :func:`surgery.quantize` with a recipe's ``quantize:`` settings."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import Tensor, nn

from surgery.cli.fields import positive_int
from surgery.cli.steps.base import Calibration, Row, Step, StepRun, register_step, target_rows
from surgery.cli.steps.step_checks import StepChecks
from surgery.cli.steps.step_report import StepReport
from surgery.core.handles import Handle
from surgery.ops.equivalence.folding import folded_structure
from surgery.ops.numerics.grid import GridSpec
from surgery.ops.quantization.qparams import QuantizeHandle
from surgery.ops.quantization.quantization import QuantizeSpec, quantize, quantize_targets
from surgery.ops.quantization.storage import weight_storage
from surgery.ops.quantization.targets import deploy_target


@dataclass(frozen=True)
class QuantizeConfig(QuantizeSpec):
    """``quantize:``: the fields of :class:`~surgery.QuantizeSpec` (``weights`` and
    ``activations`` hold :class:`~surgery.GridSpec` fields; ``null`` turns that part off),
    and the calibration batches activations and calibrated weight methods get."""

    weights: GridSpec | None = GridSpec(bits=8, symmetric=True, per_channel=True)
    calibration_batches: int = 4

    def __post_init__(self) -> None:
        super().__post_init__()
        positive_int("quantize.calibration_batches", self.calibration_batches)


class QuantizeReport(StepReport):
    """What the ``quantize`` step reports."""

    def report(self, handle: Handle, settings: QuantizeConfig, run: StepRun, report: dict[str, Any]) -> None:
        """``report.json`` ``quantize``: bits per quantized weight and the model's bytes against fp32;
        ``unrouted``: each layer no calibration token reached and how it was rounded."""
        stored = getattr(handle, "storage", None)  # an offloaded run's handle holds no quantizers
        if stored is not None:
            report["quantize"] = stored
        sequential = getattr(handle, "sequential", None)
        if stored is not None and sequential is not None and sequential.unrouted:
            report["quantize"]["unrouted"] = dict.fromkeys(sequential.unrouted, "rtn")

    def summary(self, report: dict[str, Any]) -> list[str]:
        """Bits per quantized weight, and the model's bytes against fp32."""
        if "quantize" not in report:
            return []
        stored = report["quantize"]
        unrouted = stored.get("unrouted") or {}
        return [
            f"quantize: {stored['bits_per_weight']:.3g} bits per weight on {stored['share_of_parameters']:.0%} of the "
            f"parameters; the model {stored['bytes'] / 1e6:.3g} MB, "
            f"{stored['bytes_vs_fp32']:.3f}x its fp32 bytes",
            *(
                [f" {len(unrouted)} layer(s) no calibration token reached, rounded to nearest (unrouted=rtn)"]
                if unrouted
                else []
            ),
        ]

    def markdown(self, report: dict[str, Any]) -> list[str]:
        """What the quantized model stores, against fp32."""
        if "quantize" not in report:
            return []
        stored = report["quantize"]
        return [
            "",
            "## Quantization",
            "",
            "| weights | share of the parameters | bits per weight | bytes | x fp32 |",
            "| --- | --- | --- | --- | --- |",
            f"| {stored['weights']} | {stored['share_of_parameters']:.1%} | {stored['bits_per_weight']:.3f} "
            f"| {stored['bytes']:,} | {stored['bytes_vs_fp32']:.3f} |",
            "",
            "Bits per weight count the values and their scales (half precision; the MX/NV formats' block "
            "scales at 8 bits) and zero points; parameters left float count at their own dtype.",
        ]


class QuantizeChecks(StepChecks):
    """How the ``quantize`` step answers the dry run and the checks."""

    def preview(self, model: nn.Module, settings: QuantizeConfig) -> list[Row]:
        targets, layers = quantize_targets(
            model, settings.select, settings.exclude, settings.weights, settings.activations, settings.where
        )
        return target_rows("quantize", targets, layers, settings.where)

    def reattach(self, model: nn.Module, settings: QuantizeConfig, qparams: dict[str, Tensor] | Path) -> Handle | None:
        """Activation quantization from the saved parameters, without calibration."""
        if settings.activations is None:
            return None
        select = settings.select
        if select is None and settings.target is not None:  # the layers the target selected
            select = deploy_target(settings.target).layers
        spec = dataclasses.replace(
            settings,
            weights=None,
            method=None,
            train=False,
            freeze_observers_after=None,
            blocks=None,
            target=None,
            select=select,
        )
        return quantize(model, spec, qparams=qparams, progress=False)

    def activation_qparams(self, handle: Handle) -> dict[str, Tensor]:
        return handle.qparams()

    def fresh_build(
        self, handle: Handle, build: Callable[[], nn.Module], architecture: Callable[[], nn.Module]
    ) -> Callable[[], nn.Module]:
        """``quantize.target`` folded BatchNorms: a fresh model takes the folded structure."""
        if not handle.folded:
            return build
        return lambda: folded_structure(build(), handle.folded)


class QuantizeStep(Step):
    """Fake-quantized weights (in place, guarded) and activations (hooks)."""

    name, settings, offloadable = "quantize", QuantizeConfig, True
    reporting = QuantizeReport()
    checking = QuantizeChecks()

    def apply(self, model: nn.Module, settings: QuantizeConfig, run: StepRun) -> Handle:
        handle = quantize(model, settings, calibration=run.calibration, work=run.work)
        if isinstance(handle, QuantizeHandle) and handle.weights:  # measured now: the checks bake the handle
            handle.storage = weight_storage(handle)
        return handle

    def calibration(self, settings: QuantizeConfig) -> Calibration | None:
        return Calibration(settings.calibration_batches, field="quantize") if settings.calibrated else None


register_step(QuantizeStep())
