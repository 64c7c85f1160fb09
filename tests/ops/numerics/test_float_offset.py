"""``GridSpec(float_offset=True)``: affine groups whose offset is a float (``scale × q - offset``,
llama.cpp's Q4_1/Q5_1 minimum and, on two levels, the K-quants' mins). Every method lands the
weights on that grid, the offsets are what the format stores, formats that store integer zero
points refuse such a grid in one line, and bad settings are refused in one line."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import surgery
from surgery import GridSpec
from surgery.core.errors import ConfigError
from surgery.ops.numerics.deployment import gather_export_parts
from surgery.ops.numerics.fake_quant import Grid, fake_quantize_groups

Q4_1 = GridSpec(bits=4, float_offset=True, group_size=32, scale_dtype="float16")
Q4_K = GridSpec(bits=4, float_offset=True, group_size=32, scale_dtype="float16", super_group=256, scale_bits=6)


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 64), nn.ReLU(), nn.Linear(64, 8))


@pytest.mark.parametrize("spec", [Q4_1, Q4_K], ids=["Q4_1", "Q4_K"])
@pytest.mark.parametrize("method", ["rtn", "gptq", "autoround"])
def test_every_method_puts_the_weights_on_the_float_offset_grid(spec, method):
    net = model()
    calibration = [torch.randn(8, 256) for _ in range(2)] if method != "rtn" else None
    grid_spec, chosen = spec, {"name": "autoround", "iterations": 3} if method == "autoround" else method
    with surgery.quantize(
        net, weights=grid_spec, method=chosen, calibration=calibration, select="0", progress=False
    ) as handle:
        grid = gather_export_parts(handle).weights["0.weight"]
        weight = net.get_parameter("0.weight").detach()
        offset = grid.zero_point
        assert offset.is_floating_point() and bool((offset >= 0).all())  # minus each group's minimum (at most 0)
        assert torch.equal(fake_quantize_groups(weight, grid.scale, offset, 0, grid_spec), weight)
        integers = grid.integers(weight)
        assert integers.min() >= 0 and integers.max() <= 15
        assert torch.equal(grid.dequantized(integers), weight)  # scale x q - offset, as GGUF computes it
        if spec.super_group is None:
            assert torch.equal(offset.half().float(), offset) and torch.equal(grid.scale.half().float(), grid.scale)
        else:  # every super group's offsets: an fp16 dmin times integers in [0, 63], the largest at 63
            blocks = offset.double().reshape(64, -1, 8)
            dmin = blocks.amax(-1, keepdim=True) / 63
            levels = blocks / dmin
            assert torch.equal(dmin.half().double(), dmin) and torch.equal(levels, levels.round())
            assert levels.min() >= 0 and levels.max() == 63


def test_the_offset_is_minus_the_group_minimum_and_the_range_reaches_its_maximum():
    rows = torch.tensor([[-1.0, -0.5, 0.25, 2.0] * 8])
    scale, offset = Grid(GridSpec(bits=4, float_offset=True, group_size=32), per_row=True).group_qparams(rows)
    assert torch.equal(offset, torch.tensor([[1.0]])) and torch.allclose(scale, torch.tensor([[3.0 / 15]]))
    rounded = fake_quantize_groups(rows, scale, offset, 0, GridSpec(bits=4, float_offset=True, group_size=32))
    assert rounded[0, 0] == -1.0 and rounded[0, 3] == scale[0, 0] * 15 - 1.0  # both ends on the grid


@pytest.mark.parametrize("fmt", ["compressed-tensors", "onnx", "int4"])
def test_formats_that_store_integer_zero_points_refuse_a_float_offset_grid(tmp_path, fmt):
    net = model()
    with (
        surgery.quantize(net, weights=Q4_1, select="0", progress=False) as handle,
        pytest.raises(
            ConfigError, match=r"stores integer zero points; 0\.weight's groups have float offsets"
        ) as raised,
    ):
        surgery.export(handle, tmp_path / {"compressed-tensors": "m", "onnx": "m.onnx"}.get(fmt, "m.pt"), format=fmt)
    assert "\n" not in str(raised.value) and not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"symmetric": True}, r"float_offset=True: applies to affine grids \(symmetric=false\)"),
        ({"observer": "full_range"}, r"float_offset=True: is symmetric about zero"),
        ({"group_size": None}, r"float_offset=True: applies to weights per channel or in groups \(set group_size\)"),
        ({"float_offset": "yes"}, r"float_offset='yes': must be true or false"),
    ],
)
def test_bad_float_offset_settings_are_refused_in_one_line(fields, message):
    with pytest.raises(ConfigError, match=message) as raised:
        GridSpec(**{**Q4_1.as_dict(), **fields})
    assert "\n" not in str(raised.value)


def test_a_super_group_of_zero_offsets_keeps_them_zero_and_a_zero_weight_stays_zero():
    rows = torch.zeros(2, 256)
    rows[0] = torch.rand(256)  # every group's minimum above zero: offsets 0 (the range starts at 0)
    scale, offset = Grid(Q4_K, per_row=True).group_qparams(rows)
    assert torch.equal(offset, torch.zeros_like(offset))
    rounded = fake_quantize_groups(rows, scale, offset, 0, Q4_K)
    assert torch.equal(rounded[1], torch.zeros(256)) and (rounded[0] >= 0).all()


@pytest.mark.parametrize(
    ("keywords", "message"),
    [
        (
            {"weights": GridSpec(bits=4, float_offset=True, per_channel=True), "train": True},
            r"^quantize\.weights\.float_offset=True: rounds post-training",
        ),
        (
            {"weights": None, "activations": GridSpec(bits=8, float_offset=True, per_channel=True)},
            r"applies to weights",
        ),
    ],
)
def test_float_offsets_in_training_or_on_activations_are_refused(keywords, message):
    net = model()
    with pytest.raises(ConfigError, match=message):
        surgery.quantize(net, calibration=[torch.randn(4, 256)], progress=False, **keywords)
    assert not net[0]._forward_hooks and not net[0]._forward_pre_hooks


def test_a_timm_vit_on_two_level_float_offset_grids_quantizes_every_layer_and_restores_exactly():
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    vit = timm.create_model("vit_tiny_patch16_224", pretrained=False).eval()
    before = {k: v.clone() for k, v in vit.state_dict().items()}
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        expected = vit(x)
    spec = GridSpec(**{**Q4_K.as_dict(), "super_group": 192})  # its widths: 192 and 768
    with surgery.quantize(vit, weights=spec, progress=False) as handle, torch.no_grad():
        found = vit(x)
        assert len(handle.weights) == sum(isinstance(m, (nn.Linear, nn.Conv2d)) for m in vit.modules()) == 50
    # 4-bit groups of 32 on random init: measured cosine 0.981; a grid off by a level would fall far
    assert torch.nn.functional.cosine_similarity(found.flatten(), expected.flatten(), dim=0) > 0.95
    assert all(torch.equal(before[k], v) for k, v in vit.state_dict().items())
