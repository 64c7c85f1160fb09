"""Run one recipe: build, operate, check, report and export; return the exit code."""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from surgery.analysis.attribution import attribution_drift
from surgery.analysis.comparison import Drift, compare
from surgery.analysis.inspection import (
    calls_as_rows,
    format_table,
    gradient_statistics,
    gradients_as_rows,
    inspect_model,
)
from surgery.cli import checks
from surgery.cli.applying import AppliedSteps, apply_steps, reattach, saved_qparams
from surgery.cli.build import neutral, rules_from_config
from surgery.cli.calibration import Metric, perplexity_of, step_calibration, task_metric
from surgery.cli.config import ExportConfig, RunConfig
from surgery.cli.data import Data, load_data, training_data, with_model_defaults
from surgery.cli.failures import os_error_as_config_error, with_cli_field
from surgery.cli.models import ModelBuilder, check_runs
from surgery.cli.offloaded_run import execute_offloaded
from surgery.cli.outputs import classification_loss, logits_of
from surgery.cli.report_builder import (
    NO_SPARSITY,
    add_coverage,
    add_export,
    add_perplexity,
    add_step_sections,
    build_report,
)
from surgery.cli.reporting import layer_rows, parameter_counts, plot_attribution, summary_table, write_reports
from surgery.cli.steps import STEPS, StepRun, step_named
from surgery.core._compat import global_hook_counts
from surgery.core.activations import activation_budget
from surgery.core.checkpoints import Staging, refuse_existing, save_checkpoint, save_tensors, write_atomically
from surgery.core.errors import ConfigError, OutputExistsError
from surgery.core.folders import claimed
from surgery.core.handles import HandleGroup, restored_on_error
from surgery.core.interrupts import raise_pending
from surgery.core.progress import tqdm
from surgery.ops.export.deploy_summary import deploy_summary
from surgery.ops.export.format_table import EXPORT_FORMATS
from surgery.ops.export.parity import ExportRecord

EXIT_OK, EXIT_CHECK_FAILED, EXIT_BAD_INPUT = 0, 1, 2
QPARAMS = "model.qparams.safetensors"
log = logging.getLogger("surgery")
# Every file any run may write: a run refuses a folder holding one of them (unless overwriting)
# and, when overwriting, replaces the whole earlier set, so no stale file of another run stays.
# A step names its own files (Step.outputs): a new step's plots are refused and replaced alike.
RUN_OUTPUTS = (
    "report.json",
    "report.md",
    "model.safetensors",
    "model.pt",
    QPARAMS,
    "sparsity.png",
    "drift.png",
    "attribution.png",
    "gradients.png",
)


@dataclass
class RunResult:
    """What a run produced: the report (as written to ``report.json``) and the files it wrote."""

    report: dict[str, Any]
    files: list[Path]

    @property
    def exit_code(self) -> int:
        return EXIT_OK if self.report["ok"] else EXIT_CHECK_FAILED


@dataclass
class _Models:
    """The models of one run: plain build, build with rules, and the one under surgery."""

    builder: ModelBuilder
    reference: nn.Module  # unmodified: no build rules, no runtime steps (drift baseline)
    built: nn.Module  # with build rules, before runtime steps
    model: nn.Module  # with build rules and runtime steps
    hooks_before: dict[str, int]
    hooks_after: dict[str, int]


def run(config: RunConfig, out_dir: str | Path, *, echo: bool = True) -> RunResult:
    """Execute ``config`` and write its report, plots and baked checkpoint into ``out_dir``.

    Nothing is written unless the whole run succeeds: every output is first written (each
    atomically) into a hidden folder inside ``out_dir`` and moved into place at the end,
    ``report.json`` last. A run that fails or is interrupted leaves ``out_dir`` as it found it.
    An existing output is refused before any work starts unless ``output.overwrite`` is set.

    Raises:
        SurgeryError: for bad configuration or input (the CLI turns it into exit code 2).
    """
    out_dir = Path(out_dir)
    stage = Staging(out_dir)
    try:
        with claimed(out_dir):  # from the existence check through publishing: a second run is refused
            outputs = run_outputs()
            refuse_existing([out_dir / name for name in outputs], config.output.overwrite)
            with stage:
                report = _execute(config, stage)
                raise_pending()  # safe points for an interrupt: before publishing, and after (one held back)
                files = stage.publish(overwrite=config.output.overwrite, last="report.json", replaces=outputs)
                raise_pending()
    except OutputExistsError:  # a FileExistsError, but no failure to write
        raise
    except KeyboardInterrupt as err:  # the CLI says whether the outputs were published
        err.published = stage.published  # type: ignore[attr-defined]
        raise
    except OSError as err:  # disk full, read-only or vanished folder, a missing input: nothing was published
        raise os_error_as_config_error(err, config, out_dir) from None
    except ConfigError as err:
        renamed = with_cli_field(err)
        if renamed is err:
            raise
        raise renamed from None
    if echo:
        if "modules_table" in report:
            print(report["modules_table"])
        print(summary_table(report))
        print(f"  wrote {', '.join(str(f) for f in files)}")
    return RunResult(report, files)


