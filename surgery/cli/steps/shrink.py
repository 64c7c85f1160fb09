"""The ``shrink`` step: :func:`surgery.shrink` with a recipe's ``shrink:`` settings, and its
report: parameters, MACs, measured latency and each changed layer's width."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from surgery.cli.fields import positive_int
from surgery.cli.formatting import pyplot, save_figure
from surgery.cli.outputs import batch_of, first_sample
from surgery.cli.steps.base import Calibration, Row, Step, StepRun, register_step
from surgery.cli.steps.step_checks import StepChecks
from surgery.cli.steps.step_report import StepReport
from surgery.core.handles import Handle
from surgery.core.inputs import as_call
from surgery.core.layer_kinds import is_kind
from surgery.core.selection import select
from surgery.ops.shrink.rebuilding import rebuild
from surgery.ops.shrink.shrinking import ShrinkHandle, ShrinkSpec, shrink


def _producer(module: nn.Module) -> bool:
    """A layer whose output channels shrink may remove: a kind it rebuilds smaller that is not a norm."""
    return is_kind(module, lambda kind: kind.smaller is not None and kind.normalises is None)


@dataclass(frozen=True)
class ShrinkConfig(ShrinkSpec):
    """``shrink:``: the fields of :class:`~surgery.ShrinkSpec` (traced on one batch of the
    data's calibration split), and ``latency_batches``, the batch sizes timed dense against
    shrunk (one thread)."""

    latency_batches: list[int] = field(default_factory=lambda: [1, 8])

    def __post_init__(self) -> None:
        super().__post_init__()
        for size in self.latency_batches:
            positive_int("shrink.latency_batches", size)


STRUCTURE_JSON = "model.plan.json"  # the recorded shrunk structure, for surgery.rebuild (file name kept)


class ShrinkReport(StepReport):
    """What the ``shrink`` step reports."""

    outputs = (STRUCTURE_JSON, "widths.png")

    def files(self, handle: Handle) -> dict[str, str]:
        return {STRUCTURE_JSON: json.dumps(handle.structure(), indent=2) + "\n"}

    def report(self, handle: Handle, settings: ShrinkConfig, run: StepRun, report: dict[str, Any]) -> None:
        if isinstance(handle, ShrinkHandle):
            report["shrink"] = shrink_report(handle, run.reference, run.inputs, settings.latency_batches)

    def summary(self, report: dict[str, Any]) -> list[str]:
        """Parameters and MACs before and after, and the measured latency."""
        if "shrink" not in report:
            return []
        shrunk = report["shrink"]
        params, macs = shrunk["params"], shrunk["macs"]
        lines = [
            f"shrink: params {params['before']:,} -> {params['after']:,} "
            f"({params['after'] / params['before']:.3f}x), MACs {macs['before']:,} -> {macs['after']:,} "
            f"({macs['after'] / max(macs['before'], 1):.3f}x)"
        ]
        return lines + [
            f"  latency batch {size}: dense {row['dense_ms']:.1f} ms, shrunk {row['shrunk_ms']:.1f} ms "
            f"({row['ratio']:.3f}x, 1 thread)"
            for size, row in shrunk["latency"].items()
        ]

    def markdown(self, report: dict[str, Any]) -> list[str]:
        return shrink_markdown(report["shrink"]) if "shrink" in report else []

    def plots(self, report: dict[str, Any]) -> dict[str, Callable[[dict[str, Any], Path], None]]:
        return {"widths.png": plot_widths} if report.get("shrink", {}).get("widths") else {}


class ShrinkChecks(StepChecks):
    """How the ``shrink`` step answers the dry run and the checks."""

    def neutral(self, model: nn.Module, settings: ShrinkConfig, run: StepRun) -> Handle:
        return shrink(model, dataclasses.replace(settings, amount=0.0), calibration=run.calibration[0])

    def fresh_build(
        self, handle: Handle, build: Callable[[], nn.Module], architecture: Callable[[], nn.Module]
    ) -> Callable[[], nn.Module]:
        """The original class built at the smaller shapes (:func:`surgery.rebuild`)."""
        recorded = handle.structure()
        return lambda: rebuild(architecture, recorded)

    def preview(self, model: nn.Module, settings: ShrinkConfig) -> list[Row]:
        """The layers whose output channels shrink may remove (which go is known only after the trace)."""
        if settings.select is None:
            layers = dict(model.named_modules())
            if settings.exclude:
                excluded = select(model, settings.exclude, field="shrink.exclude")
                layers = {n: m for n, m in layers.items() if n not in excluded}
        else:
            layers = select(
                model, settings.select, exclude=settings.exclude, field="shrink.select", exclude_field="shrink.exclude"
            )
        return [
            ("shrink", "matched", name or "(root)", type(m).__name__, "output channels may go")
            for name, m in layers.items()
            if _producer(m)
        ]


class ShrinkStep(Step):
    """Coupled channels removed for real: smaller layers of the same classes."""

    name, settings = "shrink", ShrinkConfig
    reporting = ShrinkReport()
    checking = ShrinkChecks()

    def apply(self, model: nn.Module, settings: ShrinkConfig, run: StepRun) -> Handle:
        return shrink(model, settings, calibration=run.calibration[0])

    def calibration(self, settings: ShrinkConfig) -> Calibration | None:
        return Calibration(1, field="shrink")  # the batch the coupling is traced on


def shrink_report(handle: ShrinkHandle, reference: nn.Module, inputs: list, batch_sizes: list[int]) -> dict[str, Any]:
    """Parameters, MACs, measured latency dense vs shrunk (one thread, interleaved rounds,
    median), the coupled families and each changed layer's width before and after."""
    sample = first_sample(inputs[0])
    latency = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for size in batch_sizes:
            latency[str(size)] = _latency(as_call(batch_of(sample, size), "data"), reference, handle.model)
    finally:
        torch.set_num_threads(threads)
    widths = {name: [_width(old), _width(new)] for name, (old, new) in handle.replaced.items()}
    heads = {name: {attr: list(pair) for attr, pair in changes.items()} for name, changes in handle.attributes.items()}
    return {
        "params": handle.params(),
        "macs": handle.macs(),
        "latency": latency,
        "families": handle.families,
        "frozen_ops": handle.frozen_ops,
        "widths": widths,
        "heads": heads,
    }


def _latency(call: Any, dense_model: nn.Module, shrunk_model: nn.Module) -> dict[str, float]:
    times: dict[str, list[float]] = {"dense": [], "shrunk": []}
    with torch.no_grad():
        for round_ in range(7):
            for name, model in (("dense", dense_model), ("shrunk", shrunk_model))[:: 1 if round_ % 2 else -1]:
                start = time.perf_counter()
                call(model)
                times[name].append(time.perf_counter() - start)
    dense, shrunk = (sorted(times[k][1:])[len(times[k][1:]) // 2] for k in ("dense", "shrunk"))
    return {"dense_ms": 1000 * dense, "shrunk_ms": 1000 * shrunk, "ratio": shrunk / dense}


def _width(layer: nn.Module) -> int | None:
    """A layer's output width (channels, features)."""
    for attr in ("out_channels", "out_features", "num_features", "num_channels"):
        if isinstance(getattr(layer, attr, None), int):
            return getattr(layer, attr)
    shape = getattr(layer, "normalized_shape", None)
    return shape[-1] if shape else None


def shrink_markdown(shrunk: dict[str, Any]) -> list[str]:
    """Parameters, MACs, latency, families and heads of a shrink step."""
    lines = ["", "## Shrink", "", "| | before | after | ratio |", "| --- | --- | --- | --- |"]
    lines += [
        f"| {key} | {shrunk[key]['before']:,} | {shrunk[key]['after']:,} | "
        f"{shrunk[key]['after'] / max(shrunk[key]['before'], 1):.3f} |"
        for key in ("params", "macs")
    ]
    lines += [
        f"| latency, batch {size} (ms, 1 thread) | {row['dense_ms']:.1f} | {row['shrunk_ms']:.1f} | {row['ratio']:.3f} |"
        for size, row in shrunk["latency"].items()
    ]
    lines += ["", "Coupled families (layers producing the same channels):", ""]
    lines += ["| layers | channels | removed | frozen |", "| --- | --- | --- | --- |"]
    lines += [
        f"| {', '.join(f['layers'][:4])}{' ...' if len(f['layers']) > 4 else ''} | {f['channels']} | "
        f"{f['removed']} | {f['frozen']} |"
        for f in shrunk["families"]
    ]
    if shrunk.get("heads"):
        lines += ["", "Attention heads:", "", "| module | attribute | before | after |", "| --- | --- | --- | --- |"]
        lines += [
            f"| {name} | {attr} | {old} | {new} |"
            for name, changes in shrunk["heads"].items()
            for attr, (old, new) in changes.items()
        ]
    if shrunk.get("frozen_ops"):
        lines += ["", f"Channels kept by: {', '.join(shrunk['frozen_ops'])}."]
    return lines


def plot_widths(report: dict[str, Any], path: Path) -> None:
    """Each shrunk layer's output width before and after, in model order."""
    plt = pyplot()
    widths = report["shrink"]["widths"]
    names = list(widths)
    fig, ax = plt.subplots(figsize=(max(8.0, 0.12 * len(names) + 2), 4.5))
    ax.bar(range(len(names)), [w[0] for w in widths.values()], color="#C8C8C8", label="before")
    ax.bar(range(len(names)), [w[1] for w in widths.values()], color="#4C72B0", label="after")
    ax.set_xticks(range(len(names)), names, rotation=90, fontsize=5)
    ax.set_ylabel("output channels / features")
    ax.legend()
    ax.set_title(f"{report['recipe']}: {report['model']} layer widths")
    save_figure(fig, path)


register_step(ShrinkStep())
