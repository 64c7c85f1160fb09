"""The ``sensitivity`` step: each selected layer pruned (or quantized) alone at each setting
and measured; with a target sparsity, the per-layer amounts reaching it, written as
``amounts.yaml``."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from surgery.cli.fields import positive_int
from surgery.cli.formatting import fmt, pyplot, save_figure
from surgery.cli.steps.base import Calibration, Row, Step, StepRun, register_step, target_rows
from surgery.cli.steps.step_checks import StepChecks
from surgery.cli.steps.step_report import StepReport
from surgery.core.checkpoints import write_atomically
from surgery.core.errors import ConfigError
from surgery.core.handles import Handle
from surgery.ops.numerics.grid import GridSpec
from surgery.ops.numerics.weight_methods import method_of
from surgery.ops.offload.offloading import Offloaded
from surgery.ops.quantization.spec import DEFAULT_WEIGHTS, QuantizeSpec
from surgery.ops.sensitivity.sensitivity import sensitivity
from surgery.ops.sparsity.criteria import as_criterion
from surgery.ops.sparsity.pruning import prune_targets
from surgery.ops.sparsity.spec import validate_arguments

AMOUNTS = "amounts.yaml"  # per-layer amounts, for prune.amounts


@dataclass(frozen=True)
class SensitivityConfig:
    """``sensitivity:``: the arguments of :func:`surgery.sensitivity`, measured by the task's
    metric (accuracy with labelled data, perplexity for ``data=tinylm``, else output drift);
    with ``target_sparsity``, the per-layer amounts reaching it, written to ``amounts.yaml``."""

    amounts: list[float] = field(default_factory=lambda: [0.25, 0.5, 0.75, 0.9])
    method: str = "l1_unstructured"
    select: Any = None
    exclude: Any = None
    target_sparsity: float | None = None
    calibration_batches: int = 8  # for calibrated methods (wanda, sparsegpt, gptq)
    bits: list[int] | None = None  # quantize each layer's weight alone at these widths instead of pruning
    weights: GridSpec | None = None  # with bits: the other weight settings (default int8 per channel)
    quantize_method: Any = None  # with bits: the weight method (gptq, {name: gptq, damping: 0.02}); default rtn

    def __post_init__(self) -> None:
        validate_arguments(0.5, self.method, "layer", 2.0, 0)
        positive_int("sensitivity.calibration_batches", self.calibration_batches)
        if isinstance(self.weights, dict):
            object.__setattr__(self, "weights", GridSpec.build(self.weights, "sensitivity.weights"))
        if self.bits is not None:
            quantizing = QuantizeSpec(weights=self.weights or DEFAULT_WEIGHTS, method=self.quantize_method)
            object.__setattr__(self, "weights", quantizing.weights if self.weights is not None else None)
            object.__setattr__(self, "quantize_method", quantizing.method)
        if self.bits is not None and self.target_sparsity is not None:
            raise ConfigError(
                "sensitivity.target_sparsity",
                self.target_sparsity,
                "plans pruning amounts, and sensitivity.bits measures quantization; "
                "pass sensitivity.target_sparsity=null with it",
            )
        for width in self.bits or []:
            if not 2 <= width <= 8:
                raise ConfigError("sensitivity.bits", width, "each bit width must be an integer in [2, 8]")
        for amount in self.amounts:
            if isinstance(amount, bool) or not isinstance(amount, (int, float)) or not 0.0 < amount <= 1.0:
                raise ConfigError("sensitivity.amounts", amount, "each amount must be a number in (0, 1]")
        target, largest = self.target_sparsity, max(self.amounts, default=0.0)
        if target is not None and not 0.0 <= target <= largest:
            raise ConfigError(
                "sensitivity.target_sparsity",
                target,
                f"must be null or a number in [0, {largest:g}] (the largest amount tried)",
            )

    @property
    def calibrated(self) -> bool:
        if self.bits is not None:
            return method_of(self.quantize_method).needs_calibration
        return as_criterion(self.method).needs_calibration


class SensitivityReport(StepReport):
    """What the ``sensitivity`` step reports."""

    outputs = (AMOUNTS, "plan.yaml", "sensitivity.png")  # plan.yaml: AMOUNTS before 0.3, replaced on overwrite

    def offloaded_stages(self, handle: Handle) -> dict[str, Any] | None:
        """A scan compresses each block of an offloaded model on its own: no block walk to report."""
        return None

    def report(self, handle: Handle, settings: SensitivityConfig, run: StepRun, report: dict[str, Any]) -> None:
        report["sensitivity"] = handle.result

    def summary(self, report: dict[str, Any]) -> list[str]:
        """The score of each layer at each amount (or bit width), and the plan."""
        return sensitivity_summary(report) if "sensitivity" in report else []

    def markdown(self, report: dict[str, Any]) -> list[str]:
        return ["", *sensitivity_markdown(report)] if "sensitivity" in report else []

    def plots(self, report: dict[str, Any]) -> dict[str, Callable[[dict[str, Any], Path], None]]:
        return {"sensitivity.png": plot_sensitivity} if report.get("sensitivity", {}).get("rows") else {}


class SensitivityChecks(StepChecks):
    """How the ``sensitivity`` step answers the dry run and the checks."""

    def preview(self, model: nn.Module, settings: SensitivityConfig) -> list[Row]:
        return target_rows("sensitivity", prune_targets(model, settings.select, settings.exclude), {}, "")


class SensitivityStep(Step):
    """Measures and changes nothing: every trial is restored."""

    name, settings, changes_model, offloadable = "sensitivity", SensitivityConfig, False, True
    reporting = SensitivityReport()
    checking = SensitivityChecks()

    def apply(self, model: nn.Module, settings: SensitivityConfig, run: StepRun) -> Handle:
        handle = Handle(self.name, model.model if isinstance(model, Offloaded) else model)
        handle.result = _measure(model, settings, run)  # offloaded: each trial compresses one block, then restores it
        return handle

    def calibration(self, settings: SensitivityConfig) -> Calibration | None:
        return Calibration(settings.calibration_batches, field="sensitivity") if settings.calibrated else None


def _measure(model: nn.Module, settings: SensitivityConfig, run: StepRun) -> dict[str, Any]:
    metric = run.metric
    measure: dict[str, Any] = {} if metric is None else {"evaluate": metric[1], "higher_is_better": metric[2]}
    batches = run.calibration if run.calibration is not None else run.inputs  # drift: on these too
    quantizing = settings.bits is not None
    table = sensitivity(
        model,
        settings.amounts,
        method=settings.method,
        select=settings.select,
        exclude=settings.exclude or None,
        progress=True,
        bits=settings.bits,
        weights=settings.weights,
        quantize_method=settings.quantize_method if quantizing else None,
        calibration=batches,
        **measure,
    )
    method = method_of(settings.quantize_method).name if quantizing else settings.method
    result = {
        "metric": "drift (1 - cosine)" if metric is None else metric[0],
        "kind": table.kind,
        "baseline": table.baseline,
        "higher_is_better": table.higher_is_better,
        "method": method,
        "rows": table.as_rows(),
    }
    if settings.target_sparsity is not None:
        amounts = table.amounts_for(settings.target_sparsity)
        result["plan"] = {"target_sparsity": settings.target_sparsity, "amounts": amounts}
        lines = [
            f"# per-layer amounts from recipe={run.config.recipe} ({result['metric']}, target sparsity "
            f"{settings.target_sparsity:g} over these layers); use: prune.amounts=<this file>"
        ]
        lines += [f"{json.dumps(layer)}: {amount}" for layer, amount in amounts.items()]
        write_atomically(run.folder / AMOUNTS, lambda tmp: tmp.write_text("\n".join(lines) + "\n"))
    return result


register_step(SensitivityStep())


def sensitivity_summary(report: dict[str, Any]) -> list[str]:
    """The grid as text lines for the terminal, and the plan."""
    result = report["sensitivity"]
    layers, amounts, grid = sensitivity_grid(report)
    lines = [
        f"sensitivity ({result['metric']}, unchanged {result['baseline']:.4g}), layer x "
        f"{'weight bits' if result.get('kind') == 'quantize' else 'amount'}:",
        "  " + " " * 24 + "".join(f"{a:>9g}" for a in amounts),
    ]
    lines += ["  " + f"{layer[:24]:<24}" + "".join(f"{v:>9.4g}" for v in row) for layer, row in zip(layers, grid)]
    if "plan" in result:
        lines.append(
            f"amounts for {result['plan']['target_sparsity']:g} sparsity: "
            + ", ".join(f"{k} {v:.3g}" for k, v in result["plan"]["amounts"].items())
        )
    return lines


def sensitivity_markdown(report: dict[str, Any]) -> list[str]:
    """The sensitivity table (score per layer and amount) and the plan, as markdown lines."""
    result = report["sensitivity"]
    layers, amounts, grid = sensitivity_grid(report)
    lines = [
        f"## Sensitivity ({result['metric']}; {'higher' if result['higher_is_better'] else 'lower'} is better; "
        f"unchanged {result['baseline']:.4g})",
        "",
        f"Each layer {'quantized' if result.get('kind') == 'quantize' else 'pruned'} alone by {result['method']}.",
        "",
        "| layer | " + " | ".join(f"{a:g}" for a in amounts) + " |",
        "| --- |" + " --- |" * len(amounts),
    ]
    lines += [f"| {layer} | " + " | ".join(fmt(v) for v in row) + " |" for layer, row in zip(layers, grid)]
    if "plan" in result:
        plan = result["plan"]
        lines += [
            "",
            f"Amounts reaching {plan['target_sparsity']:g} sparsity over these layers (amounts.yaml, for `prune.amounts`):",
            "",
            "| layer | amount |",
            "| --- | --- |",
        ]
        lines += [f"| {layer} | {amount:.4g} |" for layer, amount in plan["amounts"].items()]
    return lines


def sensitivity_grid(report: dict[str, Any]) -> tuple[list[str], list[float], list[list[float | None]]]:
    """(layers, amounts, score per layer and amount) of a sensitivity report."""
    rows = report["sensitivity"]["rows"]
    layers = list(dict.fromkeys(row["layer"] for row in rows))
    amounts = sorted({row["setting"] for row in rows}, reverse=report["sensitivity"].get("kind") == "quantize")
    found = {(row["layer"], row["setting"]): row["score"] for row in rows}
    return layers, amounts, [[found.get((layer, amount)) for amount in amounts] for layer in layers]


def plot_sensitivity(report: dict[str, Any], path: Path) -> None:
    """Heatmap of the damage (score worse than unpruned) of each layer pruned alone at each amount."""
    plt = pyplot()
    result = report["sensitivity"]
    layers, amounts, _ = sensitivity_grid(report)
    damage = {(row["layer"], row["setting"]): row["damage"] for row in result["rows"]}
    grid = [[damage.get((layer, amount), float("nan")) for amount in amounts] for layer in layers]
    fig, ax = plt.subplots(figsize=(1.4 * len(amounts) + 3.5, 0.35 * len(layers) + 1.8))
    image = ax.imshow(grid, aspect="auto", cmap="magma_r")
    ax.set_xticks(range(len(amounts)), [f"{a:g}" for a in amounts])
    ax.set_yticks(range(len(layers)), layers)
    quantized = result.get("kind") == "quantize"
    ax.set_xlabel("weight bits (this layer alone)" if quantized else "amount pruned (this layer alone)")
    top = max((v for row in grid for v in row if v == v), default=0.0)
    for i, row in enumerate(grid):
        for j, value in enumerate(row):
            color = "white" if value > 0.6 * top else "black"
            ax.text(j, i, f"{value:.3g}", ha="center", va="center", fontsize=7, color=color)
    lost = "lost" if result["higher_is_better"] else "gained"
    fig.colorbar(image, ax=ax, label=f"damage ({result['metric']} {lost})")
    ax.set_title(f"{report['recipe']}: which layers of {report['model']} hurt most ({result['method']})")
    save_figure(fig, path)
