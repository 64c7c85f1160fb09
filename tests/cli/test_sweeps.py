"""Sweeps (``-m``) give the same exit code and summary with every Hydra launcher: the jobs
record what they did, in whatever process they ran, and the summary is built from that."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_runner import CliResult, run_cli  # tests/cli_runner.py
from omegaconf import OmegaConf

from surgery.cli import sweeps

REPO = Path(__file__).resolve().parents[2]
FAST = ["model.name=resnet18", "data.image_size=64", "data.batch_size=2", "data.batches=1", "checks.per_layer=false"]
# the shipped MNIST-1D CNN on one batch of 20 signals: a job costs a fifth of FAST's ResNet-18 in CPU
# time, and 99 % of its weights pruned still fails a cosine bound of 0.5 (measured 0.17; 0.2: 0.996)
TINY = ["model=mnist1d_cnn", "data=mnist1d", "data.batch_size=20", "data.batches=1", "checks.per_layer=false"]
LAUNCHERS = ["basic", "joblib", "submitit_local"]


def surgery(*args: str, pythonpath: Path | None = None) -> CliResult:
    """A sweep run from this process; the launcher starts whatever processes it starts (joblib's
    workers, submitit's jobs), as it does for a user."""
    return run_cli(*args, pythonpath=pythonpath or (), env={"PYTHONPATH": str(pythonpath)} if pythonpath else None)


def summary(folder: Path) -> list[dict]:
    return json.loads((folder / "sweep.json").read_text())


def comparable(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items()} for row in rows]


@pytest.mark.slow
def test_every_launcher_gives_the_same_exit_code_and_summary(tmp_path):
    """One job fails its drift bound. Before: with joblib (jobs in other processes) the sweep
    exited 0 and wrote no sweep.json."""
    results = {}
    for launcher in LAUNCHERS:
        folder = tmp_path / launcher
        run = surgery(
            "-m",
            *TINY,
            "prune.amount=0.2,0.99",
            "checks.drift.min_cosine=0.5",
            f"hydra/launcher={launcher}",
            f"hydra.sweep.dir={folder}",
        )
        assert run.returncode == 1, (launcher, run.stderr[-3000:])
        assert "1 of 2 jobs failed" in run.stdout, launcher
        results[launcher] = summary(folder)
        assert not (folder / ".surgery-jobs").exists(), "job records are removed once summarised"
    rows = results["basic"]
    assert [(r["job"], r["prune.amount"], r["status"], r["ok"]) for r in rows] == [
        ("0", "0.2", "ok", True),
        ("1", "0.99", "check_failed", False),
    ]
    assert results["joblib"] == rows and results["submitit_local"] == rows


@pytest.mark.slow
def test_a_rerun_sweep_never_reports_a_failed_job_with_the_earlier_report(tmp_path):
    first = surgery("-m", *TINY, "prune.amount=0.2,0.6", "hydra/launcher=joblib", f"hydra.sweep.dir={tmp_path}")
    assert first.returncode == 0, first.stderr[-3000:]
    assert [r["status"] for r in summary(tmp_path)] == ["ok", "ok"]
    again = surgery(
        "-m",
        *TINY,
        "prune.amount=0.2,1.5",
        "output.overwrite=true",
        "hydra/launcher=joblib",
        f"hydra.sweep.dir={tmp_path}",
    )
    assert again.returncode == 2, again.stderr[-3000:]
    rows = summary(tmp_path)
    assert rows[1]["prune.amount"] == "1.5" and rows[1]["status"] == "bad_input" and rows[1]["ok"] is False
    assert rows[1]["error"].startswith("prune.amount=1.5: must be a number in [0, 1]")  # the summary says why
    assert rows[1]["sparsity"] is None and rows[1]["cosine"] is None  # not the first sweep's 0.6
    assert json.loads((tmp_path / "1" / "report.json").read_text())["ok"] is True  # the old folder, untouched


