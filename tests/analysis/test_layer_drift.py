"""Per-layer drift: identical layers, a perturbed layer, shared modules, bounded memory, no hooks left."""

from __future__ import annotations

import copy
from unittest import mock

import pytest
import torch
from torch import nn

from surgery.analysis import layer_drift as layer_drift_module
from surgery.analysis.layer_drift import LayerDrift, layer_drift
from surgery.core.errors import ConfigError
from surgery.testing import global_hook_counts, module_hook_counts


class Shared(nn.Module):
    """One Linear called twice per forward, between two other layers."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.block = nn.Linear(8, 8)
        self.out = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.block(torch.relu(self.block(self.inp(x)))))


def assert_no_hooks(model: nn.Module) -> None:
    assert not any(module_hook_counts(model).values()), "hooks left on the model"


def _by_name(rows: list[LayerDrift]) -> dict[str, LayerDrift]:
    return {row.name: row for row in rows}


def test_identical_models_have_no_drift_in_any_layer(mlp_factory, mlp_input):
    reference, candidate = mlp_factory(), mlp_factory()
    rows = layer_drift(reference, candidate, mlp_input)
    assert [r.name for r in rows] == ["0", "1", "2", "3", "4"]
    assert [r.index for r in rows] == [0, 1, 2, 3, 4]
    assert [r.type for r in rows] == ["Linear", "ReLU", "Linear", "ReLU", "Linear"]
    for row in rows:
        assert row.cosine == pytest.approx(1.0, abs=1e-12)
        assert row.sqnr_db is None and row.max_abs == 0.0 and row.identical
        assert row.calls == 1 and row.depth == 1
    assert_no_hooks(reference)
    assert_no_hooks(candidate)


def test_perturbed_layer_and_later_ones_drift_earlier_ones_do_not(mlp_factory, mlp_input):
    reference, candidate = mlp_factory(), mlp_factory()
    with torch.no_grad():
        candidate[2].weight.add_(0.1 * torch.randn_like(candidate[2].weight))
    rows = _by_name(layer_drift(reference, candidate, [mlp_input, mlp_input * 2]))
    for name in ("0", "1"):
        assert rows[name].identical and rows[name].sqnr_db is None
    for name in ("2", "3", "4"):
        assert rows[name].max_abs > 0 and rows[name].cosine < 1.0
        assert rows[name].sqnr_db is not None and rows[name].sqnr_db > 0
        assert rows[name].calls == 2  # one per batch


def test_models_without_shared_names_are_a_config_error(mlp_factory, mlp_input):
    class Other(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head = nn.Linear(8, 4)

        def forward(self, x):
            return self.head(x)

    reference, other = mlp_factory(), Other()
    with pytest.raises(ConfigError, match=r"^per_layer=True: the models share no module names") as info:
        layer_drift(reference, other, mlp_input)
    assert "\n" not in str(info.value)
    assert_no_hooks(reference)
    assert_no_hooks(other)


def test_hooks_removed_and_training_flags_restored_when_a_model_raises(mlp_factory, mlp_input):
    reference, candidate = mlp_factory().train(), mlp_factory().train()
    before = global_hook_counts()
    with mock.patch.object(candidate[4], "forward", side_effect=RuntimeError("boom")):
        with pytest.raises(RuntimeError, match="boom"):
            layer_drift(reference, candidate, mlp_input)
    assert not any(module_hook_counts(reference).values())
    assert not any(module_hook_counts(candidate).values())
    assert global_hook_counts() == before
    assert all(m.training for m in [*reference.modules(), *candidate.modules()])


def test_different_shapes_are_not_comparable(mlp_factory, mlp_input):
    reference = mlp_factory()
    candidate = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 12), nn.ReLU(), nn.Linear(12, 4))
    rows = _by_name(layer_drift(reference, candidate, mlp_input))
    assert rows["2"].cosine is None and not rows["2"].comparable
    assert "shapes differ: (6, 16) vs (6, 12)" in rows["2"].detail
    assert rows["4"].comparable  # same output shape again


def test_shared_module_compares_call_k_with_call_k():
    torch.manual_seed(0)
    reference = Shared().eval()
    candidate = copy.deepcopy(reference)
    x = torch.randn(4, 8)
    rows = _by_name(layer_drift(reference, candidate, x))
    assert rows["block"].calls == 2 and rows["block"].identical
    with torch.no_grad():
        candidate.out.bias.add_(1.0)
    rows = _by_name(layer_drift(reference, candidate, x))
    assert rows["block"].identical and rows["inp"].identical  # call 1 vs 1, call 2 vs 2
    assert not rows["out"].identical
    assert_no_hooks(reference)
    assert_no_hooks(candidate)


def test_reference_outputs_are_cloned_before_in_place_ops():
    reference = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True))
    candidate = copy.deepcopy(reference)
    rows = _by_name(layer_drift(reference, candidate, torch.randn(3, 4)))
    assert rows["0"].identical and rows["1"].identical


def test_the_reference_store_holds_at_most_one_batch_of_layer_outputs(mlp_factory, mlp_input):
    peaks: list[int] = []
    stores: list = []

    class CountingOutputs(layer_drift_module._ReferenceOutputs):
        def __init__(self, *args):
            super().__init__(*args)
            stores.append(self)

        def update(self, tensor):
            super().update(tensor)
            peaks.append(sum(t is not None for store in stores for t in store.tensors))  # every stored output alive

    batches = [mlp_input, mlp_input + 1, mlp_input - 1]
    with mock.patch.object(layer_drift_module, "_ReferenceOutputs", CountingOutputs):
        rows = layer_drift(mlp_factory(), mlp_factory(seed=1), batches)
    assert len(peaks) == len(rows) * len(batches)  # every layer stored once per batch
    assert max(peaks) == len(rows)  # never more than the layers of one batch: each is released once compared


def test_same_model_as_reference_and_candidate(mlp_factory, mlp_input):
    model = mlp_factory()
    rows = layer_drift(model, model, mlp_input)
    assert len(rows) == 5 and all(r.identical for r in rows)
    assert_no_hooks(model)
