"""Searches: the task returns an objective that hydra/sweeper=optuna maximises; Slurm config ships."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_runner import CliResult, run_cli  # tests/cli_runner.py

from surgery.cli.config import ObjectiveConfig
from surgery.cli.objective import WORST, objective_value
from surgery.core.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]


def surgery(*args: str) -> CliResult:
    return run_cli(*args)


def test_objective_is_the_metric_penalised_by_the_missed_bound():
    config = ObjectiveConfig(maximize="sparsity", subject_to={"cosine": 0.95}, penalty=2.0)
    assert objective_value(config, {"sparsity": 0.6, "drift": {"cosine": 0.97}}) == 0.6
    assert objective_value(config, {"sparsity": 0.7, "drift": {"cosine": 0.90}}) == pytest.approx(0.7 - 2.0 * 1.05)
    assert objective_value(config, {"sparsity": 0.7, "drift": {"cosine": None}}) == pytest.approx(0.7 - 2.0 * 2)
    assert objective_value(config, None) == -WORST  # no report (bad input, crash): never chosen
    lower = ObjectiveConfig(minimize="max_abs", subject_to={"top1_agreement": 0.9})
    assert objective_value(lower, {"drift": {"max_abs": 0.1, "top1_agreement": 0.8}}) == pytest.approx(0.1 + 1.1)
    with pytest.raises(ConfigError, match="set exactly one of objective.maximize and objective.minimize"):
        ObjectiveConfig(maximize="sparsity", minimize="max_abs")
    with pytest.raises(ConfigError, match="objective.subject_to.cosin='cosin': must be one of sparsity, cosine"):
        ObjectiveConfig(maximize="sparsity", subject_to={"cosin": 0.9})


def test_outputs_identical_to_the_reference_are_the_best_sqnr_not_a_missing_one():
    """Before: sqnr_db of identical outputs is null in the report, so the perfect trial scored the
    worst (-1e9) and the search named a worse one best, with exit 0."""
    identical = {"drift": {"max_abs": 0.0, "sqnr_db": None, "cosine": 1.0}}
    noisy = {"drift": {"max_abs": 0.2, "sqnr_db": 17.2, "cosine": 0.99}}
    best = ObjectiveConfig(maximize="sqnr_db")
    assert objective_value(best, identical) > objective_value(best, noisy) == 17.2
    bounded = ObjectiveConfig(maximize="cosine", subject_to={"sqnr_db": 30.0})
    assert objective_value(bounded, identical) == 1.0  # the bound holds
    assert objective_value(best, {"drift": {"max_abs": None, "sqnr_db": None}}) == -WORST  # non-finite: missing


@pytest.mark.slow
def test_optuna_searches_prune_amount_under_a_cosine_bound(tmp_path):
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    from test_sources import readme_command  # the documented command, as written

    run = surgery(*readme_command("recipe=search_prune"), "hydra.sweeper.n_trials=3", f"hydra.sweep.dir={tmp_path}")
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads((tmp_path / "sweep.json").read_text())
    assert len(rows) == 3 and all(row["status"] == "ok" for row in rows)
    for row in rows:  # each trial's score is its sparsity, or that minus 1 × (1 + shortfall) below cosine 0.95
        shortfall = max(0.0, 0.95 - row["cosine"])
        expected = row["sparsity"] - (1.0 + shortfall if shortfall > 0 else 0.0)
        assert row["objective"] == pytest.approx(expected)
    best = (tmp_path / "optimization_results.yaml").read_text()
    assert f"best_value: {max(row['objective'] for row in rows)}" in best


@pytest.mark.parametrize(
    "args,message",
    [
        (["objective.maximize=sparsty"], "objective.maximize='sparsty': must be one of sparsity"),
        (["+objective.minimize=max_abs"], "set exactly one of objective.maximize and objective.minimize"),
        (["objective.maximize=accuracy"], "objective='accuracy': needs labelled data and data.kind is 'synthetic'"),
    ],
)
def test_bad_objectives_exit_2_in_one_line(tmp_path, args, message):
    run = surgery("recipe=search_prune", *args, f"hydra.run.dir={tmp_path}")
    assert run.returncode == 2 and message in run.stderr and len(run.stderr.strip().splitlines()) == 1, run.stderr


def test_the_shipped_slurm_launcher_config_composes():
    run = surgery("recipe=prune_resnet50", "hydra/launcher=slurm", "--cfg", "hydra")
    assert run.returncode == 0, run.stderr[-2000:]
    assert "hydra_submitit_launcher.submitit_launcher.SlurmLauncher" in run.stdout


@pytest.mark.slow
def test_the_same_search_runs_on_the_joblib_launcher(tmp_path):
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    run = surgery(
        "-m",
        "recipe=search_prune",
        "hydra/launcher=joblib",
        "hydra.sweeper.n_trials=2",
        "hydra.sweeper.n_jobs=2",
        f"hydra.sweep.dir={tmp_path}",
    )
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads((tmp_path / "sweep.json").read_text())
    assert len(rows) == 2 and all(row["status"] == "ok" and row["objective"] is not None for row in rows)
