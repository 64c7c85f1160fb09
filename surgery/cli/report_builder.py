"""``report.json`` assembled one way for every run, in memory or offloaded: the common fields,
the task's metric, each step's own section and the export's."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from surgery.analysis.comparison import Drift
from surgery.cli import checks
from surgery.cli.checks import CheckResult
from surgery.cli.reporting import checks_rows
from surgery.cli.steps import StepRun, step_named
from surgery.core.handles import Handle
from surgery.ops.export.parity import ExportRecord

NO_SPARSITY = {"overall": 0.0, "layers": {}, "over": {"parameters": 0, "entries": 0}}


def build_report(
    config: Any,
    results: list[CheckResult],
    drift: Drift,
    params: dict[str, int],
    timings: dict[str, float],
    **measured: Any,
) -> dict[str, Any]:
    """The fields every ``report.json`` holds; what a run did not measure is empty. ``measured``
    may give ``sparsity`` (a step's :meth:`~surgery.cli.steps.Step.sparsity` section),
    ``selection``, ``layers``, ``build``, ``checkpoint`` and ``qparams``."""
    sparsity = measured.get("sparsity") or NO_SPARSITY
    return {
        "recipe": config.recipe,
        "model": config.model.name,
        "ok": all(c.passed for c in results),
        "params": params,
        "sparsity": sparsity["overall"],
        "sparsity_over": sparsity["over"],
        "selection": measured.get("selection") or {},
        "checks": checks_rows(results),
        "drift": drift.as_dict(),
        "layers": measured.get("layers") or [],
        "timings_s": timings,
        "build": measured.get("build") or [],
        "steps": list(config.steps),
        "checkpoint": measured.get("checkpoint"),
        "qparams": measured.get("qparams"),
    }


def add_coverage(report: dict[str, Any], max_untouched: float) -> None:
    """A ``coverage`` check row when a step's selection reports its coverage: it fails when the
    step left more than ``max_untouched`` of the weight bytes unchanged without an exclusion."""
    covered = {kind: s["coverage"] for kind, s in report.get("selection", {}).items() if s.get("coverage")}
    if not covered:
        return
    kind, worst = max(covered.items(), key=lambda item: item[1]["left_share"])
    passed = worst["left_share"] <= max_untouched
    largest = next((t for t in worst["largest_left"] if t["reason"] != "excluded (exclude=)"), None)
    detail = (
        ""
        if passed or largest is None
        else (
            f"{kind} left {worst['left_share']:.0%} of the weight bytes unchanged, e.g. {largest['name']}: "
            f"{largest['reason']} (select or exclude them, or raise checks.max_untouched)"
        )
    )
    result = CheckResult("coverage", passed, worst["left_share"], max_untouched, detail)
    report["checks"].append(checks_rows([result])[0])
    report["ok"] = report["ok"] and passed


def add_perplexity(report: dict[str, Any], reference: float | None, candidate: float | None) -> None:
    """``perplexity``: the language model's held-out perplexity before and after (when measured)."""
    if reference is not None and candidate is not None:
        report["perplexity"] = {"reference": reference, "candidate": candidate}


def add_step_sections(
    report: dict[str, Any], config: Any, handles: Iterable[Handle], runs: dict[str, StepRun] | None = None
) -> None:
    """Each step's own section (its reporting's :meth:`~surgery.cli.steps.StepReport.report`), in step order."""
    for name, handle in zip(config.steps, handles):
        step_named(name).reporting.report(
            handle, config.settings(name), (runs or {}).get(name) or StepRun(config), report
        )
        peaks = getattr(getattr(handle, "sequential", None), "gpu_peak_bytes", None)
        if peaks:  # its blocks onloaded to a GPU (onload=cuda): each one's peak there
            report.setdefault("onload", {})[name] = {"blocks": len(peaks), "gpu_peak_bytes": peaks}


def add_export(
    report: dict[str, Any], record: ExportRecord | None, deploy: Callable[[], dict[str, Any]] | None = None
) -> None:
    """``export``, and for a deployment format its check row and (with ``deploy``, when the
    parity held and there is an artifact to time) the ``deploy`` section."""
    if record is None:
        return
    report["export"] = checks.export_section(record)
    if record.parity is None:
        return
    if record.parity.holds and deploy is not None:
        report["deploy"] = deploy()
    result = checks.check_deploy(record, report.get("deploy"))
    report["checks"].append(checks_rows([result])[0])
    report["ok"] = report["ok"] and result.passed