def run_outputs() -> tuple[str, ...]:
    """Every file a run may write: its own, those the registered steps name
    (:attr:`~surgery.cli.steps.Step.outputs`, a plugin's included) and each export's."""
    steps = sorted({name for step in STEPS.names() for name in STEPS.get(step).outputs})
    return (*RUN_OUTPUTS, *steps, *export_names())


def export_names() -> list[str]:
    """The file name an export of each registered format gets: any of them is an earlier run's
    output (an ``export.pt`` left by a run that exported is replaced by one that does not)."""
    return sorted({ExportConfig(format=name).file_name for name in EXPORT_FORMATS.names()})


def _execute(config: RunConfig, stage: Staging) -> dict[str, Any]:
    """Build, operate, check; write every output into ``stage``; return the report."""
    if config.model.offload:
        report = execute_offloaded(config, stage.path)
        write_reports(report, stage.path, plots=config.output.plots)
        return report
    started = time.perf_counter()
    models = _build(config)
    config.data = with_model_defaults(config.data, models.reference)  # e.g. the vocabulary of data=tokens
    data = load_data(config.data)
    inputs = data.inputs
    check_runs(models.reference, inputs, config.model.name)
    metric = task_metric(config, data)
    runs = _step_runs(config, models, data, stage.path, metric)
    calls = inspect_model(models.model, inputs) if config.inspect else None
    gradients = _gradients(models.model, data) if config.inspect else None
    built = time.perf_counter()
    with restored_on_error():  # no optimizer step hook outlives a failure
        with activation_budget(config.data.activation_budget, folder=config.data.activation_folder):
            handle = apply_steps(models.model, config, runs=runs)
        operated = time.perf_counter()
        sparsity = _sparsity(handle)
        files = _Files(stage / f"model.{config.output.checkpoint}", stage / QPARAMS, runs)
        accuracy = _accuracy(models, data)
        record = _export(config, stage, handle, inputs) if config.export.format is not None else None
        results, drift = _run_checks(config, models, handle, inputs, files, accuracy)
        timings = {"build": built - started, "surgery": operated - built, "checks": time.perf_counter() - operated}
        report = build_report(
            config,
            results,
            drift,
            parameter_counts(models.model),
            timings,
            sparsity=sparsity,
            selection=selections(handle),
            layers=layer_rows(models.model, sparsity["layers"], drift.layers),
            build=[vars(event) for event in models.builder.events],
            checkpoint=files.checkpoint.name if files.checkpoint.exists() else None,
            qparams=files.qparams.name if files.qparams.exists() else None,
        )
        add_coverage(report, config.checks.max_untouched)
        _add_measurements(report, models, drift, accuracy, metric)
        if calls is not None:
            report["modules"], report["modules_table"] = calls_as_rows(calls), format_table(calls)
        if gradients is not None:
            report["gradients"] = gradients
        add_step_sections(report, config, handle.handles, runs)
        add_export(report, record, lambda: deploy_summary(record, models.reference, inputs, metric))
    write_reports(report, stage.path, plots=config.output.plots)
    if config.output.plots and drift.attribution is not None:
        write_atomically(stage.path / "attribution.png", lambda tmp: plot_attribution(drift.attribution, tmp))
    return report


def _add_measurements(
    report: dict[str, Any], models: _Models, drift: Drift, accuracy: dict[str, float] | None, metric: Metric | None
) -> None:
    """``attribution``, ``accuracy`` and a language model's ``perplexity``, when measured."""
    if drift.attribution is not None:
        report["attribution"] = drift.attribution.as_dict()
    if accuracy is not None:
        report["accuracy"] = accuracy
    perplexity = perplexity_of(metric)
    if perplexity is not None:
        add_perplexity(report, perplexity(models.reference), perplexity(models.model))


def _export(config: RunConfig, stage: Staging, handle: HandleGroup, inputs: list) -> ExportRecord:
    """Write the export while the surgery is attached (deployment formats read its grids); with
    the ``deploy`` check, its parity with the model under surgery is measured on ``inputs`` and
    an artifact that misses it is not written (:func:`checks.export_checked`)."""
    return checks.export_checked(handle, stage / config.export.file_name, config, inputs)


@dataclass
class _Files:
    checkpoint: Path
    qparams: Path
    runs: dict[str, StepRun]


def _step_runs(
    config: RunConfig, models: _Models, data: Data, folder: Path, metric: tuple | None
) -> dict[str, StepRun]:
    """What each step is given: its calibration batches (a warning when the data holds fewer
    than asked), the training data, the reference model and the task's metric."""
    runs = {}
    for name in config.steps:
        runs[name] = StepRun(
            config,
            calibration=step_calibration(config, name),
            training=lambda batch_size: training_data(config.data, batch_size),
            folder=folder,
            reference=models.reference,
            inputs=data.inputs,
            data=data,
            metric=metric,
        )
    return runs


