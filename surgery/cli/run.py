"""Run one recipe: build, operate, check, report and export; return the exit code."""

from __future__ import annotations

import copy
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from surgery.analysis.comparison import compare
from surgery.analysis.inspection import (
    calls_as_rows,
    format_table,
    gradient_statistics,
    gradients_as_rows,
    inspect_model,
)
from surgery.cli import checks
from surgery.cli.build import neutral, rules_from_config
from surgery.cli.config import RunConfig
from surgery.cli.data import Data, calibration_batches, calibration_pairs, load_data, with_model_defaults
from surgery.cli.models import ModelBuilder, check_runs
from surgery.cli.outputs import batch_of, classification_loss, first_sample, logits_of
from surgery.cli.reporting import checks_rows, layer_rows, parameter_counts, summary_table, write_reports
from surgery.cli.steps import apply_steps, find, reattach, saved_qparams
from surgery.core.checkpoints import Staging, refuse_existing, save_checkpoint, save_tensors, write_atomically
from surgery.core.errors import ConfigError, OutputExistsError
from surgery.core.folders import claimed
from surgery.core.handles import HandleGroup, restored_on_error
from surgery.core.inputs import as_call
from surgery.ops.criteria import as_criterion
from surgery.ops.finetuning import FinetuneHandle
from surgery.ops.sensitivity import sensitivity
from surgery.ops.shrinking import ShrinkHandle, rebuild
from surgery.ops.weight_methods import weight_method
from surgery.testing import global_hook_counts

