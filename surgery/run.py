"""Run one recipe: build, operate, check, report and export; return the exit code."""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn
from tqdm import tqdm

from surgery import checks
from surgery.checkpoints import save_checkpoint
from surgery.comparison import compare
from surgery.config import RunConfig
from surgery.data import make_batches
from surgery.errors import ConfigError
from surgery.models import model_factory
from surgery.reporting import checks_rows, layer_rows, parameter_counts, summary_table, write_reports
from surgery.steps import apply_steps, find

EXIT_OK, EXIT_CHECK_FAILED, EXIT_BAD_INPUT = 0, 1, 2


@dataclass
class RunResult:
    """What a run produced: the report (as written to ``report.json``) and the files."""

    report: dict[str, Any]
    files: list[Path]

    @property
    def exit_code(self) -> int:
        return EXIT_OK if self.report["ok"] else EXIT_CHECK_FAILED


def run(config: RunConfig, out_dir: str | Path, *, echo: bool = True) -> RunResult:
    """Execute ``config`` and write its report, plot and baked checkpoint into ``out_dir``.

    Raises:
        SurgeryError: for bad configuration or input (the CLI turns it into exit code 2).
    """
    out_dir = Path(out_dir)
    checkpoint = out_dir / f"model.{config.output.checkpoint}"
    _refuse_existing([out_dir / "report.json", checkpoint], config.output.overwrite)
    started = time.perf_counter()
    factory = model_factory(config.model, config.seed)
    model, inputs = factory(), make_batches(config.data)
    reference = copy.deepcopy(model)
    built = time.perf_counter()
    handle = apply_steps(model, config)
    operated = time.perf_counter()
    sparsity = _sparsity(handle)
    results, drift = _run_checks(config, model, reference, handle, factory, inputs, checkpoint)
    finished = time.perf_counter()
    report = {
        "recipe": config.recipe, "model": config.model.name, "ok": all(c.passed for c in results),
        "params": parameter_counts(model), "sparsity": sparsity["overall"],
        "checks": checks_rows(results), "drift": drift.as_dict(),
        "layers": layer_rows(model, sparsity["layers"]),
        "timings_s": {"build": built - started, "surgery": operated - built, "checks": finished - operated},
        "steps": list(config.steps), "checkpoint": checkpoint.name if checkpoint.exists() else None,
    }
    files = write_reports(report, out_dir, plots=config.output.plots)
    if echo:
        print(summary_table(report))
        print(f"  wrote {', '.join(str(f) for f in files + [checkpoint] if f.exists())}")
    return RunResult(report, files)


def _refuse_existing(paths: list[Path], overwrite: bool) -> None:
    for path in paths:
        if path.exists() and not overwrite:
            raise ConfigError("output", str(path), "already exists; pass output.overwrite=true to replace it")


def _sparsity(handle) -> dict[str, Any]:
    pruning = find(handle, "prune")
    if pruning is None:
        return {"overall": 0.0, "layers": {}}
    return {"overall": pruning.sparsity(), "layers": pruning.layer_sparsity()}


def _run_checks(config: RunConfig, model: nn.Module, reference: nn.Module, handle, factory, inputs, checkpoint: Path):
    enabled = set(config.checks.enabled)
    expected = checks.collect(reference, inputs)
    drift = compare(reference, model, inputs)

    def apply(subject: nn.Module, neutral: bool):
        return apply_steps(subject, config, neutral=neutral)

    results: list[checks.CheckResult] = []
    progress = tqdm(total=5, desc="checks", unit="check", leave=False)
    if "identity" in enabled:
        results.append(checks.check_identity(reference, apply, inputs, expected))
    progress.update()
    if "restore" in enabled:
        results.append(checks.check_restore(reference, apply, inputs, expected))
    progress.update()
    bake, baked = checks.check_bake(model, handle, factory, inputs)
    if "bake" in enabled:
        results.append(bake)
    progress.update()
    save_checkpoint(model, checkpoint, overwrite=config.output.overwrite)
    if "save_load" in enabled:
        results.append(checks.check_save_load(checkpoint, factory, inputs, baked))
    progress.update()
    if "drift" in enabled:
        results.append(checks.check_drift(drift, config.checks.drift))
    progress.update()
    progress.close()
    return results, drift
