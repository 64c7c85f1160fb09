"""``GridSpec(scale_dtype=...)``: every scale rounded to the stored dtype as it is computed, so the
weights are rounded against the scale a format stores (GGUF's fp16 block scales)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import surgery
from surgery import GridSpec
from surgery.core.errors import ConfigError
from surgery.ops.numerics.fake_quant import Grid, fake_quantize_groups


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_scales_are_stored_dtype_values_and_the_weights_lie_on_their_grid(dtype, method):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 8))
    spec = GridSpec(bits=4, group_size=16, scale_dtype=dtype)
    calibration = [torch.randn(8, 64) for _ in range(2)] if method == "gptq" else None
    handle = surgery.quantize(model, weights=spec, method=method, calibration=calibration, progress=False)
    for key, grid in handle.weights.items():
        stored = getattr(torch, dtype)
        assert torch.equal(grid.scale.to(stored).float(), grid.scale), key
        weight = model.get_parameter(key).detach()
        assert torch.equal(fake_quantize_groups(weight, grid.scale, grid.zero_point, 0, spec), weight), key
    plain = Grid(GridSpec(bits=4, group_size=16), True).group_qparams(torch.randn(4, 64) * 0.37)[0]
    assert not torch.equal(plain.half().float(), plain)  # without it, float32 scales are not fp16 values


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"scale_dtype": "float32"}, r"^GridSpec\.scale_dtype='float32': must be null, float16 or bfloat16$"),
        ({"scale_dtype": "float16", "format": "fp8_e4m3"}, r"applies to integer grids; format 'fp8_e4m3'"),
    ],
)
def test_a_bad_scale_dtype_is_refused_in_one_line(fields, message):
    with pytest.raises(ConfigError, match=message):
        GridSpec(**fields)
