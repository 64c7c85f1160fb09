"""The ``kv_cache`` step: :func:`surgery.quantize_kv_cache` with a recipe's ``kv_cache:``
settings (the fields of :class:`~surgery.GridSpec`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from surgery.cli.fields import positive_int
from surgery.cli.steps.base import Calibration, Row, Step, StepRun, register_step
from surgery.cli.steps.step_checks import StepChecks
from surgery.cli.steps.step_report import StepReport
from surgery.core.handles import Handle
from surgery.ops.numerics.grid import GridSpec
from surgery.ops.quantization.kv_cache import kv_cache_bytes, kv_projections, quantize_kv_cache
from surgery.ops.quantization.quantization import quantize


@dataclass(frozen=True)
class KvCacheConfig(GridSpec):
    """``kv_cache:``: how keys and values are rounded (int8, symmetric, per channel by default;
    ``format: fp8_e4m3``), and the calibration batches their scales come from."""

    symmetric: bool = True
    per_channel: bool = True
    calibration_batches: int = 4

    def __post_init__(self) -> None:
        self.validate("kv_cache")  # errors name kv_cache.<key>
        super().__post_init__()
        positive_int("kv_cache.calibration_batches", self.calibration_batches)

    @property
    def spec(self) -> GridSpec:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(GridSpec)}
        return GridSpec.build(fields, "kv_cache")


class KvCacheReport(StepReport):
    """What the ``kv_cache`` step reports."""

    def report(self, handle: Handle, settings: KvCacheConfig, run: StepRun, report: dict[str, Any]) -> None:
        model = handle.model
        report["kv_cache"] = {
            "bytes_per_token": {"before": kv_cache_bytes(model), "after": kv_cache_bytes(model, settings.spec)},
            "layers": len(kv_projections(model)),
        }

    def summary(self, report: dict[str, Any]) -> list[str]:
        """The cache's bytes per token before and after."""
        found = report.get("kv_cache")
        if found is None:
            return []
        size = found["bytes_per_token"]
        return [
            f"kv_cache: {size['before']:,} -> {size['after']:,} bytes per token over {found['layers']} cached "
            f"projections ({size['after'] / max(size['before'], 1):.3f}x)"
        ]


class KvCacheChecks(StepChecks):
    """How the ``kv_cache`` step answers the dry run and the checks."""

    def preview(self, model: nn.Module, settings: KvCacheConfig) -> list[Row]:
        return [
            ("kv_cache", "matched", name, type(layer).__name__, "its outputs are cached")
            for name, layer in kv_projections(model).items()
        ]

    def reattach(self, model: nn.Module, settings: KvCacheConfig, qparams: dict[str, Tensor] | Any) -> Handle | None:
        layers = list(kv_projections(model))
        return quantize(model, weights=None, activations=settings.spec, select=layers, qparams=qparams, progress=False)

    def activation_qparams(self, handle: Handle) -> dict[str, Tensor]:
        return handle.qparams()


class KvCacheStep(Step):
    """The keys and values attention caches, fake-quantized where ``k_proj``/``v_proj`` write
    them; re-attached from the saved parameters after baking, as activation quantization is."""

    name, settings = "kv_cache", KvCacheConfig
    reporting = KvCacheReport()
    checking = KvCacheChecks()

    def apply(self, model: nn.Module, settings: KvCacheConfig, run: StepRun) -> Handle:
        return quantize_kv_cache(model, settings.spec, calibration=run.calibration)

    def calibration(self, settings: KvCacheConfig) -> Calibration | None:
        return Calibration(settings.calibration_batches, field="kv_cache")


register_step(KvCacheStep())
