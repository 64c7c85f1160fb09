"""A compressed-tensors folder of layers on different grids: one config group per grid, each
targeting exactly its layers, loaded by transformers with the simulation's logits (float32) or
weights (FP4, bfloat16); the mixes transformers loads wrong refused in one line, nothing written."""

from __future__ import annotations

import json

import pytest
import torch
from support import tiny_llama, tiny_moe  # tests/support.py

import surgery
from surgery.core.errors import ConfigError
from surgery.ops.planning.plans import Plan, PlanRow

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

G = surgery.GridSpec
INT8 = G(bits=8, symmetric=True, per_channel=True)


def quantization_config(folder) -> dict:
    return json.loads((folder / "config.json").read_text())["quantization_config"]


def groups_matching(folder, model) -> dict[str, list[str]]:
    """Each Linear of ``model``, by name, with the config groups matching it (compressed-tensors'
    own matcher, less the ``ignore`` list)."""
    from compressed_tensors.utils.match import is_match

    config = quantization_config(folder)
    found = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            matched = [
                group for group, scheme in config["config_groups"].items() if is_match(name, module, scheme["targets"])
            ]
            found[name] = [] if is_match(name, module, config["ignore"]) else matched
    return found


def load(folder):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).eval()


def test_layers_on_int8_int4_and_fp8_grids_load_with_logits_equal_to_the_simulation(tmp_path):
    model = tiny_llama()
    ids = torch.randint(0, 128, (2, 16))
    handles = [
        surgery.quantize(model, weights=INT8, select="**.self_attn.*_proj"),
        surgery.quantize(model, weights=G(bits=4, symmetric=True, group_size=128), select="**.down_proj"),
        surgery.quantize(model, weights=G(format="fp8_e4m3", per_channel=True), select=["**.gate_proj", "**.up_proj"]),
    ]
    with surgery.compose(*handles) as handle:
        expected = model(ids).logits
        record = surgery.export(handle, tmp_path / "llama", format="compressed-tensors", inputs=[ids])
    assert record.parity.equal and record.parity.expected == "exact" and record.parity.holds, record.parity
    assert torch.equal(load(tmp_path / "llama")(ids).logits, expected)
    config = quantization_config(tmp_path / "llama")
    formats = [group["format"] for group in config["config_groups"].values()]
    assert config["format"] == "mixed-precision" and formats == ["pack-quantized"] * 2 + ["float-quantized"]
    matched = groups_matching(tmp_path / "llama", model)
    assert matched.pop("lm_head") == [] and all(len(groups) == 1 for groups in matched.values()), matched
    assert {groups[0] for name, groups in matched.items() if "self_attn" in name} == {"group_0"}


def test_a_plan_mixing_int8_fp8_and_fp4_loads_with_its_weights(tmp_path):
    model = tiny_llama(layers=1, dtype=torch.bfloat16)  # compressed-tensors unpacks FP4 to bfloat16
    ids = torch.randint(0, 128, (1, 8))
    calibration = [torch.randint(0, 128, (1, 8))]
    plan = surgery.plan(model, "6bpw", ["int8", "fp8", "nvfp4"], calibration=calibration, estimate="drift")
    assert len(plan.counts()) >= 2, plan.counts()  # a mix, or the test tests one scheme
    with plan.apply(model, calibration=calibration) as handle:
        ours = {row.layer: model.get_submodule(row.layer).weight.detach().clone() for row in plan.rows}
        record = surgery.export(handle, tmp_path / "llama", format="compressed-tensors", inputs=[ids])
    assert record.parity.expected == "cosine>=0.9999" and record.parity.holds, record.parity
    loaded = record.load()
    loaded(ids)  # decompressed at its first forward
    assert all(torch.equal(loaded.get_submodule(layer).weight, weight) for layer, weight in ours.items())
    assert len(quantization_config(tmp_path / "llama")["config_groups"]) == len(plan.counts())


def test_a_mix_with_zero_points_transformers_dequantizes_with_one_scheme_is_one_line(tmp_path):
    """transformers loads a folder marked ``dequantize`` with the first group's scheme for every
    layer (measured: the int4 group-32 layer fails against the int8 per-channel scheme)."""
    model = tiny_llama(layers=1)
    handles = [
        surgery.quantize(model, weights=INT8, select="**.self_attn.*_proj"),
        surgery.quantize(model, weights=G(bits=4, symmetric=False, group_size=32), select="**.mlp.*_proj"),
    ]
    with surgery.compose(*handles) as handle, pytest.raises(ConfigError) as raised:
        surgery.export(handle, tmp_path / "llama", format="compressed-tensors")
    message = str(raised.value)
    assert "model.layers.0.mlp.gate_proj has zero points" in message and "model.layers.0.self_attn" in message
    assert len(message.splitlines()) == 1 and not (tmp_path / "llama").exists()


def test_a_pruned_layer_left_unquantized_in_a_plan_is_one_line(tmp_path):
    model = tiny_llama(layers=1)
    rows = [
        PlanRow("model.layers.0.mlp.up_proj", "2:4", (128, 64), 9216, 0.1),
        PlanRow("model.layers.0.mlp.down_proj", "int8", (64, 128), 8320, 0.1),
    ]
    with Plan(rows, 20_000, "drift", "exact").apply(model) as handle:
        with pytest.raises(ConfigError) as raised:
            surgery.export(handle, tmp_path / "llama", format="compressed-tensors")
    message = str(raised.value)
    assert "model.layers.0.mlp.up_proj is pruned but not quantized" in message and "sparse compressor" in message
    assert len(message.splitlines()) == 1 and not (tmp_path / "llama").exists()


def test_experts_on_their_own_grid_load_whichever_was_quantized_first(tmp_path):
    """transformers dequantizes every expert with the first group naming layers: the experts'
    group is written first (measured: written second, the logits differ by 0.53)."""
    model = tiny_moe("qwen3_moe")
    ids = torch.randint(0, 64, (2, 8))
    handles = [
        surgery.quantize(model, weights=G(bits=4, symmetric=True, group_size=16), select="**.self_attn.*_proj"),
        surgery.quantize(model, weights=INT8, select="**.experts.**"),
    ]
    with surgery.compose(*handles) as handle:
        expected = model(ids).logits
        record = surgery.export(handle, tmp_path / "moe", format="compressed-tensors", inputs=[ids])
    assert record.parity.equal, record.parity
    assert torch.equal(load(tmp_path / "moe")(ids).logits, expected)
    first = quantization_config(tmp_path / "moe")["config_groups"]["group_0"]
    assert first["weights"]["num_bits"] == 8 and all(".experts." in target for target in first["targets"])


def test_experts_on_two_grids_are_one_line(tmp_path):
    model = tiny_moe("qwen3_moe")
    handles = [
        surgery.quantize(model, weights=INT8, select="**.experts.*.gate_proj"),
        surgery.quantize(
            model,
            weights=G(bits=4, symmetric=True, group_size=16),
            select=["**.experts.*.up_proj", "**.experts.*.down_proj"],
        ),
    ]
    with surgery.compose(*handles) as handle, pytest.raises(ConfigError) as raised:
        surgery.export(handle, tmp_path / "moe", format="compressed-tensors")
    message = str(raised.value)
    assert "experts model.layers.0.mlp.experts.0.gate_proj and model.layers.0.mlp.experts.0." in message
    assert len(message.splitlines()) == 1 and not (tmp_path / "moe").exists()
