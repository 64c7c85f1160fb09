"""Sweeps (``-m``): what each job did, recorded by the job itself in whatever process the
launcher ran it, and the summary (table, metric-vs-setting plot, exit code) built from those
records, so the basic, joblib and submitit launchers give the same result.

:class:`SweepCallback` (a Hydra callback, in ``conf/config.yaml``) gives each sweep a token
when it starts; every job writes ``<sweep dir>/.surgery-jobs/<token>/<job>.json`` when it
starts and again when it ends. A job whose last record is "started" died; a report left in
its folder by an earlier sweep is never read.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from surgery.core.checkpoints import Staging, refuse_existing, write_atomically
from surgery.core.folders import claimed

SUMMARY = ("sweep.json", "sweep.md", "sweep.png")
METRICS = (("drift.cosine", "cosine"), ("drift.top1_agreement", "top-1 agreement"), ("sparsity", "sparsity"))
TOKEN_ENV = "SURGERY_SWEEP_TOKEN"
RECORDS = ".surgery-jobs"
CURRENT = "current"  # under RECORDS: the token of the sweep running into the folder
EXIT_CODES = {"ok": 0, "check_failed": 1, "bad_input": 2, "crashed": 1, "started": 1, "dry_run": 0}
_current: dict[str, Any] = {}  # the sweep this process started: {"dir": Path, "token": str}


@dataclass
class JobRecord:
    """What one job of a sweep did: ``status`` is ``started`` (still running, or died),
    ``ok``, ``check_failed``, ``bad_input``, ``crashed`` or ``dry_run`` (``select_only``: no
    report, left out of the summary); ``folder`` is its output folder."""

    num: int
    overrides: dict[str, str]
    folder: str
    status: str
    error: str | None = None
    objective: float | None = None  # the job's score, in a search (hydra/sweeper=optuna)

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.status]

    @property
    def has_report(self) -> bool:
        """Whether this job (in this sweep) published a report: it ran to the end."""
        return self.status in ("ok", "check_failed") and (Path(self.folder) / "report.json").is_file()


class SweepCallback(Callback):
    """Gives each sweep a token: job processes inherit it through the environment, and it is
    written into the sweep folder for a launcher's worker kept from an earlier sweep of this
    process (joblib reuses them), whose inherited token is that sweep's."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        token = uuid.uuid4().hex
        sweep_dir = Path(str(config.hydra.sweep.dir)).resolve()
        (sweep_dir / RECORDS / token).mkdir(parents=True, exist_ok=True)
        write_atomically(sweep_dir / RECORDS / CURRENT, lambda tmp: tmp.write_text(token))
        os.environ[TOKEN_ENV] = token
        _current.update(dir=sweep_dir, token=token)


def forget_sweep() -> None:
    """Start a command line with no sweep: one run in this process after a sweep is not part of it."""
    _current.clear()


def current_sweep() -> tuple[Path, str] | None:
    """(sweep folder, token) of the sweep this process started, if any."""
    return (_current["dir"], _current["token"]) if _current else None


def record_job(sweep_dir: Path, record: JobRecord) -> None:
    """Write (or update) a job's record, atomically, under the sweep's token."""
    records = Path(sweep_dir).resolve() / RECORDS
    token = os.environ.get(TOKEN_ENV, "untracked")
    if not (records / token).is_dir() and (records / CURRENT).is_file():  # an ended sweep's token
        token = (records / CURRENT).read_text().strip() or token
    path = records / token / f"{record.num}.json"
    text = json.dumps(asdict(record))
    write_atomically(path, lambda tmp: tmp.write_text(text + "\n"))


def read_records(sweep_dir: Path, token: str) -> list[JobRecord]:
    """The records of one sweep's jobs, by job number."""
    folder = Path(sweep_dir) / RECORDS / token
    records = [JobRecord(**json.loads(p.read_text())) for p in folder.glob("*.json")] if folder.is_dir() else []
    return sorted(records, key=lambda r: r.num)


