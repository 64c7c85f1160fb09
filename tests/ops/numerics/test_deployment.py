"""surgery.ops.numerics.deployment: what the handles hand to a deployment format."""

from __future__ import annotations

import pytest
from torch import nn

import surgery
import surgery.ops.numerics.deployment as deployment


def test_the_parts_of_a_prune_and_a_quantize_are_gathered_from_the_group():
    model = nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 2))
    group = surgery.compose(surgery.prune(model, 0.5, select="0"), surgery.quantize(model, select="2"))
    parts = deployment.gather_export_parts(group)
    assert isinstance(parts, deployment.ExportParts) and parts.model is model
    assert list(parts.masks) == ["0.weight"] and list(parts.weights) == ["2.weight"]
    assert parts.layer_weight("2").spec.bits == 8 and parts.activation_mode == "none"
    group.restore()
    with pytest.raises(surgery.ConfigError, match="export.handle=.*export a handle while its surgery is attached"):
        deployment.gather_export_parts(group)


@pytest.mark.parametrize(("old", "new"), [("DeployPlan", "ExportParts"), ("deploy_plan", "gather_export_parts")])
def test_the_old_names_are_the_new_objects_and_warn(old, new):
    with pytest.deprecated_call(match=f"{old} is now {new}; the old name goes away in 0.4"):
        assert getattr(deployment, old) is getattr(deployment, new)
    with pytest.raises(AttributeError, match="has no attribute 'plan'"):
        deployment.plan  # noqa: B018