EXIT_OK, EXIT_CHECK_FAILED, EXIT_BAD_INPUT = 0, 1, 2
QPARAMS = "model.qparams.safetensors"
PLAN = "plan.yaml"  # per-layer amounts from recipe=sensitivity, for prune.amounts
PLAN_JSON = "model.plan.json"  # the shrunk layers' shapes, for surgery.rebuild
log = logging.getLogger("surgery")
# Every file any run may write: a run refuses a folder holding one of them (unless overwriting)
# and, when overwriting, replaces the whole earlier set, so no stale file of another run stays.
OUTPUTS = (
    "report.json",
    "report.md",
    "model.safetensors",
    "model.pt",
    QPARAMS,
    "sparsity.png",
    "drift.png",
    "finetune.png",
    "gradients.png",
    "sensitivity.png",
    PLAN,
    PLAN_JSON,
    "widths.png",
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
            refuse_existing([out_dir / name for name in OUTPUTS], config.output.overwrite)
            with stage:
                report = _execute(config, stage)
                files = stage.publish(overwrite=config.output.overwrite, last="report.json", replaces=OUTPUTS)
    except OutputExistsError:  # a FileExistsError, but no failure to write
        raise
    except KeyboardInterrupt as err:  # the CLI says whether the outputs were published
        err.published = stage.published  # type: ignore[attr-defined]
        raise
    except OSError as err:  # disk full, read-only or vanished folder: nothing was published
        where = err.filename if err.filename is not None else out_dir
        raise ConfigError(
            "output", str(where), f"cannot be written ({err.strerror or err}); nothing was written"
        ) from None
    if echo:
        if "modules_table" in report:
            print(report["modules_table"])
        print(summary_table(report))
        print(f"  wrote {', '.join(str(f) for f in files)}")
    return RunResult(report, files)


def _execute(config: RunConfig, stage: Staging) -> dict[str, Any]:
    """Build, operate, check; write every output into ``stage``; return the report."""
    started = time.perf_counter()
    models = _build(config)
    config.data = with_model_defaults(config.data, models.reference)  # e.g. the vocabulary of data=tokens
    data, calibration = load_data(config.data), _calibration(config)
    inputs = data.inputs
    check_runs(models.reference, inputs, config.model.name)
    calls = inspect_model(models.model, inputs) if config.inspect else None
    gradients = _gradients(models.model, data) if config.inspect else None
    layer_sensitivity = _sensitivity(config, models.model, data, stage.path) if config.sensitivity else None
    built = time.perf_counter()
    with restored_on_error():  # no optimizer step hook outlives a failure
        handle = apply_steps(models.model, config, calibration=calibration)
        operated = time.perf_counter()
        sparsity = _sparsity(handle)
        files = _Files(stage / f"model.{config.output.checkpoint}", stage / QPARAMS, calibration)
        accuracy = _accuracy(models, data)
        results, drift = _run_checks(config, models, handle, inputs, files, accuracy)
        finished = time.perf_counter()
        report = {
            "recipe": config.recipe,
            "model": config.model.name,
            "ok": all(c.passed for c in results),
            "params": parameter_counts(models.model),
            "sparsity": sparsity["overall"],
            "sparsity_over": sparsity["over"],
            "selection": selections(handle),
            "checks": checks_rows(results),
            "drift": drift.as_dict(),
            "layers": layer_rows(models.model, sparsity["layers"], drift.layers),
            "timings_s": {"build": built - started, "surgery": operated - built, "checks": finished - operated},
            "build": [vars(event) for event in models.builder.events],
            "steps": list(config.steps),
            "checkpoint": files.checkpoint.name if files.checkpoint.exists() else None,
            "qparams": files.qparams.name if files.qparams.exists() else None,
        }
        tuned = find(handle, "finetune")
        if isinstance(tuned, FinetuneHandle) and tuned.curve:
            report["finetune"] = {
                **vars(config.finetune),
                "steps": tuned.curve[-1].step,
                "curve": [vars(point) for point in tuned.curve],
            }
            if accuracy is not None:  # before fine-tuning = after the surgery steps before it
                accuracy["before_finetune"] = tuned.curve[0].score
        if accuracy is not None:
            report["accuracy"] = accuracy
        perplexities = _perplexity(models, config, data)
        if perplexities is not None:
            report["perplexity"] = perplexities
        if calls is not None:
            report["modules"], report["modules_table"] = calls_as_rows(calls), format_table(calls)
        if gradients is not None:
            report["gradients"] = gradients
        if layer_sensitivity is not None:
            report["sensitivity"] = layer_sensitivity
        shrunk = find(handle, "shrink")
        if isinstance(shrunk, ShrinkHandle):
            report["shrink"] = _shrink_report(shrunk, models, inputs, config.shrink.latency_batches)
    write_reports(report, stage.path, plots=config.output.plots)
    return report


@dataclass
class _Files:
    checkpoint: Path
    qparams: Path
    calibration: dict[str, Any]


def _calibration(config: RunConfig) -> dict[str, Any]:
    """Calibration batches by step, for the steps whose settings need them (a warning when the
    data holds fewer batches than asked)."""
    found = _calibration_by_step(config)
    for step, batches in found.items():
        asked = getattr(getattr(config, step), "calibration_batches", 1)
        if len(batches) < asked:
            log.warning(
                "%s.calibration_batches=%d: the %s training split holds %d batches of %d; using those",
                step,
                asked,
                config.data.kind,
                len(batches),
                config.data.batch_size,
            )
    return found


def _calibration_by_step(config: RunConfig) -> dict[str, Any]:
    found: dict[str, Any] = {}
    if "shrink" in config.steps:  # the batch the coupling is traced on
        found["shrink"] = list(calibration_batches(config.data, 1))
    if "quantize" in config.steps and config.quantize.calibrated:
        found["quantize"] = calibration_batches(config.data, config.quantize.calibration_batches)
    prune = config.prune
    if "prune" in config.steps and prune.calibrated:
        if as_criterion(prune.method).needs_gradients:
            found["prune"] = calibration_pairs(config.data, prune.calibration_batches, "prune.method")
        else:
            found["prune"] = calibration_batches(config.data, prune.calibration_batches)
    return found


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
    from surgery.cli.digits import accuracy

    reference, candidate = accuracy(models.reference, data.labelled()), accuracy(models.model, data.labelled())
    return {"reference": reference, "candidate": candidate, "drop_points": 100.0 * (reference - candidate)}


def _sensitivity(config: RunConfig, model: nn.Module, data: Data, folder: Path) -> dict[str, Any]:
    """Each selected layer pruned alone at each amount (``recipe=sensitivity``), measured by
    perplexity (``data=tinylm``), accuracy (labelled data) or output drift; with a target
    sparsity, the per-layer plan, also written as ``plan.yaml`` for ``prune.amounts``."""
    settings = config.sensitivity
    if config.data.kind == "tinylm":
        from surgery.cli.tinylm import perplexity

        measure = {"evaluate": lambda m: perplexity(m, list(data.labelled())), "higher_is_better": False}
    elif data.labels is not None:
        from surgery.cli.digits import accuracy

        measure = {"evaluate": lambda m: accuracy(m, data.labelled()), "higher_is_better": True}
    else:
        measure = {"inputs": data.inputs}
    weights = settings.weight_spec()
    quantizing = settings.bits is not None
    calibrated = (
        weights is not None and weight_method(weights.method).needs_calibration
        if quantizing
        else as_criterion(settings.method).needs_calibration
    )
    table = sensitivity(
        model,
        settings.amounts,
        method=settings.method,
        select=settings.select,
        exclude=settings.exclude or None,
        progress=True,
        bits=settings.bits,
        weights=weights,
        calibration=calibration_batches(config.data, settings.calibration_batches) if calibrated else None,
        **measure,
    )
    method = (weights.method if weights else "rtn") if quantizing else settings.method
    result = {
        "metric": "perplexity"
        if config.data.kind == "tinylm"
        else "accuracy"
        if data.labels is not None
        else "drift (1 - cosine)",
        "kind": table.kind,
        "baseline": table.baseline,
        "higher_is_better": table.higher_is_better,
        "method": method,
        "rows": table.as_rows(),
    }
    if settings.target_sparsity is not None:
        plan = table.plan(settings.target_sparsity)
        result["plan"] = {"target_sparsity": settings.target_sparsity, "amounts": plan}
        lines = [
            f"# per-layer amounts from recipe={config.recipe} ({result['metric']}, target sparsity "
            f"{settings.target_sparsity:g} over these layers); use: prune.amounts=<this file>"
        ]
        lines += [f"{json.dumps(layer)}: {amount}" for layer, amount in plan.items()]
        write_atomically(folder / PLAN, lambda tmp: tmp.write_text("\n".join(lines) + "\n"))
    return result


def _shrink_report(handle: ShrinkHandle, models: _Models, inputs: list, batch_sizes: list[int]) -> dict[str, Any]:
    """Parameters, MACs, measured latency dense vs shrunk (one thread, interleaved rounds,
    median), the coupled families and each changed layer's width before and after."""
    sample = first_sample(inputs[0])
    latency = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for size in batch_sizes:
            x = as_call(batch_of(sample, size), "data")
            times: dict[str, list[float]] = {"dense": [], "shrunk": []}
            with torch.no_grad():
                for round_ in range(7):
                    for name, model in (("dense", models.reference), ("shrunk", models.model))[
                        :: 1 if round_ % 2 else -1
                    ]:
                        start = time.perf_counter()
                        x(model)
                        times[name].append(time.perf_counter() - start)
            dense, shrunk = (sorted(times[k][1:])[len(times[k][1:]) // 2] for k in ("dense", "shrunk"))
            latency[str(size)] = {"dense_ms": 1000 * dense, "shrunk_ms": 1000 * shrunk, "ratio": shrunk / dense}
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


def _width(layer: nn.Module) -> int | None:
    """A layer's output width (channels, features)."""
    for attr in ("out_channels", "out_features", "num_features", "num_channels"):
        if isinstance(getattr(layer, attr, None), int):
            return getattr(layer, attr)
    shape = getattr(layer, "normalized_shape", None)
    return shape[-1] if shape else None


def _perplexity(models: _Models, config: RunConfig, data: Data) -> dict[str, float] | None:
    """Held-out perplexity of the unmodified and the modified language model (``data=tinylm``)."""
    if config.data.kind != "tinylm":
        return None
    from surgery.cli.tinylm import perplexity

    pairs = list(data.labelled())
    return {"reference": perplexity(models.reference, pairs), "candidate": perplexity(models.model, pairs)}


def _build(config: RunConfig) -> _Models:
    builder = ModelBuilder(config.model, config.seed, rules_from_config(config.build))
    hooks_before = global_hook_counts()
    model = builder()
    hooks_after = global_hook_counts()
    built = copy.deepcopy(model)
    reference = builder.with_rules([])() if builder.rules else built
    return _Models(builder, reference, built, model, hooks_before, hooks_after)


def _sparsity(handle: HandleGroup) -> dict[str, Any]:
    pruning = find(handle, "prune")
    if pruning is None:
        return {"overall": 0.0, "layers": {}, "over": {"parameters": 0, "entries": 0}}
    over = {"parameters": len(pruning.parameters), "entries": sum(m.numel() for m in pruning.masks().values())}
    return {"overall": pruning.sparsity(), "layers": pruning.layer_sparsity(), "over": over}


def selections(handle: HandleGroup) -> dict[str, dict[str, list]]:
    """What each step matched and skipped (and why), by step kind."""
    return {h.kind: h.selection.as_dict() for h in handle.handles if getattr(h, "selection", None) is not None}


def _run_checks(
    config: RunConfig,
    models: _Models,
    handle: HandleGroup,
    inputs: list,
    files: _Files,
    accuracy: dict[str, float] | None,
):
    enabled, rules, steps = set(config.checks.enabled), models.builder.rules, bool(config.steps)
    drift = compare(models.reference, models.model, inputs, per_layer=config.checks.per_layer)

    def apply(subject: nn.Module, neutral_settings: bool) -> HandleGroup:
        return apply_steps(subject, config, neutral=neutral_settings, calibration=files.calibration)

    qparams = saved_qparams(handle)
    shrinking = find(handle, "shrink")
    factory = models.builder
    if isinstance(shrinking, ShrinkHandle):  # the smaller shapes
        plan = shrinking.plan()

        def factory() -> nn.Module:
            return rebuild(models.builder.architecture, plan)

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
        if isinstance(shrinking, ShrinkHandle):
            text = json.dumps(shrinking.plan(), indent=2)
            write_atomically(files.checkpoint.with_name(PLAN_JSON), lambda tmp: tmp.write_text(text + "\n"))
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