def finish_sweep(launcher_error: str | None = None) -> tuple[int, list[Path], list[JobRecord]]:
    """Summarise the sweep this process started: (exit code, summary files, job records).

    The exit code is the worst of the jobs' (a job that died counts as 1) and at least 1 if
    the launcher itself failed. The records are removed once the summary is written.
    """
    sweep = current_sweep()
    if sweep is None:
        return (1 if launcher_error else 0), [], []
    sweep_dir, token = sweep
    try:
        records = [r for r in read_records(sweep_dir, token) if r.status != "dry_run"]  # they write nothing
        code = max([r.exit_code for r in records] + [1 if launcher_error else 0])
        files = write_sweep_summary(sweep_dir, records, launcher_error=launcher_error)
    finally:
        shutil.rmtree(sweep_dir / RECORDS / token, ignore_errors=True)
        current = sweep_dir / RECORDS / CURRENT
        if current.is_file() and current.read_text().strip() == token:
            current.unlink()
        if (sweep_dir / RECORDS).is_dir() and not any((sweep_dir / RECORDS).iterdir()):
            (sweep_dir / RECORDS).rmdir()
    return code, files, records


def swept_keys(jobs: list[dict[str, str]]) -> list[str]:
    """Override keys whose value differs between jobs, in command-line order."""
    keys = list(dict.fromkeys(k for job in jobs for k in job))
    return [k for k in keys if len({job.get(k) for job in jobs}) > 1]


def _metric(report: dict[str, Any], path: str) -> float | None:
    value: Any = report
    for part in path.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def write_sweep_summary(
    sweep_dir: Path, records: list[JobRecord], *, overwrite: bool | None = None, launcher_error: str | None = None
) -> list[Path]:
    """Write ``sweep.json``, ``sweep.md`` and ``sweep.png``: one row per job with its status;
    metrics only from reports the job published in this sweep.

    The three files are written atomically and published together (``sweep.json`` last); an
    existing summary raises :class:`~surgery.core.errors.OutputExistsError` before anything is
    written unless ``overwrite`` — by default, whether the jobs were run with
    ``output.overwrite=true``.
    """
    sweep_dir = Path(sweep_dir)
    if not records:
        return []
    if overwrite is None:
        overwrite = any(str(r.overrides.get("output.overwrite", "")).lower() == "true" for r in records)
    keys = swept_keys([r.overrides for r in records]) or list(records[0].overrides)[:1]
    searched = any(record.objective is not None for record in records)
    table = [_row(record, keys, sweep_dir, searched) for record in records]
    failed = (
        []
        if launcher_error is None
        else [{"job": None, "status": "launcher failed", "ok": False, "error": launcher_error}]
    )  # jobs without a record never ran
    text = json.dumps(table + failed, indent=2)
    markdown = _markdown(table, launcher_error)
    with claimed(sweep_dir), Staging(sweep_dir) as stage:
        refuse_existing([sweep_dir / name for name in SUMMARY], overwrite)
        write_atomically(stage / "sweep.json", lambda tmp: tmp.write_text(text + "\n"))
        write_atomically(stage / "sweep.md", lambda tmp: tmp.write_text(markdown))
        write_atomically(stage / "sweep.png", lambda tmp: _plot(table, keys, tmp))
        published = stage.publish(overwrite=overwrite, last="sweep.json")
    return [sweep_dir / name for name in SUMMARY if sweep_dir / name in published]


def _row(record: JobRecord, keys: list[str], sweep_dir: Path, searched: bool = False) -> dict[str, Any]:
    report = json.loads((Path(record.folder) / "report.json").read_text()) if record.has_report else {}
    status = "died (no final record)" if record.status == "started" else record.status
    return {
        "job": os.path.relpath(Path(record.folder).resolve(), sweep_dir.resolve()),
        **{k: record.overrides.get(k) for k in keys},
        "status": status,
        "ok": report.get("ok", False),
        **{label: _metric(report, path) for path, label in METRICS},
        **({"objective": record.objective} if searched else {}),
        "error": record.error,
    }


def _markdown(table: list[dict[str, Any]], launcher_error: str | None) -> str:
    columns = list(table[0])
    lines = ["# sweep summary", ""]
    if launcher_error:
        lines += [f"**The launcher failed:** {launcher_error}", ""]
    lines += ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    for row in table:
        cells = [f"{v:.4f}" if isinstance(v, float) else str(v).replace("|", "\\|") for v in row.values()]
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
        ax.set_xticks(
            xs, [", ".join(f"{k}={table[i][k]}" for k in keys) for i in order], rotation=30, ha="right", fontsize=7
        )
    ax.set_xlabel(keys[0] if numeric else "job")
    ax.set_ylim(-0.05, 1.05)
    ax.grid(alpha=0.3)
    if ax.lines:  # no job with a report: no line, and no legend (matplotlib would warn on stderr)
        ax.legend()
    else:
        ax.text(0.5, 0.5, "no job published a report", ha="center", va="center", transform=ax.transAxes)
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
