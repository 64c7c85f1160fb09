"""Summaries of a ``-m`` sweep: one table and one metric-vs-setting plot over its jobs, written together."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from surgery.checkpoints import Staging, refuse_existing, write_atomically

SUMMARY = ("sweep.json", "sweep.md", "sweep.png")
METRICS = (("drift.cosine", "cosine"), ("drift.top1_agreement", "top-1 agreement"), ("sparsity", "sparsity"))


def swept_keys(jobs: list[dict[str, str]]) -> list[str]:
    """Override keys whose value differs between jobs, in command-line order."""
    keys = list(dict.fromkeys(k for job in jobs for k in job))
    return [k for k in keys if len({job.get(k) for job in jobs}) > 1]


def _metric(report: dict[str, Any], path: str) -> float | None:
    value: Any = report
    for part in path.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def write_sweep_summary(sweep_dir: Path, jobs: list[tuple[dict[str, str], Path]], *,
                        overwrite: bool | None = None) -> list[Path]:
    """Write ``sweep.json``, ``sweep.md`` and ``sweep.png`` for the jobs that wrote a report.

    The three files are written atomically and published together (``sweep.json`` last); an
    existing summary raises :class:`~surgery.errors.OutputExistsError` before anything is
    written unless ``overwrite`` — by default, whether the jobs were run with
    ``output.overwrite=true``.
    """
    sweep_dir = Path(sweep_dir)
    rows = [(overrides, json.loads((folder / "report.json").read_text()), folder)
            for overrides, folder in jobs if (folder / "report.json").is_file()]
    if not rows:
        return []
    if overwrite is None:
        overwrite = any(str(o.get("output.overwrite", "")).lower() == "true" for o, _ in jobs)
    refuse_existing([sweep_dir / name for name in SUMMARY], overwrite)
    keys = swept_keys([overrides for overrides, _, _ in rows]) or list(rows[0][0])[:1]
    table = [{"job": os.path.relpath(folder.resolve(), sweep_dir.resolve()), **{k: overrides.get(k) for k in keys}, "ok": report["ok"],
              **{label: _metric(report, path) for path, label in METRICS}} for overrides, report, folder in rows]
    text, markdown = json.dumps(table, indent=2), _markdown(table)
    with Staging(sweep_dir) as stage:
        write_atomically(stage / "sweep.json", lambda tmp: tmp.write_text(text + "\n"))
        write_atomically(stage / "sweep.md", lambda tmp: tmp.write_text(markdown))
        write_atomically(stage / "sweep.png", lambda tmp: _plot(table, keys, tmp))
        published = stage.publish(overwrite=overwrite, last="sweep.json")
    return [sweep_dir / name for name in SUMMARY if sweep_dir / name in published]


def _markdown(table: list[dict[str, Any]]) -> str:
    columns = list(table[0])
    lines = ["# sweep summary", "", "| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    for row in table:
        cells = [f"{v:.4f}" if isinstance(v, float) else str(v) for v in row.values()]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _plot(table: list[dict[str, Any]], keys: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    numeric = len(keys) == 1 and all(_is_number(row[keys[0]]) for row in table)
    order = sorted(range(len(table)), key=lambda i: float(table[i][keys[0]])) if numeric else range(len(table))
    xs = [float(table[i][keys[0]]) if numeric else n for n, i in enumerate(order)]
    fig, ax = plt.subplots(figsize=(7, 4))
    for _, label in METRICS:
        ys = [table[i][label] for i in order]
        if any(y is not None for y in ys):
            ax.plot(xs, [float("nan") if y is None else y for y in ys], marker="o", label=label)
    if not numeric:
        ax.set_xticks(xs, [", ".join(f"{k}={table[i][k]}" for k in keys) for i in order], rotation=30, ha="right",
                      fontsize=7)
    ax.set_xlabel(keys[0] if numeric else "job")
    ax.set_ylim(-0.05, 1.05)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("sweep: drift and sparsity by setting")
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=110)
    plt.close(fig)


def _is_number(value: Any) -> bool:
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return True
