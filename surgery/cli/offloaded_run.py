"""A recipe run on an offloaded model (``model.offload=true``): the weights stay in the
folder's files and every step works block by block, in bounded memory.

The reference outputs (and perplexity, for a language model's data) are measured offloaded
before any step; the steps (quantize, prune, smooth, sensitivity) take the offloaded handle;
the export streams the result; then drift is measured and ``restore()`` is checked to give the
reference outputs back bit for bit. The report's ``offloaded`` section says the peak memory,
the model's bytes and the seconds per block. There is no ``model.safetensors``: the export is
the artifact (an in-memory checkpoint would need the model in memory).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch

from surgery.analysis.comparison import compare
from surgery.cli import checks
from surgery.cli.calibration import Metric, perplexity_of, step_calibration, task_metric
from surgery.cli.config import RunConfig
from surgery.cli.data import Data, load_data, with_model_defaults
from surgery.cli.report_builder import add_export, add_perplexity, add_step_sections, build_report
from surgery.cli.steps import STEPS, Step, StepRun, step_named
from surgery.cli.steps.base import offloaded_stages
from surgery.core.activations import activation_budget
from surgery.core.errors import ConfigError
from surgery.core.handles import Handle
from surgery.core.hf_loading import refuse_custom_code
from surgery.core.inputs import batches, evaluating, outputs
from surgery.core.interrupts import raise_pending
from surgery.ops.offload.offloaded_compression import peak_resident_bytes, resident_bytes
from surgery.ops.offload.offloading import Offloaded, offloaded, return_freed_memory

log = logging.getLogger("surgery")


def execute_offloaded(config: RunConfig, folder: Path) -> dict[str, Any]:
    """Run ``config`` on ``model.path`` offloaded; write the export into ``folder``; the report."""
    started, resident = time.perf_counter(), resident_bytes()
    _refuse_in_memory_steps(config)
    if config.model.config:
        log.info("model.offload: %s/config.json builds the model; model.config is not used", config.model.path)
    refuse_custom_code(config.model.path, "model.path")  # named as the user wrote it
    return_freed_memory()  # this process is the run's own: a flat peak in depth (see its docstring)
    source = offloaded(config.model.path, device=config.model.device)  # blocks brought onto model.device
    config.data = with_model_defaults(config.data, source.model)  # the vocabulary of data=tokens, for calibration too
    data = load_data(config.data)
    inputs = list(data.inputs)
    metric = task_metric(config, data)
    perplexity = perplexity_of(metric)
    expected = _outputs(source, inputs)
    before = perplexity(source.model) if perplexity is not None else None
    built = time.perf_counter()
    pairs = _apply(config, source, folder, data, inputs, metric)
    operated = time.perf_counter()
    walked = [handle for step, handle in pairs if offloaded_stages(step, handle) is not None]
    record = None
    if config.export.format is not None:  # from the last step's compressed weights, or the source's
        last = walked[-1] if walked else source
        record = checks.export_checked(last, folder / config.export.file_name, config, inputs)
    drift = compare(_Outputs(expected), source.model, inputs)
    results = [checks.check_drift(drift, config.checks.drift)] if "drift" in config.checks.enabled else []
    after = perplexity(source.model) if perplexity is not None else None
    if "restore" in config.checks.enabled:
        results.append(_check_restore([handle for _, handle in pairs], source, inputs, expected))
    timings = {"build": built - started, "surgery": operated - built, "checks": time.perf_counter() - operated}
    report = build_report(config, results, drift, _parameter_counts(source), timings)
    report["offloaded"] = _offloaded_section(source, pairs, resident)
    skipped = sorted(set(config.checks.enabled) - {"drift", "restore", "deploy"})
    if skipped:
        log.info("model.offload: checks %s need the model in memory; drift and restore ran", ", ".join(skipped))
    add_perplexity(report, before, after)
    add_step_sections(report, config, [handle for _, handle in pairs])
    add_export(report, record)
    return report


def _refuse_in_memory_steps(config: RunConfig) -> None:
    """A one-line error for a step that cannot run on an offloaded model, naming those that can."""
    for name in config.steps:
        if not step_named(name).offloadable:
            usable = [step for step in STEPS.names() if STEPS.get(step).offloadable]
            raise ConfigError(
                "steps", name, f"does not run on an offloaded model (model.offload=true); use {', '.join(usable)}"
            )


def _apply(
    config: RunConfig, source: Offloaded, folder: Path, data: Data, inputs: list, metric: Metric | None
) -> list[tuple[Step, Handle]]:
    """Each step applied to the offloaded model, in order, beside its handle; on a failure
    those applied are restored, last first."""
    handles: list[Handle] = []
    steps: list[Step] = []
    try:
        with activation_budget(config.data.activation_budget, folder=config.data.activation_folder):
            for name in config.steps:
                raise_pending()  # a safe point for an interrupt: between steps
                run = StepRun(config, step_calibration(config, name), None, folder, None, inputs, data, metric)
                run.work = None if config.model.offload_folder is None else Path(config.model.offload_folder) / name
                steps.append(step_named(name))
                handles.append(steps[-1].apply(source, config.settings(name), run))
    except BaseException:
        for handle in reversed(handles):
            handle.restore()
        raise
    return list(zip(steps, handles))


def _outputs(source: Offloaded, inputs: list) -> list[list[torch.Tensor]]:
    with evaluating(source.model), torch.no_grad():
        return [outputs(source.model, call) for call in batches(inputs, "data")]


class _Outputs(torch.nn.Module):
    """The reference's outputs, measured before the steps, replayed batch by batch to ``compare``."""

    def __init__(self, outputs: list[list[torch.Tensor]]) -> None:
        super().__init__()
        self.outputs, self.index = outputs, 0

    def forward(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, ...]:
        found = self.outputs[self.index % len(self.outputs)]
        self.index += 1
        return tuple(found)


def _check_restore(
    handles: list[Handle], source: Offloaded, inputs: list, expected: list[list[torch.Tensor]]
) -> checks.CheckResult:
    for handle in reversed(handles):
        handle.restore()
    found = _outputs(source, inputs)
    equal = all(torch.equal(a, b) for want, got in zip(expected, found) for a, b in zip(want, got))
    detail = "" if equal else "restore() gives other outputs than the source files"
    return checks.CheckResult("restore", equal, None if equal else 0.0, 0.0, detail)


def _parameter_counts(source: Offloaded) -> dict[str, int]:
    """Parameters of the offloaded model, and those non-zero now (each tensor read once)."""
    params = list(source.model.parameters())
    total = sum(p.numel() for p in params)
    nonzero = sum(int(torch.count_nonzero(source.value_of(p))) for p in params)
    return {"total": total, "nonzero": nonzero}


def _offloaded_section(source: Offloaded, pairs: list[tuple[Step, Handle]], resident: int) -> dict[str, Any]:
    """Peak resident memory (and what the run added to the process it started in) against the
    model's bytes, and the seconds per block of each step that walked blocks."""
    model_bytes = sum(p.numel() * p.element_size() for p in source.model.parameters())
    peak = peak_resident_bytes()
    stages = ((step.name, offloaded_stages(step, handle)) for step, handle in pairs)
    return {
        "files": sorted(str(p) for p in source.files.paths),
        "source_scheme": source.source_scheme,  # the quantization the files ship in (fp8...), None: float
        "model_bytes": model_bytes,
        "peak_memory_bytes": peak,
        "added_memory_bytes": peak - resident,
        "added_over_model": (peak - resident) / model_bytes if model_bytes else None,
        "steps": {name: found for name, found in stages if found is not None},
    }
