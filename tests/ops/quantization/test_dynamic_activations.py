"""Dynamic activation quantization (``GridSpec(dynamic="token"|"tensor")``): scales set by
each tensor as it runs, bit-equal to compressed-tensors' (llm-compressor's W4A8/FP8_DYNAMIC
inputs), with no calibration, and exported to the runtimes that hold it."""

from __future__ import annotations

import pytest
import torch
from support import tiny_llama  # tests/support.py
from torch import nn

import surgery
from surgery import GridSpec
from surgery.core.errors import ConfigError
from surgery.ops.numerics.fake_quant import fake_quantize_dynamic
from surgery.ops.numerics.observers import NonFiniteError

pytest.importorskip("compressed_tensors")


def tokens() -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(4, 16, 64) * torch.rand(4, 16, 1) * 5  # tokens of very different ranges


@pytest.mark.parametrize(
    "bits, fmt, symmetric, strategy",
    [
        (8, "int", True, "token"),
        (4, "int", True, "token"),
        (8, "int", False, "token"),
        (8, "fp8_e4m3", True, "token"),
        (8, "int", True, "tensor"),
        (8, "fp8_e4m3", True, "tensor"),
    ],
)
def test_dynamic_scales_and_values_equal_compressed_tensors_bit_for_bit(bits, fmt, symmetric, strategy):
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import compute_dynamic_scales_and_zp, fake_quantize

    x = tokens()
    kind = "int" if fmt == "int" else "float"
    args = QuantizationArgs(num_bits=bits, type=kind, symmetric=symmetric, strategy=strategy, dynamic=True)
    scale, zero_point = compute_dynamic_scales_and_zp(value=x, args=args, module=nn.Linear(2, 2))
    theirs = fake_quantize(x=x, scale=scale, zero_point=zero_point, args=args)
    ours, our_scale = fake_quantize_dynamic(x, GridSpec(bits=bits, format=fmt, symmetric=symmetric, dynamic=strategy))
    assert torch.equal(our_scale, scale.reshape(-1))
    assert torch.equal(ours, theirs)
    assert not torch.equal(ours, x)  # it rounded something


def test_per_token_scales_follow_each_token_and_need_no_calibration():
    layer = nn.Linear(64, 8)
    x = tokens()
    handle = surgery.quantize(layer, weights=None, activations=GridSpec(bits=8, symmetric=True, dynamic="token"))
    with torch.no_grad():
        small = layer(x[:, :1] * 1e-3)  # alone, a tiny token keeps its own scale ...
        together = layer(torch.cat([x[:, :1] * 1e-3, x[:, 1:]], dim=1))[:, :1]  # ... beside large ones too
    assert torch.equal(small, together)
    assert handle.qparams() == {}  # nothing calibrated, nothing to save
    handle.restore()


def test_reattaching_dynamic_inputs_reads_no_saved_parameters(tmp_path):
    """A dynamic quantizer has no static parameters: nothing is saved, so none are read back."""
    layer, x = nn.Linear(64, 8), tokens()
    spec = GridSpec(bits=8, symmetric=True, dynamic="token")
    with torch.no_grad(), surgery.quantize(layer, weights=None, activations=spec):
        expected = layer(x)
    missing = tmp_path / "model.qparams.safetensors"  # never written: the handle held no qparams
    with torch.no_grad(), surgery.quantize(layer, weights=None, activations=spec, qparams=missing):
        assert torch.equal(layer(x), expected)


def test_dynamic_w4a8_on_a_llama_restores_exactly_and_trains_through():
    model = tiny_llama(layers=2)
    ids = torch.randint(0, 128, (2, 32))
    before = model(ids).logits.detach()
    spec = dict(weights=GridSpec(bits=4, group_size=32, symmetric=True), where="input", exclude="lm_head")
    handle = surgery.quantize(model, activations=GridSpec(bits=8, symmetric=True, dynamic="token"), **spec)
    changed = model(ids).logits
    assert 0 < (changed - before).abs().max() < 0.5
    changed.sum().backward()  # straight through the rounding
    assert model.model.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0
    handle.restore()
    assert torch.equal(model(ids).logits, before)


def test_qat_with_dynamic_inputs_gets_gradients_straight_through():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    x = torch.randn(8, 16, requires_grad=True)
    with surgery.quantize(model, activations=GridSpec(bits=4, symmetric=True, dynamic="token"), train=True):
        model(x).sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0


def test_compressed_tensors_export_of_dynamic_inputs_loads_with_equal_logits(tmp_path):
    model = tiny_llama(layers=2)
    ids = torch.randint(0, 128, (2, 16))
    spec = dict(weights=GridSpec(bits=4, group_size=32, symmetric=True), where="input", exclude="lm_head")
    with surgery.quantize(model, activations=GridSpec(bits=8, symmetric=True, dynamic="token"), **spec) as handle:
        record = surgery.export(handle, tmp_path / "w4a8", format="compressed-tensors", inputs=[ids])
        with pytest.raises(ConfigError, match=r"^export.options.activations='static': .* inputs are dynamic"):
            surgery.export(handle, tmp_path / "bad", format="compressed-tensors", activations="static")
    # measured equal to the bit for a float32 Llama; promised only within the bound (2-d inputs differ)
    assert record.parity.expected == "cosine>=0.9999" and record.parity.equal, record.parity
    scheme = record.load().model.layers[0].self_attn.q_proj.quantization_scheme.input_activations
    assert (scheme.dynamic, scheme.strategy, scheme.num_bits) == (True, "token", 8)
    assert not (tmp_path / "bad").exists()