def _gradients(model: nn.Module, data: Data) -> dict[str, Any]:
    """Per-layer gradient statistics of the built model (``inspect``): cross-entropy against the
    labels, or, for unlabelled data, against the model's own top-1 predictions."""
    labelled = data.labels is not None
    pairs = list(data.labelled()) if labelled else [(x, None) for x in data.inputs]

    def loss(output: Any, target: Any) -> Any:
        return classification_loss(output, logits_of(output).argmax(-1) if target is None else target)

    rows, mechanism = gradient_statistics(model, pairs, loss)
    return {
        "loss": "cross-entropy vs " + ("labels" if labelled else "the model's own top-1 (no labels)"),
        "mechanism": mechanism,
        "layers": gradients_as_rows(rows),
    }


def _accuracy(models: _Models, data: Data) -> dict[str, float] | None:
    """Top-1 accuracy of the unmodified and the modified model, when the data has labels."""
    if data.labels is None:
        return None
    from surgery.analysis.metrics import accuracy

    reference, candidate = accuracy(models.reference, data.labelled()), accuracy(models.model, data.labelled())
    return {"reference": reference, "candidate": candidate, "drop_points": 100.0 * (reference - candidate)}


def _build(config: RunConfig) -> _Models:
    builder = ModelBuilder(config.model, config.seed, rules_from_config(config.build))
    hooks_before = global_hook_counts()
    model = builder()
    hooks_after = global_hook_counts()
    built = copy.deepcopy(model)
    reference = builder.with_rules([])() if builder.rules else built
    return _Models(builder, reference, built, model, hooks_before, hooks_after)


def _sparsity(handle: AppliedSteps) -> dict[str, Any]:
    """``report.json``'s sparsity, from the first step that prunes."""
    found = (step.reporting.sparsity(part) for step, part in handle.pairs())
    return next((section for section in found if section is not None), NO_SPARSITY)


def selections(handle: HandleGroup) -> dict[str, dict[str, list]]:
    """What each step matched and skipped (and why), by step kind."""
    return {h.kind: h.selection.as_dict() for h in handle.handles if getattr(h, "selection", None) is not None}


def _drift(config: RunConfig, models: _Models, inputs: list) -> Drift:
    """The candidate's drift, with what both models look at on the first evaluation batches."""
    drift = compare(models.reference, models.model, inputs, per_layer=config.checks.per_layer)
    if config.attribution is None:
        return drift
    first = [inputs[i] for i in range(min(config.attribution.batches, len(inputs)))]  # a lazy sequence: no slices
    explained = attribution_drift(models.reference, models.model, first, config.attribution)
    return dataclasses.replace(drift, attribution=explained)


def _run_checks(
    config: RunConfig,
    models: _Models,
    handle: AppliedSteps,
    inputs: list,
    files: _Files,
    accuracy: dict[str, float] | None,
):
    enabled, rules = set(config.checks.enabled), models.builder.rules
    steps = any(step_named(name).changes_model for name in config.steps)
    drift = _drift(config, models, inputs)

    def apply(subject: nn.Module, neutral_settings: bool) -> HandleGroup:
        return apply_steps(subject, config, neutral=neutral_settings, checking=True, runs=files.runs)

    qparams = saved_qparams(handle)
    factory: Callable[[], nn.Module] = models.builder
    for step, part in handle.pairs():  # the smaller shapes of shrink, the folded structure of a target
        factory = step.checking.fresh_build(part, factory, models.builder.architecture)

    results: list[checks.CheckResult] = []
    # closed on errors too; drawn only on a terminal, so a later error line is never glued to it
    with tqdm(total=5, desc="checks", unit="check", leave=False, disable=None) as progress:
        if "identity" in enabled:
            parts = [checks.check_identity(models.built, apply, inputs)] if steps else []
            if rules:
                neutral_build = models.builder.with_rules(neutral(rules))
                parts.append(checks.check_build_identity(neutral_build, inputs, models.reference))
            results.append(checks.merge(parts, "identity"))
        progress.update()
        if "restore" in enabled:
            parts = [checks.check_restore(models.built, apply, inputs)] if steps else []
            if rules:
                parts.append(checks.check_build_hooks(models.hooks_before, models.hooks_after))
            results.append(checks.merge(parts, "restore"))
        progress.update()
        bake = checks.check_bake(models.model, handle, factory, inputs, lambda model: reattach(model, config, qparams))
        if "bake" in enabled:
            results.append(bake)
        progress.update()
        save_checkpoint(models.model, files.checkpoint)  # into the run's staging folder
        if qparams:
            save_tensors(qparams, files.qparams)
        for step, part in handle.pairs():
            for name, text in step.reporting.files(part).items():
                write_atomically(files.checkpoint.with_name(name), lambda tmp, text=text: tmp.write_text(text))
        if "save_load" in enabled:
            results.append(
                checks.check_save_load(
                    files.checkpoint,
                    factory,
                    inputs,
                    models.model,
                    lambda model: reattach(model, config, qparams),
                    lambda model: reattach(model, config, files.qparams),
                )
            )
        progress.update()
        if "drift" in enabled:
            results.append(checks.check_drift(drift, config.checks.drift, accuracy))
        progress.update()
    return results, drift
