"""A plan as a file: round trip, one run applied and restored bit for bit, its export."""

from __future__ import annotations

import json

import pytest
import torch
from support import tiny_llama  # tests/support.py

import surgery
from surgery.core.errors import ConfigError, ConfigTypeError, OutputExistsError
from surgery.ops.planning.plans import Plan, PlanRow
from surgery.testing import snapshot, snapshot_differences

LAYERS = ["model.layers.0.self_attn.q_proj", "model.layers.0.mlp.up_proj", "model.layers.0.mlp.down_proj"]


def mixed_plan() -> Plan:
    rows = [
        PlanRow(LAYERS[0], "w4g128", (64, 64), 2176, 0.1),
        PlanRow(LAYERS[1], "2:4", (128, 64), 9216, 0.2),
        PlanRow(LAYERS[2], "nvfp4", (64, 128), 4612, 0.3),
        PlanRow("model.layers.1.mlp.up_proj", "dense", (128, 64), 16384, 0.0),
    ]
    return Plan(rows, 40_000, "drift", "exact", "rtn", ["dense", "w4g128", "2:4", "nvfp4"])


@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_a_saved_plan_loads_back_equal(tmp_path, suffix):
    plan = mixed_plan()
    loaded = Plan.load(plan.save(tmp_path / f"plan{suffix}"))
    assert loaded == plan and loaded.as_dict() == plan.as_dict()
    assert "total" in str(loaded) and loaded.counts() == {"w4g128": 1, "2:4": 1, "nvfp4": 1, "dense": 1}


def test_a_plan_saved_over_a_file_is_refused_unless_overwrite(tmp_path):
    path = mixed_plan().save(tmp_path / "plan.json")
    path.write_text("mine")
    with pytest.raises(OutputExistsError, match="overwrite=True"):
        mixed_plan().save(path)
    assert path.read_text() == "mine"
    assert Plan.load(mixed_plan().save(path, overwrite=True)) == mixed_plan()
    with pytest.raises(ConfigTypeError, match=r"^overwrite='no': must be True or False"):
        mixed_plan().save(path, overwrite="no")  # a string would read as true
    with pytest.raises(ConfigError, match=r"^plan\.save\.path='.*': is a folder"):
        mixed_plan().save(tmp_path, overwrite=True)
    assert path.read_text() != "mine" and sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]


def test_a_file_that_is_no_plan_is_refused_by_name(tmp_path):
    (tmp_path / "plan.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"^plan\.file="):
        Plan.load(tmp_path / "plan.json")


def test_apply_changes_the_layers_in_one_run_and_restore_is_bit_exact():
    model = tiny_llama(layers=2)
    before = snapshot(model)
    handle = mixed_plan().apply(model)
    assert len(handle.handles) == 3  # one verb call per choice; dense takes none
    assert (model.get_submodule(LAYERS[1]).weight == 0).float().mean() == 0.5
    assert snapshot_differences(before, snapshot(model)) != []
    handle.restore()
    assert snapshot_differences(before, snapshot(model)) == []


def test_a_plan_mixing_formats_exports_to_compressed_tensors_a_config_group_per_choice(tmp_path):
    pytest.importorskip("compressed_tensors")
    model = tiny_llama(layers=1)
    ids = torch.randint(0, 128, (1, 8))
    rows = [PlanRow(LAYERS[0], "int8", (64, 64), 4224, 0.1), PlanRow(LAYERS[2], "w4g128", (64, 128), 4352, 0.1)]
    with Plan(rows, 20_000, "drift", "exact").apply(model) as handle:
        record = surgery.export(handle, tmp_path / "out", format="compressed-tensors", inputs=[ids])
    assert record.parity.equal, record.parity
    config = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert [group["targets"] for group in config["config_groups"].values()] == [[LAYERS[0]], [LAYERS[2]]]
