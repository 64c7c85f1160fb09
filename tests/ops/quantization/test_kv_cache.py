"""Key/value cache quantization on Hugging Face attention: the keys and values the cache would
hold are on the grid, the model computes with them, restore is exact, and a model whose
attention it cannot recognise is refused in one line."""

from __future__ import annotations

import pytest
import torch
from support import tiny_llama  # tests/support.py

import surgery
from surgery import GridSpec
from surgery.core.errors import ConfigError

transformers = pytest.importorskip("transformers")


def batches() -> list[torch.Tensor]:
    return [torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(i)) for i in range(4)]


def projections_seen(model, tokens) -> dict[str, torch.Tensor]:
    seen = {}
    hooks = [
        module.register_forward_hook(lambda m, a, out, name=name: seen.__setitem__(name, out.detach()))
        for name, module in model.named_modules()
        if name.endswith(("k_proj", "v_proj"))
    ]
    with torch.no_grad():
        model(tokens)
    for hook in hooks:
        hook.remove()
    return seen


@pytest.mark.parametrize("spec", [GridSpec(bits=8, symmetric=True, per_channel=True), GridSpec(format="fp8_e4m3")])
def test_keys_and_values_are_on_the_grid_and_restore_is_exact(spec):
    model = tiny_llama(layers=2)
    tokens = batches()[0]
    with torch.no_grad():
        before = model(tokens).logits
    handle = surgery.quantize_kv_cache(model, spec, calibration=batches(), progress=False)
    assert sorted(handle.activations) == sorted(
        f"model.layers.{i}.self_attn.{p}" for i in range(2) for p in ("k_proj", "v_proj")
    )
    seen = projections_seen(model, tokens)
    for name, quantizer in handle.activations.items():
        scale = quantizer.scale.reshape(-1) if spec.per_channel else quantizer.scale
        units = seen[name] / scale  # grid values, up to the rounding of (value x scale) / scale
        grid = units.to(torch.float8_e4m3fn).float() if spec.is_float else units.round()
        assert torch.allclose(units, grid, rtol=1e-5, atol=1e-4), name
        assert spec.is_float or units.abs().max() <= 128.001, name
    with torch.no_grad():
        after = model(tokens).logits
    assert not torch.equal(after, before)
    cosine = torch.nn.functional.cosine_similarity(after.flatten(), before.flatten(), dim=0)
    assert cosine > 0.999  # measured 0.99999 (int8 per channel) and 0.99989 (fp8) on this random model
    handle.restore()
    with torch.no_grad():
        assert torch.equal(model(tokens).logits, before)


def test_cache_bytes_per_token_fall_to_a_quarter_of_float32():
    model = tiny_llama(layers=2)
    # per layer: keys and values of 2 heads x 16 channels
    assert surgery.kv_cache_bytes(model) == 2 * 2 * 32 * 4
    assert surgery.kv_cache_bytes(model, GridSpec(format="fp8_e4m3")) == 2 * 2 * 32
    assert surgery.kv_cache_bytes(model, GridSpec(bits=4)) == 2 * 2 * 32 // 2


def test_a_fused_qkv_attention_is_refused_in_one_line():
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32)
    model = transformers.GPT2LMHeadModel(config).eval()
    with pytest.raises(ConfigError) as caught:
        surgery.quantize_kv_cache(model, calibration=[torch.randint(0, 64, (1, 8))], progress=False)
    assert caught.value.field == "kv_cache" and "c_attn" in str(caught.value) and "\n" not in str(caught.value)


def test_a_cache_calibrated_on_constant_data_is_refused_and_the_model_left_as_it_was():
    model = tiny_llama(layers=1)
    tokens = batches()[0]
    before = model(tokens).logits
    zeros = [torch.zeros(2, 16, dtype=torch.long)]  # every position the same token: every key the same
    with pytest.raises(ConfigError, match=r"quantize.calibration='model.layers.0.self_attn.k_proj'.*no range"):
        surgery.quantize_kv_cache(model, calibration=zeros, progress=False)
    assert torch.equal(model(tokens).logits, before)


def test_a_cache_format_activations_cannot_take_names_the_kv_cache_field():
    model = tiny_llama(layers=1)
    with pytest.raises(ConfigError, match=r"^kv_cache.format='mxfp4': scales per block") as caught:
        surgery.quantize_kv_cache(
            model, GridSpec(format="mxfp4", group_size=32), calibration=[torch.randint(0, 128, (1, 8))]
        )
    assert "quantize." not in str(caught.value)


def test_attention_limits_the_cache_quantized_and_an_unknown_module_is_refused_naming_the_known():
    model = tiny_llama(layers=2)
    with surgery.quantize_kv_cache(model, calibration=batches(), attention=["model.layers.1.self_attn"]) as handle:
        assert sorted(handle.activations) == ["model.layers.1.self_attn.k_proj", "model.layers.1.self_attn.v_proj"]
    with pytest.raises(ConfigError, match=r"^kv_cache\.attention='model\.layers\.1': is no attention module .*"):
        surgery.quantize_kv_cache(model, calibration=batches(), attention=["model.layers.1"])
    with pytest.raises(ConfigError, match=r"^kv_cache\.attention=\[\]: names no attention module"):
        surgery.quantize_kv_cache(model, calibration=batches(), attention=[])
    assert not any(module._forward_hooks for module in model.modules())
