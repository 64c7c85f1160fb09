"""surgery.plan: budget kept, unreachable budgets named, both estimates, and a plan that beats
the uniform format of the same or larger size."""

from __future__ import annotations

import pytest
import torch
from support import tiny_llama  # tests/support.py

import surgery
from surgery.core.errors import ConfigError
from surgery.ops.sensitivity.sensitivity import model_outputs, output_drift
from surgery.testing import snapshot, snapshot_differences

CHOICES = ["dense", "int8", "w4g128", "w3g128", "nvfp4"]


def ids(seed: int, batches: int = 2) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (2, 16), generator=generator) for _ in range(batches)]


def test_the_plan_keeps_the_budget_and_leaves_the_model_as_it_was():
    model = tiny_llama(layers=1)
    before = snapshot(model)
    plan = surgery.plan(model, "4.5bpw", CHOICES, calibration=ids(0))
    assert plan.total_bytes <= plan.budget == int(4.5 * plan.weights / 8)
    assert "lm_head" not in [row.layer for row in plan.rows] and len(plan.rows) == 7
    assert snapshot_differences(before, snapshot(model)) == []


def test_an_unreachable_budget_names_the_smallest_reachable():
    with pytest.raises(ConfigError) as raised:
        surgery.plan(tiny_llama(layers=1), "2bpw", ["w4g128", "w3g128"], calibration=ids(0))
    assert str(raised.value) == (
        "plan.budget='2bpw': no plan fits; smallest reachable: 3.22 bpw (14,848 bytes) with every layer at w3g128"
    )


def test_a_bad_choice_names_the_allowed_ones():
    with pytest.raises(ConfigError, match=r"^plan\.choices='int5': must be one of dense, int8"):
        surgery.plan(tiny_llama(layers=1), "4bpw", ["int5"], calibration=ids(0))


def test_gradient_scores_where_the_model_gives_a_loss_and_drift_otherwise():
    model = tiny_llama(layers=1)
    labelled = [{"input_ids": x, "labels": x} for x in ids(0)]
    gradient = surgery.plan(model, "4.5bpw", CHOICES, calibration=labelled)
    drift = surgery.plan(model, "4.5bpw", CHOICES, calibration=ids(0))
    assert (gradient.estimate, drift.estimate) == ("gradient", "drift")
    for plan in (gradient, drift):
        assert all(row.score >= 0 for row in plan.rows) and plan.score > 0


def test_a_loss_giving_a_layer_no_gradient_is_refused_naming_it_and_the_model_kept():
    model = tiny_llama(layers=1)
    before = snapshot(model)
    pairs = [(x, x) for x in ids(0)]
    with pytest.raises(ConfigError, match=r"plan.estimate='gradient': model\.layers\.0\..* got no gradient"):
        surgery.plan(model, "4.5bpw", CHOICES, calibration=pairs, loss=lambda out, _: out.logits.sum() * 0)
    assert not snapshot_differences(before, snapshot(model))


def held_out_drift(model: torch.nn.Module, plan: surgery.Plan) -> float:
    inputs = ids(1, batches=4)
    reference = model_outputs(model, inputs)
    handle = plan.apply(model)
    try:
        return output_drift(reference, model_outputs(model, inputs))
    finally:
        handle.restore()


def test_the_plan_drifts_less_than_the_uniform_choice_of_the_same_or_larger_size():
    model = tiny_llama(layers=2)
    calibration = ids(0, batches=4)
    planned = surgery.plan(model, "4.5bpw", CHOICES, calibration=calibration)
    uniform = surgery.plan(model, "100bpw", ["nvfp4"], calibration=calibration)  # every layer nvfp4: >= 4.5 bpw
    assert uniform.bits_per_weight >= planned.bits_per_weight
    # measured: the plan drifts 0.17x uniform nvfp4's on held-out inputs (8.8e-4 vs 5.3e-3); 0.5
    # leaves room for other torch builds' rounding and still fails a plan not clearly better
    assert held_out_drift(model, planned) < 0.5 * held_out_drift(model, uniform)
