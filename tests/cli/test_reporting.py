"""The run's report: a step adds its own section, headline, markdown and plot through the step
protocol (``reporting.py`` knows no step by name), and the summary says each thing once."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from surgery.cli import reporting
from surgery.cli import run as run_module
from surgery.cli.config_loading import load_config
from surgery.cli.steps import STEPS, Step, register_step
from surgery.core.handles import Handle


@dataclass(frozen=True)
class StampSettings:
    marks: int = 3


class Stamp(Step):
    """Changes nothing; reports how many marks it made, with a headline, a section and a plot."""

    name, settings, outputs = "stamp", StampSettings, ("stamp.png",)

    def apply(self, model, settings, run):
        return Handle(self.name, model)

    def report(self, handle, settings, run, report):
        report["stamp"] = {"marks": settings.marks}

    def summary(self, report):
        return [f"stamp: {report['stamp']['marks']} marks"]

    def markdown(self, report):
        return ["", "## Stamp", "", f"{report['stamp']['marks']} marks made."]

    def plots(self, report):
        return {"stamp.png": lambda found, path: path.write_bytes(b"marks %d" % found["stamp"]["marks"])}


@pytest.fixture
def stamp():
    register_step(Stamp())
    yield
    STEPS.unregister("stamp")


def config(**section):
    return load_config(
        {
            "recipe": "stamped",
            "model": {"source": "digits_cnn", "name": "digits_cnn", "weights": None, "num_classes": 10},
            "data": {"kind": "synthetic", "batch_size": 2, "batches": 1, "channels": 1, "image_size": 8},
            "steps": ["stamp"],
            "plugins": [],
            "stamp": section,
            "output": {"plots": True},
        }
    )


def test_a_registered_step_adds_its_own_section_headline_markdown_and_plot(tmp_path, stamp):
    result = run_module.run(config(marks=5), tmp_path, echo=False)
    assert result.exit_code == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["stamp"] == {"marks": 5}
    markdown = (tmp_path / "report.md").read_text()
    assert "- stamp: 5 marks" in markdown and "## Stamp\n\n5 marks made." in markdown
    assert (tmp_path / "stamp.png").read_bytes() == b"marks 5"
    assert reporting.summary_table(report).splitlines()[1] == "  stamp: 5 marks"
    assert "stamp" not in Path(reporting.__file__).read_text()  # the step told it all


def test_a_steps_own_output_is_refused_and_replaced_as_the_runs_are(tmp_path, stamp):
    assert "stamp.png" in run_module.run_outputs()
    (tmp_path / "stamp.png").write_bytes(b"an earlier run's")
    with pytest.raises(FileExistsError, match="stamp.png"):
        run_module.run(config(), tmp_path, echo=False)


def test_a_run_that_did_not_prune_says_no_sparsity_and_a_pruning_one_says_it_once():
    report = {
        "recipe": "r",
        "model": "m",
        "params": {"total": 1000, "nonzero": 500},
        "sparsity": 0.5,
        "sparsity_over": {"parameters": 2, "entries": 800},
        "steps": ["prune"],
        "selection": {"prune": {"matched": ["a", "b"], "skipped": []}},
        "checks": [],
        "drift": {"cosine": 0.9, "sqnr_db": 10.0, "max_abs": 0.1, "top1_agreement": None},
        "ok": True,
    }
    lines = reporting.summary_table(report).splitlines()
    assert lines[:3] == [
        "recipe r  model m  params 1,000",
        "  prune: sparsity 0.5000 over 800 selected entries; params 500/1,000 non-zero",
        "  prune: 2 weight(s) matched, 0 skipped",
    ]
    unpruned = {**report, "steps": ["quantize"], "sparsity": 0.0, "sparsity_over": {"parameters": 0, "entries": 0}}
    assert "sparsity" not in reporting.summary_table(unpruned) and "non-zero" not in reporting.summary_table(unpruned)
