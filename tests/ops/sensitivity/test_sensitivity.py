"""surgery.sensitivity: each layer pruned alone, measured, restored; the amounts for a target and prune(amounts=)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import surgery
from surgery.core.errors import ConfigError
from surgery.ops.sensitivity.sensitivity import Sensitivity, SensitivityRow
from surgery.testing import assert_no_hooks, snapshot, snapshot_differences


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)).eval()


def test_every_layer_and_amount_is_measured_and_the_model_is_left_exactly_as_it_was():
    model = mlp()
    before = snapshot(model)
    table = surgery.sensitivity(model, (0.5, 0.9), calibration=[torch.randn(16, 8)], progress=False)
    assert [(r.layer, r.setting) for r in table.rows] == [(l, a) for l in ("0", "2", "4") for a in (0.5, 0.9)]
    assert table.metric == "drift" and table.baseline == 0.0 and not table.higher_is_better
    for layer in ("0", "2", "4"):
        at = {r.setting: r.score for r in table.rows if r.layer == layer}
        assert 0.0 < at[0.5] < at[0.9]  # pruning more of a layer moves the outputs more
    assert snapshot_differences(before, snapshot(model)) == []
    assert_no_hooks(model)


def test_a_user_metric_is_called_on_each_pruned_model():
    model = mlp()
    seen = []

    def zeros(m):
        seen.append(sum(int((p == 0).sum()) for p in m.parameters()))
        return float(seen[-1])

    table = surgery.sensitivity(model, [0.5], evaluate=zeros, higher_is_better=False, select=["2"], progress=False)
    assert seen == [0, 512] and table.rows[0].score == 512.0 and table.damage(table.rows[0]) == 512.0


def synthetic(rows):
    return Sensitivity([SensitivityRow(*row) for row in rows], "accuracy", 1.0, True)


def test_the_amounts_prune_the_robust_layer_first_and_hit_the_target_exactly():
    table = synthetic(
        [("fragile", 0.5, 100, 0.5), ("fragile", 0.9, 100, 0.1), ("robust", 0.5, 100, 0.99), ("robust", 0.9, 100, 0.98)]
    )
    assert table.amounts_for(0.45) == {"fragile": 0.0, "robust": 0.9}
    amounts = table.amounts_for(0.6)
    assert amounts["robust"] == 0.9 and amounts["fragile"] == pytest.approx(0.3)
    assert (amounts["robust"] * 100 + amounts["fragile"] * 100) / 200 == pytest.approx(0.6)
    with pytest.raises(ConfigError, match="sensitivity.target_sparsity=0.95: must be a number in \\[0, 0.9\\]"):
        table.amounts_for(0.95)


def test_the_old_name_plan_still_gives_the_amounts_and_warns():
    table = synthetic([("a", 0.5, 100, 0.9), ("b", 0.5, 100, 0.5)])
    with pytest.deprecated_call(match="Sensitivity.plan\\(target\\) is now Sensitivity.amounts_for\\(target\\)"):
        assert table.plan(0.25) == table.amounts_for(0.25) == {"a": 0.5, "b": 0.0}


def test_prune_takes_per_layer_amounts_for_every_method():
    model = mlp()
    data = [torch.randn(32, 8)]
    for method in ("l1_unstructured", "wanda", "sparsegpt"):
        handle = surgery.prune(
            model,
            0.5,
            method=method,
            amounts={"0": 0.25, "4": 0.0},
            calibration=None if method == "l1_unstructured" else data,
            progress=False,
        )
        assert handle.layer_sparsity() == {"0.weight": 0.25, "2.weight": 0.5, "4.weight": 0.0}, method
        handle.restore()


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"amounts": {"9": 0.5}}, "prune.amounts='9': is not a selected layer"),
        ({"amounts": {"0": 1.5}}, "prune.amounts['0']=1.5"),
        ({"amounts": {"0": 0.5}, "scope": "global"}, "prune.amounts={'0': 0.5}: sets one amount per layer"),
        ({"amounts": [0.5]}, "prune.amounts=[0.5]: must be a dict"),
    ],
)
def test_bad_amounts_are_refused_before_anything_changes(kwargs, message):
    model = mlp()
    before = snapshot(model)
    with pytest.raises(ConfigError) as caught:
        surgery.prune(model, 0.5, progress=False, **kwargs)
    assert str(caught.value).startswith(message)
    assert snapshot_differences(before, snapshot(model)) == []


def test_amounts_may_list_layers_left_dense_and_a_nan_score_is_refused():
    model = mlp()
    handle = surgery.prune(model, 0.5, exclude="4", amounts={"0": 0.25, "4": 0.0}, progress=False)
    assert handle.layer_sparsity() == {"0.weight": 0.25, "2.weight": 0.5}  # "4" is excluded and listed dense
    handle.restore()
    with pytest.raises(ConfigError, match="prune.amounts='4': is not a selected layer"):
        surgery.prune(model, 0.5, exclude="4", amounts={"4": 0.5}, progress=False)
    nan_for_layer_2 = lambda m: float("nan") if (m[2].weight == 0).any() else 1.0
    with pytest.raises(ConfigError, match="sensitivity.evaluate=nan: returned NaN for 2 at 0.5"):
        surgery.sensitivity(model, [0.5], evaluate=nan_for_layer_2, progress=False)
    assert not any((p == 0).any() for p in model.parameters())  # the failing trial was restored


def test_sensitivity_refuses_bad_settings():
    with pytest.raises(ConfigError, match="sensitivity.calibration"):
        surgery.sensitivity(mlp(), progress=False)
    with pytest.raises(ConfigError, match="sensitivity.amounts=0: each amount must be a number in \\(0, 1\\]"):
        surgery.sensitivity(mlp(), [0, 0.5], calibration=[torch.randn(2, 8)], progress=False)
    with pytest.raises(ConfigError, match="sensitivity.evaluate='str': returned this for baseline"):
        surgery.sensitivity(mlp(), evaluate=lambda m: "good", progress=False)


def test_quantizing_each_layer_alone_at_several_bit_widths():
    model = mlp()
    before = snapshot(model)
    table = surgery.sensitivity(model, calibration=[torch.randn(16, 8)], bits=[8, 2], progress=False)
    assert table.kind == "quantize" and table.settings == [2.0, 8.0]
    for layer in ("0", "2", "4"):
        at = {r.setting: r.score for r in table.rows if r.layer == layer}
        assert 0.0 < at[8.0] < at[2.0]  # fewer bits move the outputs more
    assert snapshot_differences(before, snapshot(model)) == []
    with pytest.raises(ConfigError, match="plans pruning amounts"):
        table.amounts_for(0.5)
    with pytest.raises(ConfigError, match="sensitivity.bits=9"):
        surgery.sensitivity(model, calibration=[torch.randn(2, 8)], bits=[9], progress=False)
