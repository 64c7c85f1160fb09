"""N:M semi-structured sparsity (prune(..., pattern="2:4")) for every criterion, and Wanda."""

from __future__ import annotations

import pytest
import torch
from support import tiny_gpt2  # tests/support.py
from torch import nn

import surgery
from surgery.core.errors import ConfigError
from surgery.testing import snapshot, snapshot_differences


def groups(mask: torch.Tensor, axis: int, size: int) -> torch.Tensor:
    """Kept entries per group of ``size`` consecutive entries along ``axis``."""
    return mask.movedim(axis, -1).reshape(-1, size).sum(dim=1)


class Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(8, 16, 3, padding=1)
        self.fc = nn.Linear(16 * 4 * 4, 8)

    def forward(self, x):
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(self.conv(x), 4), 1))


@pytest.mark.parametrize("pattern,kept,size", [("2:4", 2, 4), ("1:4", 1, 4), ("4:8", 4, 8)])
@pytest.mark.parametrize("method", ["l1_unstructured", "random_unstructured", "wanda", "taylor"])
def test_every_group_of_m_inputs_keeps_exactly_n(pattern, kept, size, method):
    torch.manual_seed(0)
    model = Mixed().eval()
    x = torch.randn(4, 8, 8, 8)
    before = snapshot(model)
    calibration = {"wanda": [x], "taylor": [(x, torch.tensor([0, 1, 2, 3]))]}.get(method)
    handle = surgery.prune(
        model, 1 - kept / size, method=method, pattern=pattern, calibration=calibration, progress=False
    )
    masks = handle.masks()
    for name, mask in masks.items():
        assert (groups(mask, 1, size) == kept).all(), name  # input channels / in_features, group by group
        weight = model.get_parameter(name).detach()
        assert not weight[~mask].any()
    assert handle.sparsity() == pytest.approx(1 - kept / size)
    handle.restore()
    assert snapshot_differences(before, snapshot(model)) == []


def test_magnitude_two_of_four_keeps_the_two_largest_of_each_group():
    torch.manual_seed(0)
    layer = nn.Linear(8, 3)
    expected = layer.weight.detach().abs().reshape(3, 2, 4).topk(2, dim=2).indices
    with surgery.prune(layer, 0.5, pattern="2:4", select="", progress=False) as handle:
        mask = handle.masks()["weight"].reshape(3, 2, 4)
        assert torch.equal(mask, torch.zeros_like(mask).scatter_(2, expected, True))


def test_hugging_face_conv1d_groups_along_its_input_axis():
    pytest.importorskip("transformers")
    model = tiny_gpt2()
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    with surgery.prune(
        model,
        0.5,
        method="wanda",
        pattern="2:4",
        select="transformer.h.*.mlp.c_fc",
        calibration=[{"input_ids": ids}],
        progress=False,
    ) as handle:
        mask = handle.masks()["transformer.h.0.mlp.c_fc.weight"]  # (in=32, out=128): inputs on axis 0
        assert (groups(mask, 0, 4) == 2).all()


def test_wanda_scores_weights_by_input_norms():
    layer = nn.Linear(4, 1, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([[1.0, 1.0, 2.0, 2.0]]))
    x = torch.tensor([[10.0, 0.1, 0.1, 10.0]])  # the small weight on a loud input outranks a large one on a quiet one
    with surgery.prune(layer, 0.5, method="wanda", select="", calibration=[x], progress=False) as handle:
        assert handle.masks()["weight"].tolist() == [[True, False, False, True]]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_wanda_on_a_half_precision_layer_scores_in_float32_as_the_reference_code(dtype):
    """The reference code multiplies the half weight by float32 norms. Norms cast to float16
    overflowed past 65504 (here ~1.3e5: inf, then NaN scores); cast to bfloat16 they tied
    weights the float32 scores tell apart. The mask is the float32 model's."""
    torch.manual_seed(0)
    layer = nn.Linear(64, 16, bias=False)
    batches = [torch.randn(1024, 64) * 2000 for _ in range(4)]
    with surgery.prune(layer, 0.5, method="wanda", select="", calibration=batches, progress=False) as handle:
        expected = handle.masks()["weight"]
    half = nn.Linear(64, 16, bias=False).to(dtype)
    with torch.no_grad():
        half.weight.copy_(layer.weight.to(dtype))
    with surgery.prune(
        half, 0.5, method="wanda", select="", calibration=[b.to(dtype) for b in batches], progress=False
    ) as handle:
        found = handle.masks()["weight"]
    reference = half.weight.abs() * torch.stack([b.double().pow(2).sum(0) for b in batches]).sum(0).sqrt().float()
    assert reference.dtype == torch.float32 and torch.isfinite(reference).all()
    if dtype == torch.float16:
        assert torch.equal(found, expected)
    else:  # the weights themselves are rounded to bfloat16: the ranking of the rounded weights by float32 scores
        keep = torch.zeros_like(reference, dtype=torch.bool).scatter_(1, reference.topk(32, dim=1).indices, True)
        assert torch.equal(found, keep)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"amount": 0.5, "pattern": "2-4"}, r"prune\.pattern='2-4': must be 'N:M'"),
        ({"amount": 0.5, "pattern": "4:4"}, r"prune\.pattern='4:4': needs 1 <= N < M"),
        ({"amount": 0.7, "pattern": "2:4"}, r"prune\.amount=0\.7: disagrees with pattern '2:4'.*pass amount=0\.5"),
        ({"amount": 0.5, "pattern": "2:4", "method": "ln_structured"}, r"prune\.pattern='2:4': applies to criteria"),
        ({"amount": 0.75, "pattern": "1:4", "select": "0"}, None),
        ({"amount": 5 / 6, "pattern": "1:6"}, r"prune\.pattern='1:6': 0\.weight has 8 input features .* multiple of 6"),
    ],
)
def test_bad_patterns_are_one_line_errors_and_change_nothing(mlp, kwargs, match):
    before = snapshot(mlp)
    if match is None:
        surgery.prune(mlp, progress=False, **kwargs).restore()
        return
    with pytest.raises(ConfigError, match=match):
        surgery.prune(mlp, progress=False, **kwargs)
    assert snapshot_differences(before, snapshot(mlp)) == []
