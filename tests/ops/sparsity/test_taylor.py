"""Gradient-based importance: the taylor criterion, weight-gradient capture, gradient statistics."""

from __future__ import annotations

import pytest
import torch
from support import tiny_gpt2  # tests/support.py
from torch import nn
from torch.nn import functional as F

import surgery
from surgery.analysis.inspection import BACKWARD_HOOKS, TENSOR_HOOKS, gradient_statistics
from surgery.core.errors import ConfigError
from surgery.testing import global_hook_counts, snapshot, snapshot_differences


def pairs(mlp_input: torch.Tensor, count: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [
        (mlp_input * (i + 1), torch.randint(0, 4, (mlp_input.shape[0],), generator=generator)) for i in range(count)
    ]


def taylor_by_hand(model: nn.Module, batches, name: str) -> torch.Tensor:
    weight = model.get_parameter(name)
    total = torch.zeros_like(weight, dtype=torch.float32)
    for x, y in batches:
        (grad,) = torch.autograd.grad(F.cross_entropy(model(x), y), weight)
        total += (weight.detach() * grad).abs()
    return total


def test_taylor_prunes_the_lowest_summed_weight_times_gradient(mlp, mlp_input):
    batches = pairs(mlp_input)
    expected = taylor_by_hand(mlp, batches, "2.weight")
    before = snapshot(mlp)
    with surgery.prune(mlp, 0.5, method="taylor", select="2", calibration=batches, progress=False) as handle:
        mask = handle.masks()["2.weight"]
        assert torch.equal(mask, expected > expected.flatten().kthvalue(expected.numel() // 2).values)
        assert all(p.grad is None for p in mlp.parameters()) and all(p.requires_grad for p in mlp.parameters())
    assert snapshot_differences(before, snapshot(mlp)) == []


def test_taylor_on_frozen_weights_leaves_them_frozen(mlp, mlp_input):
    for p in mlp.parameters():
        p.requires_grad_(False)
    with surgery.prune(mlp, 0.5, method="taylor", calibration=pairs(mlp_input), progress=False) as handle:
        assert handle.sparsity() == pytest.approx(0.5, abs=0.01)
    assert not any(p.requires_grad for p in mlp.parameters())


def test_a_registered_gradient_criterion_sees_fisher_information(mlp, mlp_input):
    seen = {}

    def fisher(weight, stats):
        seen[stats.name] = stats.grad_sq
        return stats.grad_sq * weight.square()

    surgery.register_criterion("obd_like", fisher, needs_gradients=True)
    try:
        with surgery.prune(mlp, 0.3, method="obd_like", calibration=pairs(mlp_input), progress=False):
            assert set(seen) == {"0", "2", "4"} and all((g >= 0).all() for g in seen.values())
    finally:
        surgery.ops.sparsity.criteria.CRITERIA.unregister("obd_like")


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (
            {"method": "taylor"},
            r"prune\.calibration=None: method 'taylor' scores with gradients; pass calibration \(inputs, target\) pairs",
        ),
        (
            {"method": "l1_unstructured", "loss": F.mse_loss},
            r"prune\.loss='mse_loss': is only used by gradient criteria",
        ),
        (
            {"method": "taylor", "calibration": "pairs-without-target"},
            r"prune\.calibration='batch 0': must be an \(inputs, target\) pair",
        ),
    ],
)
def test_bad_gradient_settings_are_one_line_errors(mlp, mlp_input, kwargs, match):
    if kwargs.get("calibration") == "pairs-without-target":
        kwargs["calibration"] = [mlp_input]
    before = snapshot(mlp)
    with pytest.raises(ConfigError, match=match):
        surgery.prune(mlp, 0.5, progress=False, **kwargs)
    assert snapshot_differences(before, snapshot(mlp)) == []


def test_taylor_on_a_hugging_face_model_with_its_own_loss():
    pytest.importorskip("transformers")
    model = tiny_gpt2()
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    batches = [({"input_ids": ids, "labels": ids}, None)]
    with surgery.prune(
        model,
        0.5,
        method="taylor",
        select="transformer.h.*.mlp.*",
        calibration=batches,
        loss=lambda output, _: output.loss,
        progress=False,
    ) as handle:
        assert handle.sparsity() == pytest.approx(0.5, abs=0.01) and len(handle.parameters) == 4  # 2 blocks


def test_capture_weight_grads_sees_one_gradient_per_backward(mlp, mlp_input):
    with surgery.capture(mlp, select="0", what="weight_grads") as seen:
        for _ in range(2):
            mlp(mlp_input).sum().backward()
    grads = seen.weight_grads["0"]
    assert len(grads) == 2 and torch.equal(grads[0], grads[1]) and grads[0].shape == mlp[0].weight.shape
    mlp.zero_grad(set_to_none=True)


def test_gradient_statistics_use_full_backward_hooks_and_stay_in_scope(mlp, mlp_input):
    batches = pairs(mlp_input)
    other = nn.Linear(8, 4)
    rows, mechanism = gradient_statistics(mlp, batches, F.cross_entropy)
    assert mechanism == BACKWARD_HOOKS
    other(mlp_input).sum().backward()  # after the call: the global hooks are gone
    by_name = {row.name: row for row in rows}
    assert set(by_name) == {"", "0", "1", "2", "3", "4"}
    assert sum(row.share for row in rows if row.share is not None) == pytest.approx(1.0)
    expected = sum(taylor_by_hand(mlp, batches, "4.weight").sum() for _ in [0]).item()
    bias = sum(
        (mlp[4].bias.detach() * torch.autograd.grad(F.cross_entropy(mlp(x), y), mlp[4].bias)[0]).abs().sum()
        for x, y in batches
    ).item()
    assert by_name["4"].sensitivity == pytest.approx(expected + bias, rel=1e-5)
    assert by_name["1"].weight_grad_norm is None and by_name["1"].grad_output_norm > 0  # ReLU: no parameters
    assert all(p.grad is None for p in mlp.parameters())


def test_gradient_statistics_of_a_model_editing_outputs_in_place_fall_back_to_tensor_hooks():
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=4).eval()  # ReLU(inplace=True), out += identity
    x = torch.randn(2, 3, 32, 32)
    before = global_hook_counts()
    rows, mechanism = gradient_statistics(model, [(x, torch.tensor([0, 1]))], F.cross_entropy)
    assert mechanism == TENSOR_HOOKS and global_hook_counts() == before
    names = {row.name for row in rows if row.share is not None}
    assert {"conv1", "layer4.1.conv2", "fc"} <= names
