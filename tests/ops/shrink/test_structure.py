"""rebuild treats a shrink plan as untrusted input: sealed to its model, bounded, and only
allowed to set what shrink itself changes (before: any attribute on any module, any model)."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import surgery
from surgery.core.errors import ConfigError


class Block(nn.Module):
    def __init__(self, width: int = 16, depth: int = 2) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            *[
                nn.Sequential(nn.Linear(width, 32), nn.LayerNorm(32), nn.ReLU(), nn.Linear(32, width))
                for _ in range(depth)
            ]
        )
        self.head = nn.Linear(width, 3)

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


def shrunk_plan(**kwargs) -> dict:
    torch.manual_seed(0)
    model = Block(**kwargs).eval()
    handle = surgery.shrink(model, 0.5, calibration=torch.randn(2, 16))
    plan = json.loads(json.dumps(handle.structure()))
    handle.restore()
    return plan


def test_a_sealed_plan_rebuilds_its_own_model():
    plan = shrunk_plan()
    assert set(plan["$model"]) == {"fingerprint", "digest"}
    fresh = surgery.rebuild(Block, plan)
    assert fresh.layers[0][0].out_features == 16 and fresh.layers[0][1].normalized_shape == (16,)


@pytest.mark.parametrize(
    "factory", [lambda: Block(depth=3), lambda: Block(width=16, depth=1)], ids=["deeper", "shallower"]
)
def test_a_plan_made_for_another_model_is_refused_before_building(factory):
    """Before: a resnet18 plan was accepted by resnet34 and resnet50."""
    with pytest.raises(ConfigError, match=r"rebuild.plan='\$model': was made for another model"):
        surgery.rebuild(factory, shrunk_plan())


def unsealed(plan: dict) -> dict:
    return {name: entry for name, entry in plan.items() if name != "$model"}


@pytest.mark.parametrize(
    "attribute,value,message",
    [
        ("forward", 1, "is not an attribute shrink changes on a LayerNorm"),
        ("training", "yes", "is not an attribute shrink changes"),
        ("__class__", "x", "must be a public attribute name"),
        ("normalized_shape", [64], "must be a list of 1 integers, each in"),
    ],
)
def test_only_the_attributes_shrink_changes_are_set_with_their_types(attribute, value, message):
    """Before: `forward: 1` gave a model that cannot be called, `training: "yes"` was accepted
    and `__class__` gave a raw error."""
    plan = unsealed(shrunk_plan())
    plan["layers.0.1"] = {"class": "torch.nn.modules.normalization.LayerNorm", "attributes": {attribute: value}}
    with pytest.raises(ConfigError, match=message):
        surgery.rebuild(Block, plan)


def test_a_plan_on_the_root_module_cannot_replace_its_forward():
    plan = {"": {"class": f"{Block.__module__}.Block", "attributes": {"forward": 1}}}
    with pytest.raises(ConfigError, match="is not an attribute shrink changes on a Block"):
        surgery.rebuild(Block, plan)


def test_numbers_beyond_any_layer_are_one_line_not_a_cpp_stack():
    plan = unsealed(shrunk_plan())
    plan["layers.0.0"]["args"]["out_features"] = 10**400
    with pytest.raises(ConfigError, match=r"out_features=.*must be a number in \[0, 2147483647\]") as caught:
        surgery.rebuild(Block, plan)
    assert "\n" not in str(caught.value)


def test_plan_json_nested_deeply_is_refused_in_one_line():
    text = '{"a": ' + "[" * 200_000 + "]" * 200_000 + "}"
    with pytest.raises(ConfigError, match="nested too deeply"):
        surgery.rebuild(Block, text)
