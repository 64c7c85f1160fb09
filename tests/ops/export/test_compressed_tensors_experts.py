"""A quantized mixture-of-experts model written to compressed-tensors: per-expert entries under
the names of the family's checkpoints, loaded by transformers into its fused experts with the
logits of the simulation; what transformers cannot load into experts refused in one line."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from support import tiny_moe  # tests/support.py

import surgery
from surgery.core.errors import ConfigError

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

W4_GROUP = {"bits": 4, "symmetric": True, "group_size": 16}
W8_CHANNEL = {"bits": 8, "symmetric": True, "per_channel": True}
NAMES = {  # the first expert's gate projection and the router, as each family's checkpoints name them
    "mixtral": ("model.layers.0.block_sparse_moe.experts.0.w1", "model.layers.0.block_sparse_moe.gate"),
    "qwen3_moe": ("model.layers.0.mlp.experts.0.gate_proj", "model.layers.0.mlp.gate"),
    "olmoe": ("model.layers.0.mlp.experts.0.gate_proj", "model.layers.0.mlp.gate"),
}


def keys(folder) -> set[str]:
    with safe_open(str(folder / "model.safetensors"), "pt") as file:
        return set(file.keys())


@pytest.mark.parametrize("family", list(NAMES))
@pytest.mark.parametrize("weights", [W4_GROUP, W8_CHANNEL], ids=["w4a16_g16", "w8a16_channel"])
def test_moe_folders_load_in_transformers_with_logits_equal_to_the_simulation(tmp_path, family, weights):
    model = tiny_moe(family)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    with surgery.quantize(model, weights=surgery.GridSpec(**weights), select="**.*_proj", progress=False) as handle:
        expected = model(ids).logits
        record = surgery.export(handle, tmp_path / family, format="compressed-tensors", inputs=[ids])
    assert record.parity.equal and record.parity.expected == "exact" and record.parity.holds
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / family, local_files_only=True).eval()
    assert torch.equal(loaded(ids).logits, expected)
    gate, router = NAMES[family]
    found = keys(tmp_path / family)
    assert {f"{gate}.weight_packed", f"{gate}.weight_scale", f"{router}.weight"} <= found
    assert not any(key.endswith(("experts.gate_up_proj", "experts.down_proj")) for key in found)
    config = json.loads((tmp_path / family / "config.json").read_text())["quantization_config"]
    assert router in config["ignore"] and "lm_head" in config["ignore"]


def test_deepseek_v3_experts_load_as_well(tmp_path):
    model = tiny_moe("deepseek_v3")
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    with surgery.quantize(model, weights=surgery.GridSpec(**W4_GROUP), select="**.*_proj", progress=False) as handle:
        record = surgery.export(handle, tmp_path / "ds", format="compressed-tensors", inputs=[ids])
    assert record.parity.equal and record.parity.holds
    assert "model.layers.0.mlp.experts.3.down_proj.weight_packed" in keys(tmp_path / "ds")


def test_mxfp4_and_fp8_experts_load_with_our_weights(tmp_path):
    model = tiny_moe("qwen3_moe", hidden=64).to(torch.bfloat16)  # compressed-tensors unpacks FP4 to bfloat16
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    with surgery.quantize(model, weights=surgery.GridSpec(format="mxfp4"), select="**.*_proj", progress=False) as h:
        ours = model.state_dict()["model.layers.0.mlp.experts.gate_up_proj"]
        record = surgery.export(h, tmp_path / "mxfp4", format="compressed-tensors", inputs=[ids])
    assert record.parity.expected == "cosine>=0.9999" and record.parity.holds, record.parity
    assert torch.equal(record.load().model.layers[0].mlp.experts.gate_up_proj, ours)
    model = tiny_moe("mixtral")
    fp8 = surgery.GridSpec(format="fp8_e4m3", per_channel=True)
    with surgery.quantize(model, weights=fp8, select="**.*_proj", progress=False) as handle:
        record = surgery.export(handle, tmp_path / "fp8", format="compressed-tensors", inputs=[ids])
    assert record.parity.equal and record.parity.holds


@pytest.mark.parametrize(
    ("family", "weights", "activations", "match"),
    [
        ("gpt_oss", W4_GROUP, None, r"^export.format='compressed-tensors': gpt_oss experts \(model.layers.0.mlp"),
        ("qwen3_moe", {**W4_GROUP, "symmetric": False}, None, r"^quantize.weights.symmetric=False: .* zero points"),
        ("qwen3_moe", {"format": "nvfp4"}, None, r"^quantize.weights.format='nvfp4': .* global scales"),
        ("qwen3_moe", W8_CHANNEL, {"bits": 8}, r"^quantize.activations='quantized inputs': .* input scales"),
    ],
    ids=["gpt_oss_fused", "asymmetric", "nvfp4", "w8a8"],
)
def test_what_transformers_cannot_load_into_experts_is_one_line_and_writes_nothing(
    tmp_path, family, weights, activations, match
):
    model = tiny_moe(family, hidden=64 if "format" in weights else 32)
    model = model.to(torch.bfloat16) if "format" in weights else model
    ids = torch.randint(0, 128, (2, 16))
    spec = surgery.QuantizeSpec(
        weights=surgery.GridSpec(**weights),
        activations=surgery.GridSpec(**activations) if activations else None,
        where="input",
        select="**.*_proj",
    )
    with surgery.quantize(model, spec, calibration=[ids] if activations else None, progress=False) as handle:
        with pytest.raises(ConfigError, match=match) as caught:
            surgery.export(handle, tmp_path / "moe", format="compressed-tensors")
    assert "\n" not in str(caught.value) and list(tmp_path.iterdir()) == []


def test_gpt_oss_exports_with_its_experts_left_float(tmp_path):
    """Its checkpoints keep the experts fused: quantizing the other layers still exports."""
    model = tiny_moe("gpt_oss")
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    spec = surgery.GridSpec(**W4_GROUP)
    with surgery.quantize(model, weights=spec, select="**.*_proj", exclude="**.experts", progress=False) as handle:
        record = surgery.export(handle, tmp_path / "gpt_oss", format="compressed-tensors", inputs=[ids])
    assert record.parity.equal and record.parity.holds
    assert "model.layers.0.mlp.experts.gate_up_proj" in keys(tmp_path / "gpt_oss")


@pytest.mark.parametrize(
    "select", ["**.down_proj", "model.layers.0.mlp.experts.**"], ids=["one-projection", "one-layer"]
)
def test_experts_quantized_in_part_are_refused_before_writing_a_folder_transformers_cannot_load(tmp_path, select):
    """transformers converts every experts module one way: a folder mixing float and quantized
    expert entries fails in its loader, so the export says so first."""
    model = tiny_moe("mixtral", layers=2)
    with surgery.quantize(model, weights=surgery.GridSpec(**W4_GROUP), select=select, progress=False) as handle:
        with pytest.raises(ConfigError, match=r"every expert layer is quantized or none.*stay float") as caught:
            surgery.export(handle, tmp_path / "moe", format="compressed-tensors")
    assert "\n" not in str(caught.value) and list(tmp_path.iterdir()) == []
