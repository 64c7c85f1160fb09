"""The drift check of a run: bounds on comparison metrics, and what it says when a metric
cannot be measured."""

from __future__ import annotations

import copy
import math

import torch
from support import Poisoned  # tests/support.py
from torch import nn

import surgery
from surgery.cli.checks import check_drift
from surgery.cli.config import DriftThresholds


def test_check_drift_names_how_many_values_are_non_finite(mlp, mlp_input):

    bounds = DriftThresholds(min_cosine=0.9)
    bad = check_drift(surgery.compare(mlp, Poisoned(copy.deepcopy(mlp), math.inf, 4), mlp_input), bounds)
    assert not bad.passed and bad.value is None
    assert "modified model's outputs hold 0 NaN and 4 Inf values" in bad.detail
    unmeasurable = check_drift(surgery.compare(Poisoned(mlp, math.nan, 1), copy.deepcopy(mlp), mlp_input), bounds)
    assert not unmeasurable.passed and "reference model's own outputs hold 1 NaN and 0 Inf" in unmeasurable.detail
    no_bounds = check_drift(
        surgery.compare(mlp, Poisoned(copy.deepcopy(mlp), math.nan, 1), mlp_input), DriftThresholds()
    )
    assert not no_bounds.passed  # non-finite fails even when no bound is set


def test_a_metric_that_cannot_be_computed_fails_its_bound_instead_of_passing(mlp_input):
    """Finite float64 outputs near 1e200 overflow the float64 sums: the cosine is NaN, and
    `NaN < bound` is False, so the bound used to pass."""

    class Huge(nn.Module):
        def __init__(self, scale: float) -> None:
            super().__init__()
            self.scale = scale

        def forward(self, x):
            return torch.full((2, 3), 1e200, dtype=torch.float64) * self.scale

    drift = surgery.compare(Huge(1.0), Huge(0.5), mlp_input)
    assert drift.finite and math.isnan(drift.cosine)
    result = check_drift(drift, DriftThresholds(min_cosine=0.5))
    assert not result.passed and "cosine nan < 0.5" in result.detail


def test_an_attribution_cosine_below_its_bound_or_nan_fails_the_drift_check():
    import dataclasses

    from surgery.analysis.attribution import AttributionDrift

    drift = surgery.compare(nn.Linear(3, 2), nn.Linear(3, 2), torch.ones(1, 3))
    maps = torch.zeros(2, 4)

    def explained(cosines: list[float]) -> AttributionDrift:
        return AttributionDrift("gradcam", "layer3", 0.1, cosines, [1.0, 1.0], maps, maps)

    bounds = DriftThresholds(min_attribution_cosine=0.8)
    passed = check_drift(dataclasses.replace(drift, attribution=explained([0.9, 0.95])), bounds)
    low = check_drift(dataclasses.replace(drift, attribution=explained([0.9, 0.5])), bounds)
    broken = check_drift(dataclasses.replace(drift, attribution=explained([0.9, math.nan])), bounds)
    assert passed.passed and not low.passed and not broken.passed
    assert "attribution cosine 0.7000 < 0.8 (gradcam at layer3)" in low.detail
