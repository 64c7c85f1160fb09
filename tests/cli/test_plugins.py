"""One file plus one registration: a user's step, weight method, task and export format, each
written in tests/cli/plugins/, run from a user's recipe through the command line."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from cli_runner import CliResult, run_cli  # tests/cli_runner.py

import surgery
from surgery.cli.steps import STEPS
from surgery.core.errors import ConfigTypeError
from surgery.ops.export.format_table import EXPORT_FORMATS
from surgery.ops.numerics.weight_methods import WEIGHT_METHODS
from surgery.tasks import TASKS

PLUGINS = Path(__file__).resolve().parent / "plugins"
REPO = PLUGINS.parents[2]


def run_toy(*overrides: str, out: Path) -> CliResult:
    return run_cli(
        f"hydra.searchpath=[file://{PLUGINS}]", "recipe=toy", *overrides, f"hydra.run.dir={out}", pythonpath=PLUGINS
    )


@pytest.fixture
def toy_plugins(monkeypatch):
    """The four plugin modules imported in this process; their registrations undone afterwards."""
    monkeypatch.syspath_prepend(str(PLUGINS))
    modules = [importlib.import_module(name) for name in ("toy_step", "toy_method", "toy_task", "toy_format")]
    yield modules
    STEPS.unregister("random_prune")
    WEIGHT_METHODS.unregister("absmax")
    TASKS.unregister("blobs")
    EXPORT_FORMATS.unregister("npz")
    for name in ("toy_step", "toy_method", "toy_task", "toy_format"):
        sys.modules.pop(name, None)


def test_a_recipe_runs_a_plugin_step_weight_method_task_and_export_format(tmp_path):
    result = run_toy(out=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["steps"] == ["random_prune", "quantize"] and report["ok"] is True
    assert report["random_prune"] == {"amount": 0.25, "seed": 0}  # the plugin step's reporting
    assert "random_prune: 25% of each weight, seed 0" in result.stdout
    assert all(check["passed"] for check in report["checks"]), report["checks"]
    assert "accuracy" in report  # the task's metric, on its labelled test split
    assert report["export"] == {
        "path": "export.npz",
        "format": "npz",
        "bytes": (tmp_path / "export.npz").stat().st_size,
    }
    weights = dict(np.load(tmp_path / "export.npz"))
    first = weights["0.weight"]
    assert (first == 0).mean() >= 0.25  # random_prune's quarter, then quantized (zero stays zero)
    assert len(np.unique(first)) <= 16  # absmax: one 4-bit grid for the tensor


def test_a_step_written_before_0_3_keeps_its_hooks_on_the_step_with_a_warning():
    """Hooks defined on the Step itself (as before 0.3) are adopted into its reporting and checking."""
    from dataclasses import dataclass

    from surgery.cli.steps import STEPS, Step, StepChecks, StepReport, register_step

    @dataclass(frozen=True)
    class Nothing:
        pass

    class Old(Step):
        name, settings, outputs = "old_hooks_test", Nothing, ("old.png",)

        def apply(self, model, settings, run):
            return surgery.Handle(self.name, model)

        def summary(self, report):
            return ["old: said"]

        def preview(self, model, settings):
            return [(self.name, "matched", "(model)", "M", "all")]

    try:
        with pytest.warns(DeprecationWarning, match=r"step 'old_hooks_test' defines summary, preview, outputs on the"):
            step = register_step(Old())
        assert isinstance(step.reporting, StepReport) and isinstance(step.checking, StepChecks)
        assert step.reporting.summary({}) == ["old: said"] and step.reporting.markdown({}) == []
        assert step.checking.preview(None, Nothing()) == [("old_hooks_test", "matched", "(model)", "M", "all")]
        assert step.checking.reattach(None, Nothing(), {}) is None  # a hook it did not define: the default
        assert step.outputs == ("old.png",) and step.reporting.outputs == ("old.png",)
        from surgery.cli.steps.prune import PruneStep

        class OldPrune(PruneStep):  # a pre-0.3 subclass of a built-in step, calling up to its hook
            name = "old_prune_test"

            def summary(self, report):
                return [*super().summary(report), "and mine"]

        with pytest.warns(DeprecationWarning, match=r"step 'old_prune_test' defines summary on the Step"):
            subclass = register_step(OldPrune())
        assert subclass.reporting.summary({}) == ["and mine"]  # the prune step's own summary, then its line
        assert subclass.preview is not None and STEPS.get("prune").summary({}) == []  # still answered, until 0.4
        with pytest.raises(ConfigTypeError, match=r"^step .bad_reporting_test. reporting=.*StepReport"):

            class Bad(Step):
                name, settings, reporting = "bad_reporting_test", Nothing, object()

            register_step(Bad())
    finally:
        for name in ("old_hooks_test", "old_prune_test"):
            STEPS.unregister(name)


def test_the_dry_run_lists_a_plugin_step(tmp_path):
    result = run_toy("+select_only=true", out=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert any(line.split()[:2] == ["random_prune", "matched"] for line in result.stdout.splitlines()), result.stdout
    assert not (tmp_path / "report.json").exists()


def test_a_plugin_steps_settings_are_validated_by_its_own_class(tmp_path):
    result = run_toy("random_prune.amount=1.5", out=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == ["surgery: error: random_prune.amount=1.5: must be a number in [0, 1]"]


def test_a_misspelt_plugin_module_is_one_line(tmp_path):
    result = run_toy("plugins=[toy_stepp]", out=tmp_path)
    assert result.returncode == 2
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("surgery: error: plugins[0]='toy_stepp': could not be imported (ModuleNotFoundError")


def test_the_plugins_work_through_the_library_too(toy_plugins, tmp_path):
    model = toy_plugins[2].blob_mlp()
    pairs = TASKS.get("blobs")(None, "test", 8, 2)
    assert len(pairs) == 2 and pairs[0][0].shape == (8, 2)
    handle = surgery.quantize(model, weights=surgery.GridSpec(bits=4), method="absmax")
    assert len(torch.unique(model[0].weight)) <= 16
    record = surgery.export(handle, tmp_path / "model.npz", format="npz")
    assert record.bytes == (tmp_path / "model.npz").stat().st_size
    assert np.array_equal(record.load()["0.weight"], model[0].weight.detach().numpy())
    handle.restore()
    assert len(torch.unique(model[0].weight)) > 16


def test_a_weight_method_that_is_not_registered_names_the_registered_ones():
    with pytest.raises(
        surgery.ConfigError, match=r"^quantize.method='absmaxx': must be one of autoround, gptq, gptaq, rtn"
    ):
        surgery.quantize(torch.nn.Linear(4, 4), method="absmaxx")


def test_a_step_that_returns_no_handle_is_refused_in_one_line():
    """A step whose apply() returns None could not be undone, and the checks would pass on it."""
    from dataclasses import dataclass

    from surgery.cli.applying import apply_steps
    from surgery.cli.config_loading import load_config
    from surgery.cli.steps import Step, register_step
    from surgery.core.errors import ConfigTypeError

    @dataclass(frozen=True)
    class Nothing:
        pass

    class Forgetful(Step):
        name, settings = "forgetful", Nothing

        def apply(self, model, settings, run):
            return None

    register_step(Forgetful())
    try:
        config = load_config({"steps": ["forgetful"], "plugins": [], "forgetful": {}})
        model = torch.nn.Sequential(torch.nn.Linear(2, 2))
        with pytest.raises(ConfigTypeError, match=r"^steps.forgetful='NoneType': a step's apply\(\) must return"):
            apply_steps(model, config)
    finally:
        STEPS.unregister("forgetful")


def test_an_export_that_fails_its_deploy_check_is_never_published(tmp_path):
    (tmp_path / "export.pt").write_text("an earlier run's artifact")
    plugins = "plugins=[toy_step,toy_method,toy_task,toy_lossy_format]"
    result = run_toy(plugins, "export.format=lossy", "output.overwrite=true", out=tmp_path)
    assert result.returncode == 1, result.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    deploy = {check["name"]: check for check in report["checks"]}["deploy"]
    assert deploy["passed"] is False and "export.pt was not written" in deploy["detail"], deploy
    assert report["export"]["written"] is False and "deploy" not in report
    assert not (tmp_path / "export.pt").exists()  # neither this run's artifact nor the earlier one
