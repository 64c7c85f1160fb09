"""format="fp8": FP8 weights and FP8 inputs multiplied by torch's scaled FP8 matmul
(``torch._scaled_mm``), on the CPU here and on a GPU where one is present."""

from __future__ import annotations

import pytest
import torch
from support import tiny_llama  # tests/support.py

import surgery
from surgery import GridSpec
from surgery.core.errors import ConfigError
from surgery.ops.export.formats.fp8_linear import Float8Linear

FP8 = GridSpec(format="fp8_e4m3", per_channel=True)


def fp8_llama(model, inputs, dynamic):
    activations = GridSpec(format="fp8_e4m3", dynamic=dynamic)
    return surgery.quantize(
        model, weights=FP8, activations=activations, where="input", exclude="lm_head", calibration=[inputs]
    )


@pytest.mark.parametrize("dynamic", ["token", None])
def test_fp8_kernels_compute_what_the_simulation_computes(tmp_path, dynamic):
    model = tiny_llama(layers=2)
    ids = torch.randint(0, 128, (2, 32))
    with fp8_llama(model, ids, dynamic) as handle:
        record = surgery.export(handle, tmp_path / "m.pt", format="fp8", inputs=[ids])
        expected = model(ids).logits
    # the CPU kernel accumulates in float32 as the simulation does: measured equal to the bit
    assert record.parity.holds and record.parity.equal, record.parity
    loaded = record.load()
    layer = loaded.model.layers[0].mlp.up_proj
    assert isinstance(layer, Float8Linear) and layer.weight.dtype == torch.float8_e4m3fn
    assert (layer.input_scale is None) == (dynamic == "token")
    assert torch.equal(loaded(ids).logits, expected)


def test_fp8_weights_without_fp8_inputs_or_with_block_scales_are_refused(tmp_path):
    model = tiny_llama(layers=1)
    with surgery.quantize(model, weights=FP8, exclude="lm_head") as handle:
        with pytest.raises(
            ConfigError, match=r"^quantize.activations='model.layers.0.self_attn.q_proj': the FP8 kernel"
        ):
            surgery.export(handle, tmp_path / "m.pt", format="fp8")
    blocks = GridSpec(format="fp8_e4m3", group_size=32)
    with surgery.quantize(model, weights=blocks, exclude="lm_head") as handle:
        with pytest.raises(ConfigError, match=r"^quantize.weights='.*: fp8_e4m3 group 32': format='fp8' holds"):
            surgery.export(handle, tmp_path / "m.pt", format="fp8")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="cuBLASLt's FP8 kernels need a CUDA GPU (SM 8.9+)")
def test_fp8_kernels_on_a_gpu_stay_within_the_bound(tmp_path):
    model = tiny_llama(layers=2).cuda().to(torch.bfloat16)
    ids = torch.randint(0, 128, (2, 32), device="cuda")
    with fp8_llama(model, ids, "token") as handle:
        record = surgery.export(handle, tmp_path / "m.pt", format="fp8", inputs=[ids])
    assert record.parity.holds, record.parity


def test_a_layer_the_fp8_kernels_cannot_take_is_refused(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(32, 10)).eval()  # a 10-class head: not a multiple of 16
    x = torch.randn(4, 32)
    spec = dict(weights=FP8, activations=GridSpec(format="fp8_e4m3", dynamic="token"), where="input")
    with surgery.quantize(model, **spec) as handle:
        with pytest.raises(ConfigError, match=r"^export.handle='0 \(32 -> 10\)': the FP8 kernels take inputs and"):
            surgery.export(handle, tmp_path / "m.pt", format="fp8", inputs=[x])
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ConfigError, match=r"^quantize.target='fp8': cannot hold 0.weight \(32 -> 10\)"):
        surgery.quantize(model, **spec, target="fp8", calibration=[x])  # the target: when quantize starts