def test_torchao_export_of_dynamic_int8_inputs_is_per_row(tmp_path):
    pytest.importorskip("torchao")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)).eval()
    batch = tokens()
    dynamic = GridSpec(bits=8, symmetric=True, dynamic="token")
    with surgery.quantize(model, activations=dynamic, where="input", target="torchao") as handle:
        record = surgery.export(handle, tmp_path / "m.pt", format="torchao", inputs=[batch])
        with pytest.raises(ConfigError, match=r"^quantize.activations.dynamic='token': a QDQ graph holds static"):
            surgery.export(handle, tmp_path / "m.onnx", format="onnx", inputs=[batch])
    assert record.parity.holds, record.parity
    assert not (tmp_path / "m.onnx").exists()
    assert record.load()[0].weight.act_quant_kwargs.granularity.__class__.__name__ == "PerRow"


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(activations={"bits": 8, "dynamic": "row"}), r"^quantize.activations.dynamic='row': must be null, token"),
        (
            dict(activations={"bits": 8, "dynamic": "token", "per_channel": True}),
            r"^quantize.activations.per_channel=True: dynamic='token' gives the scales",
        ),
        (dict(weights={"bits": 8, "dynamic": "token"}), r"^quantize.weights.dynamic='token': applies to activations"),
        (
            dict(activations={"bits": 8, "dynamic": "token"}, where="tensors"),
            r"^quantize.where='tensors': places static scales",
        ),
        (
            dict(activations={"bits": 8, "dynamic": "token"}, train=True, freeze_observers_after=3),
            r"^quantize.freeze_observers_after=3: dynamic activations have no learned range",
        ),
    ],
)
def test_bad_dynamic_settings_are_one_line_and_change_nothing(settings, message):
    layer = nn.Linear(8, 8)
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    with pytest.raises(ConfigError, match=message):
        surgery.quantize(layer, **settings)
    assert all(torch.equal(v, before[k]) for k, v in layer.state_dict().items())
    assert not layer._forward_hooks and not layer._forward_pre_hooks


def test_a_nan_reaching_a_dynamic_quantizer_is_one_line():
    layer = nn.Linear(8, 8)
    with surgery.quantize(layer, weights=None, activations=GridSpec(bits=8, dynamic="token"), where="input"):
        with pytest.raises(NonFiniteError, match=r"^quantize.activations.dynamic='': NaN or Inf reached this layer"):
            layer(torch.full((2, 8), float("nan")))


def test_a_timm_vit_takes_per_token_inputs_and_a_convolution_is_refused_per_token():
    timm = pytest.importorskip("timm")
    vit = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, num_classes=10).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        before = vit(x)
        spec = GridSpec(bits=8, symmetric=True, dynamic="token")
        with pytest.raises(ConfigError, match=r"^quantize.activations.dynamic='token': patch_embed.proj is a Conv2d"):
            surgery.quantize(vit, weights=None, activations=spec, where="input")
        with surgery.quantize(vit, activations=spec, where="input", exclude="patch_embed.proj"):
            after = vit(x)
        # int8 weights per channel and int8 tokens: cosine 0.9988-0.9999 over 12 seeds of the random
        # ViT and input (0.999 failed one run in five before each test was seeded)
        assert torch.nn.functional.cosine_similarity(after.flatten(), before.flatten(), 0) > 0.998
        assert torch.equal(vit(x), before)


def test_per_token_scales_on_an_image_are_refused_when_it_arrives():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)).eval()
    with surgery.quantize(model, weights=None, activations=GridSpec(dynamic="token"), select="1"):
        with pytest.raises(ConfigError, match=r"^quantize.activations.dynamic='token': 1's output is \(2, 4, 6, 6\)"):
            model(torch.randn(2, 3, 8, 8))


def test_a_linear_on_a_4d_input_takes_per_token_scales_over_all_but_its_last_axis():
    model = nn.Sequential(nn.Linear(8, 4)).eval()  # e.g. a Swin block's (batch, height, width, channels)
    x = torch.randn(2, 3, 5, 8)
    spec = GridSpec(bits=8, symmetric=True, dynamic="token")
    with surgery.quantize(model, weights=None, activations=spec, where="input"):
        with torch.no_grad():
            found = model(x)
    expected = model(fake_quantize_dynamic(x.reshape(-1, 8), spec)[0]).reshape(2, 3, 5, 4)
    torch.testing.assert_close(found, expected)
