"""The number a search optimises, from a run's report (``objective:`` with ``hydra/sweeper=optuna``)."""

from __future__ import annotations

from typing import Any

from surgery.cli.config import OBJECTIVE_METRICS, ObjectiveConfig

WORST = 1e9  # what a run without a report (bad input, crash) scores: never chosen, never aborts the search
IDENTICAL_SQNR_DB = 1000.0  # identical outputs have no noise (report: null); float64 itself stops near 313 dB


def metric(report: dict[str, Any], name: str) -> float | None:
    """The value of objective metric ``name`` in ``report`` (None when the report lacks it).
    ``sqnr_db`` of outputs identical to the reference, which the report holds as null, is
    :data:`IDENTICAL_SQNR_DB`: the best a run can do, not a missing value."""
    value: Any = report
    for key in OBJECTIVE_METRICS[name][0].split("."):
        value = value.get(key) if isinstance(value, dict) else None
    if value is None and name == "sqnr_db" and _identical(report):
        return IDENTICAL_SQNR_DB
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _identical(report: dict[str, Any]) -> bool:
    drift = report.get("drift") if isinstance(report, dict) else None
    return isinstance(drift, dict) and drift.get("max_abs") == 0.0


def shortfall(report: dict[str, Any], bounds: dict[str, float]) -> float:
    """How far the report misses its ``subject_to`` bounds, summed (0 when all hold; a
    missing or non-finite metric counts as missing its bound by 1)."""
    total = 0.0
    for name, bound in bounds.items():
        value = metric(report, name)
        if value is None or value != value:
            total += 1.0
        elif OBJECTIVE_METRICS[name][1] == "min":
            total += max(0.0, bound - value)
        else:
            total += max(0.0, value - bound)
    return total


def objective_value(config: ObjectiveConfig, report: dict[str, Any] | None) -> float:
    """The search's score of one run: the metric, moved by ``penalty × (1 + shortfall)`` in the
    bad direction when a bound is missed, and the worst score when there is no report."""
    maximize = config.maximize is not None
    worst = -WORST if maximize else WORST
    if report is None:
        return worst
    value = metric(report, config.maximize or config.minimize)
    if value is None or value != value:
        return worst
    missed = shortfall(report, config.subject_to)
    if missed > 0:
        value += (-1 if maximize else 1) * config.penalty * (1.0 + missed)
    return value