@pytest.mark.slow
def test_a_job_process_that_dies_fails_the_sweep_and_is_listed(tmp_path):
    """A rewrite that kills its process (as an out-of-memory kill would): joblib reports a dead
    worker; the sweep exits 1, and the summary lists the job that died and the launcher's error."""
    (tmp_path / "killer.py").write_text("import os\n\ndef die(args, kwargs):\n    os._exit(3)\n")
    folder = tmp_path / "sweep"
    run = surgery(
        "-m",
        "recipe=rewrite_inputs",
        *TINY,
        "model.name=mnist1d_cnn",  # the recipe names resnet18
        "~rewrite.kwargs.mean",
        "~rewrite.kwargs.std",
        "rewrite.name=identity,killer.die",
        "hydra/launcher=joblib",
        "hydra.launcher.n_jobs=2",
        f"hydra.sweep.dir={folder}",
        pythonpath=tmp_path,
    )
    assert run.returncode == 1, run.stderr[-3000:]
    assert "the sweep's launcher failed" in run.stderr
    rows = summary(folder)
    assert rows[-1]["status"] == "launcher failed" and "TerminatedWorkerError" in rows[-1]["error"]
    assert {r["rewrite.name"]: r["status"] for r in rows[:-1]}["killer.die"] == "died (no final record)"


def test_sigterm_removes_the_staging_folder_and_writes_nothing(tmp_path):
    """What `timeout` and Slurm send. Before: `.staging-*` folders with full-size temporary
    checkpoints were left behind."""
    process = subprocess.Popen(
        [sys.executable, "-m", "surgery", *FAST, "data.batches=40", f"hydra.run.dir={tmp_path}"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob(".staging-*")) and time.monotonic() < deadline and process.poll() is None:
        time.sleep(0.05)
    assert list(tmp_path.glob(".staging-*")), "the run never started staging"
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 128 + signal.SIGTERM, stderr[-2000:]
    assert stderr.strip().splitlines()[-1] == "surgery: terminated (SIGTERM); the run's outputs were left as they were"
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix != ".log") == [".hydra"]


def test_a_dry_run_sweep_writes_no_summary_and_never_reads_earlier_reports(tmp_path):
    """+select_only jobs write nothing; their folders' reports are an earlier sweep's."""
    for job in ("0", "1"):
        (tmp_path / job).mkdir()
        (tmp_path / job / "report.json").write_text(json.dumps({"ok": True, "sparsity": 0.99}))
    (tmp_path / "sweep.json").write_text("the earlier summary")
    run = surgery("-m", *FAST, "+select_only=true", "prune.amount=0.2,0.6", f"hydra.sweep.dir={tmp_path}")
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count("nothing was changed or written") == 2 and "sweep summary" not in run.stdout
    assert (tmp_path / "sweep.json").read_text() == "the earlier summary"
    assert not (tmp_path / ".surgery-jobs").exists()


def test_a_sweep_without_its_callback_says_so_instead_of_exiting_0(tmp_path):
    run = surgery(
        "-m",
        *FAST,
        "+select_only=true",
        "prune.amount=0.2",
        "~hydra.callbacks.sweep_records",
        f"hydra.sweep.dir={tmp_path}",
    )
    assert run.returncode == 2 and "sweep_records callback did not run" in run.stderr, run.stderr[-2000:]


@pytest.mark.filterwarnings("error")
def test_a_job_in_a_worker_kept_from_an_earlier_sweep_records_into_this_one(tmp_path, monkeypatch):
    """Two sweeps from one process (a notebook): joblib keeps its workers, whose inherited
    token is the first sweep's. Before: their records went under it, the second summary lost
    them and showed the first sweep's rows."""
    monkeypatch.setenv(sweeps.TOKEN_ENV, "")  # put back afterwards: a sweep sets it for its jobs
    config = OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}})
    try:
        sweeps.SweepCallback().on_multirun_start(config)
        first = os.environ[sweeps.TOKEN_ENV]
        sweeps.record_job(tmp_path, sweeps.JobRecord(0, {"prune.amount": "0.2"}, str(tmp_path / "0"), "bad_input"))
        assert [r.num for r in sweeps.finish_sweep()[2]] == [0]
        sweeps.SweepCallback().on_multirun_start(config)
        monkeypatch.setenv(sweeps.TOKEN_ENV, first)  # the kept worker's environment
        sweeps.record_job(
            tmp_path,
            sweeps.JobRecord(1, {"prune.amount": "1.5", "output.overwrite": "true"}, str(tmp_path / "1"), "bad_input"),
        )
        code, _, records = sweeps.finish_sweep()
    finally:
        sweeps.forget_sweep()
    assert code == 2 and [(r.num, r.overrides) for r in records] == [
        (1, {"prune.amount": "1.5", "output.overwrite": "true"})
    ]
    assert not (tmp_path / sweeps.RECORDS).exists()
    assert (tmp_path / "sweep.png").read_bytes()[:4] == b"\x89PNG"  # drawn without a line, and without a warning
