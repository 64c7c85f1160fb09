"""The five round-trip checks of a run: identity, restore, bake, save_load, drift."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from surgery.analysis.audits import max_difference, snapshot, snapshot_differences
from surgery.analysis.comparison import Drift
from surgery.cli.config import DriftThresholds, RunConfig
from surgery.core._compat import module_hook_counts
from surgery.core.checkpoints import load_checkpoint
from surgery.core.handles import restored_on_error
from surgery.core.inputs import batches, evaluating, outputs
from surgery.ops.export.exporting import export
from surgery.ops.export.format_table import EXPORT_FORMATS
from surgery.ops.export.parity import ExportParityError, ExportRecord


@dataclass
class CheckResult:
    """One row of ``report.json`` ``checks``."""

    name: str
    passed: bool
    value: float | None = None
    threshold: float | None = None
    detail: str = ""


def compare_outputs(a: nn.Module, b: nn.Module, inputs) -> tuple[bool, float]:
    """(bit-identical?, largest absolute difference) of two models' outputs, batch by batch:
    both run on each batch in turn (eval mode, no grad) and nothing outlives its batch, so
    memory does not grow with the number of batches."""
    identical, worst = True, 0.0
    with evaluating(a), evaluating(b), torch.no_grad():
        for batch in batches(inputs):
            same, difference = max_difference(outputs(a, batch), outputs(b, batch))
            identical, worst = identical and same, max(worst, difference)
    return identical, worst


Apply = Callable[[nn.Module, bool], object]  # (model, neutral) -> handle


def check_identity(reference: nn.Module, apply: Apply, inputs) -> CheckResult:
    """Neutral settings on a copy of the reference give bit-identical outputs."""
    subject = copy.deepcopy(reference)
    with restored_on_error():
        handle = apply(subject, True)
        identical, worst = compare_outputs(subject, reference, inputs)
        handle.restore()
    return CheckResult("identity", identical, worst, 0.0, "" if identical else "neutral surgery changed outputs")


def check_build_identity(neutral_build: Callable[[], nn.Module], inputs, plain: nn.Module) -> CheckResult:
    """Build rules with neutral actions give outputs bit-identical to a plain build."""
    identical, worst = compare_outputs(neutral_build(), plain, inputs)
    return CheckResult("identity", identical, worst, 0.0, "" if identical else "neutral build rules changed outputs")


def check_build_hooks(before: dict[str, int], after: dict[str, int]) -> CheckResult:
    """The global registration hooks are gone once the build is over."""
    diffs = [f"global {k}: {v} -> {after.get(k)}" for k, v in before.items() if after.get(k) != v]
    return CheckResult("restore", not diffs, float(len(diffs)), 0.0, "; ".join(diffs))


def merge(results: list[CheckResult], name: str) -> CheckResult:
    """Several parts of one check as one row: passed if all passed, the worst value."""
    if not results:
        return CheckResult(name, True, None, None, "nothing to check")
    values = [r.value for r in results if r.value is not None]
    return CheckResult(
        name,
        all(r.passed for r in results),
        max(values) if values else None,
        results[0].threshold,
        "; ".join(r.detail for r in results if r.detail),
    )


def check_restore(reference: nn.Module, apply: Apply, inputs) -> CheckResult:
    """Apply then restore on a copy: tensors, keys, classes, hooks and outputs as before."""
    subject = copy.deepcopy(reference)
    before = snapshot(subject)
    with restored_on_error():
        apply(subject, False).restore()
    diffs = snapshot_differences(before, snapshot(subject))
    identical, worst = compare_outputs(subject, reference, inputs)
    if not identical:
        diffs.append("outputs changed")
    return CheckResult("restore", not diffs, worst, 0.0, "; ".join(diffs[:5]))


Reattach = Callable[[nn.Module], object]  # re-attaches unbakeable parts; returns a handle or None


def _release(handle: object) -> None:
    if handle is not None:
        handle.restore()


def check_bake(model: nn.Module, handle, factory: Callable[[], nn.Module], inputs, reattach: Reattach) -> CheckResult:
    """Baking keeps the hooked outputs bit for bit, leaves no hook, and loads strictly.

    A copy of the hooked model stands for it once it is baked, so both run side by side, one
    batch at a time. What cannot be folded into weights (activation quantization) is
    re-attached from its saved parameters, without calibration, on the baked model and on the
    fresh instance.
    """
    hooked = copy.deepcopy(model)
    handle.bake()
    leftover = sum(module_hook_counts(model).values())
    extra = reattach(model)
    try:
        identical, worst = compare_outputs(hooked, model, inputs)
        del hooked
        problems = [] if identical else ["baked outputs differ from hooked outputs"]
        if leftover:
            problems.append(f"{leftover} hook(s) left on the baked model")
        fresh = factory()
        fresh.load_state_dict(model.state_dict(), strict=True)
        fresh_extra = reattach(fresh)
        try:
            if not compare_outputs(fresh, model, inputs)[0]:
                problems.append("a fresh instance loaded with the baked state_dict gives other outputs")
        finally:
            _release(fresh_extra)
    finally:
        _release(extra)
    return CheckResult("bake", not problems, worst, 0.0, "; ".join(problems))


def check_save_load(
    path: Path, factory: Callable[[], nn.Module], inputs, baked: nn.Module, reattach: Reattach, reattach_saved: Reattach
) -> CheckResult:
    """The written checkpoint (and saved quantization parameters), loaded into a fresh
    instance, reproduce the baked model's outputs."""
    fresh = load_checkpoint(factory(), path)
    extra = reattach(baked)
    try:
        fresh_extra = reattach_saved(fresh)
        try:
            identical, worst = compare_outputs(fresh, baked, inputs)
        finally:
            _release(fresh_extra)
    finally:
        _release(extra)
    return CheckResult("save_load", identical, worst, 0.0, "" if identical else f"{path.name} gives other outputs")


