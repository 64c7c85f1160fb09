"""``GridSpec(super_group=..., scale_bits=...)``: two-level scales as llama.cpp's K-quants store
them. Every method's grid has each group's scale equal to its super group's stored scale ``d``
times an integer in [1, 2^scale_bits - 1], the largest group's exactly the top level; the
weights lie on that grid; bad settings and weights the super groups cannot tile are refused in
one line."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import surgery
from surgery import GridSpec
from surgery.core.errors import ConfigError
from surgery.ops.numerics.fake_quant import Grid, fake_quantize_groups, super_grouped

SPEC = GridSpec(bits=6, observer="full_range", group_size=16, scale_dtype="float16", super_group=256, scale_bits=7)


def two_level(scale: torch.Tensor, spec: GridSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Each super group's ``d`` (its largest scale over the top level) and the groups' multiples of it."""
    blocks = scale.double().reshape(scale.shape[0], -1, spec.super_group // spec.group_size)
    d = blocks.amax(-1, keepdim=True) / ((1 << spec.scale_bits) - 1)
    return d, blocks / d


@pytest.mark.parametrize(
    ("method", "actorder"), [("rtn", None), ("gptq", None), ("gptq", "weight"), ("autoround", None)]
)
def test_every_method_s_scales_are_integer_multiples_of_an_fp16_super_scale(method, actorder):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 64), nn.ReLU(), nn.Linear(64, 8))
    spec = SPEC
    settings = {"autoround": {"iterations": 3}, "gptq": {"actorder": actorder}}.get(method, {})
    calibration = [torch.randn(8, 512) for _ in range(2)] if method != "rtn" else None
    handle = surgery.quantize(
        model, weights=spec, method={"name": method, **settings}, calibration=calibration, select="0", progress=False
    )
    grid = handle.weights["0.weight"]
    d, levels = two_level(grid.scale, spec)
    assert torch.equal(d.half().double(), d)  # d is an fp16 value
    assert torch.equal(levels, levels.round()) and levels.min() >= 1 and levels.max() == 127
    assert torch.equal(levels.amax(-1), torch.full_like(levels.amax(-1), 127))  # the largest group: the top level
    weight = model.get_parameter("0.weight").detach()
    assert torch.equal(fake_quantize_groups(weight, grid.scale, grid.zero_point, 0, spec), weight)


def test_the_snap_is_the_nearest_level_and_a_zero_group_keeps_zero():
    scale = torch.tensor([[0.5, 0.25, 0.126, 1e-9], [3e-7, 1e-7, 2e-7, 1e-9]])  # 1e-9: an all-zero group's
    spec = GridSpec(bits=3, observer="full_range", group_size=4, scale_dtype="float16", super_group=16, scale_bits=2)
    snapped = super_grouped(scale, spec)
    d = torch.tensor([[0.5 / 3], [1e-7]]).half().float()  # 1e-7 is fp16's subnormal 2^-23 (not zero, not 2^-14)
    assert d[1, 0] == 2.0**-23
    # 0.126 / d = 0.756: 1; 1e-9: at least 1; the largest group at the top level whatever d's rounding
    assert torch.equal(snapped, d * torch.tensor([[3.0, 2.0, 1.0, 1.0], [3.0, 1.0, 2.0, 1.0]]))
    rows = torch.zeros(1, 16)
    rows[0, :12] = torch.randn(12)
    found, zero = Grid(spec, per_row=True).group_qparams(rows)
    assert torch.equal(fake_quantize_groups(rows, found, zero, 0, spec)[0, 12:], torch.zeros(4))


def test_a_bfloat16_model_keeps_the_two_level_scales_exact():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 32)).to(torch.bfloat16)
    handle = surgery.quantize(model, weights=SPEC, progress=False)
    d, levels = two_level(handle.weights["0.weight"].scale, SPEC)
    assert torch.equal(levels, levels.round())  # not rounded to bfloat16 afterwards


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"scale_bits": None}, r"super_group=256: and scale_bits are set together"),
        ({"super_group": 200}, r"super_group=200: must be a multiple of group_size \(group_size=16"),
        ({"scale_bits": 9}, r"scale_bits=9: must be a whole number of bits in \[1, 8\]"),
        ({"scale_dtype": None}, r"needs an integer format and scale_dtype"),
        (
            {"observer": "minmax"},
            r"its zero point must not depend on it: set symmetric=true, observer='full_range' or float_offset=true",
        ),
    ],
)
def test_bad_super_group_settings_are_refused_in_one_line(fields, message):
    with pytest.raises(ConfigError, match=message) as raised:
        GridSpec(**{**SPEC.as_dict(), **fields})
    assert "\n" not in str(raised.value)


def test_gptq_s_group_order_is_refused_on_super_groups_in_one_line():
    with pytest.raises(ConfigError, match=r"^quantize.method.actorder='group': scatters the groups over the inputs"):
        surgery.QuantizeSpec(weights=SPEC, method={"name": "gptq", "actorder": "group"})


def test_a_weight_the_super_groups_cannot_tile_is_refused_and_the_model_left_as_it_was():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 32), nn.ReLU(), nn.Linear(32, 8))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ConfigError, match=r"super_group=256: does not divide the 32 inputs of 2\.weight") as raised:
        surgery.quantize(model, weights=SPEC, progress=False)
    assert "\n" not in str(raised.value)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not model._forward_pre_hooks and not model[0]._forward_pre_hooks