def check_drift(drift: Drift, bounds: DriftThresholds, accuracy: dict[str, float] | None = None) -> CheckResult:
    """Original vs modified outputs (and accuracy, with labelled data) stay within bounds."""
    failures = []
    counts = drift.nonfinite
    if counts.reference:
        failures.append(
            f"the reference model's own outputs hold {counts.describe('reference')} values, so drift "
            "cannot be measured (check its weights, buffers and inputs)"
        )
    if counts.candidate:
        failures.append(f"the modified model's outputs hold {counts.describe('candidate')} values")
    if failures:
        return CheckResult("drift", False, None, bounds.min_cosine, "; ".join(failures))
    drop = None if accuracy is None else accuracy["drop_points"]
    # Written as "not within" so that a NaN metric (float64 sums overflowing on huge outputs) fails.
    if bounds.max_accuracy_drop is not None and drop is not None and not drop <= bounds.max_accuracy_drop:
        failures.append(f"accuracy drop {drop:.2f} points > {bounds.max_accuracy_drop}")
    if bounds.min_cosine is not None and not drift.cosine >= bounds.min_cosine:
        failures.append(f"cosine {drift.cosine:.4f} < {bounds.min_cosine}")
    if bounds.min_sqnr_db is not None and drift.sqnr_db is not None and not drift.sqnr_db >= bounds.min_sqnr_db:
        failures.append(f"SQNR {drift.sqnr_db:.2f} dB < {bounds.min_sqnr_db}")
    top1 = drift.top1_agreement
    if bounds.min_top1_agreement is not None and top1 is not None and not top1 >= bounds.min_top1_agreement:
        failures.append(f"top-1 agreement {top1:.3f} < {bounds.min_top1_agreement}")
    if bounds.max_abs is not None and not drift.max_abs <= bounds.max_abs:
        failures.append(f"max abs {drift.max_abs:.4g} > {bounds.max_abs}")
    explained = drift.attribution
    bound = bounds.min_attribution_cosine
    if bound is not None and explained is not None and not explained.mean_cosine >= bound:  # NaN fails
        failures.append(
            f"attribution cosine {explained.mean_cosine:.4f} < {bound} ({explained.method} at {explained.layer})"
        )
    return CheckResult("drift", not failures, drift.cosine, bounds.min_cosine, "; ".join(failures))


def check_deploy(record: ExportRecord, deploy: dict[str, Any] | None = None) -> CheckResult:
    """The exported artifact, reloaded in its runtime, against the model under surgery: equal
    for formats that dequantize exactly, else at least the format's cosine similarity (and its
    integer outputs' agreement); NaN or Inf on either side fails. A failed one was not written.
    A runtime the format is also made for (``deploy`` sections with ``holds``: llama.cpp) that
    misses its bound fails it too."""
    parity = record.parity
    if parity is None:
        return CheckResult("deploy", False, detail="no inputs to compare the export on")
    unwritten = "" if parity.holds else f"; {record.path.name} was not written"
    missed = [
        f"; {name} misses its bound ({figures.get('expected')}): "
        + (figures.get("error") or f"cosine mean {figures.get('cosine_mean')}, top-1 {figures.get('top1_agreement')}")
        for name, figures in (deploy or {}).items()
        if isinstance(figures, dict) and figures.get("holds") is False
    ]
    passed = parity.holds and not missed
    if parity.expected == "exact":
        detail = "bit-identical outputs" if parity.holds else parity.describe()
        return CheckResult(
            "deploy", passed, parity.max_abs, 0.0, f"{record.format}: {detail}{unwritten}{''.join(missed)}"
        )
    bound = float(parity.expected.removeprefix("cosine>="))
    detail = f"{record.format}: {parity.describe()}{unwritten}{''.join(missed)}"
    return CheckResult("deploy", passed, parity.cosine, bound, detail)


def export_checked(handle: object, path: Path, config: RunConfig, inputs: list) -> ExportRecord:
    """The run's export. With the ``deploy`` check (a format that runs) its parity with the model
    under surgery is measured on ``inputs``; an artifact that misses its format's promise is
    never written, and its record comes back for :func:`check_deploy` to fail (the run exits 1)."""
    deploying = "deploy" in config.checks.enabled and EXPORT_FORMATS.get(config.export.format).runnable
    try:
        return export(
            handle,
            path,
            format=config.export.format,
            inputs=inputs,
            compare=deploying,
            **config.export.options,
        )
    except ExportParityError as err:
        return err.record


def export_section(record: ExportRecord) -> dict:
    """``report.json`` ``export``: the record, and ``written: false`` when its deploy check failed."""
    unwritten = record.parity is not None and not record.parity.holds
    return record.as_dict() | ({"written": False} if unwritten else {})
