"""surgery.shrink on mixture-of-experts models: each expert's intermediate channels go, every expert of
a layer keeps one width, the model's own fused class holds the smaller tensors, restore is exact."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import transformers
from support import MOE_FAMILIES, tiny_moe  # tests/support.py

import surgery
from surgery.ops.experts.layouts import fused_experts
from surgery.testing import snapshot, snapshot_differences

IDS = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
WITH_HEADS = ("mixtral", "qwen2_moe", "qwen3_moe", "phimoe")  # Llama-style attention registered


def zeroed(original: torch.nn.Module, handle) -> torch.nn.Module:
    """The original model with every removed channel's reader columns zeroed: per-expert
    ``down_proj`` inputs in the fused tensor, and the columns of every other smaller layer."""
    masked = copy.deepcopy(original)
    named = dict(masked.named_modules())
    layouts = fused_experts(masked)
    with torch.no_grad():
        for name, (keep_in, _) in handle.kept.items():
            if keep_in is None:
                continue
            owner = next((m for m in layouts if name.startswith(f"{m}.")), None)
            if owner is None:
                if isinstance(named[name], torch.nn.Linear):
                    width = named[name].weight.shape[1]
                    named[name].weight[:, [i for i in range(width) if i not in keep_in.tolist()]] = 0
                continue
            expert = int(name[len(owner) + 1 :].split(".")[0])
            down = named[owner].down_proj[expert]  # (H, I), or (I, H) transposed
            drop = [i for i in range(down.shape[0 if layouts[owner].transposed else 1]) if i not in keep_in.tolist()]
            if layouts[owner].transposed:
                down[drop] = 0
            else:
                down[:, drop] = 0
    return masked


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_experts_lose_channels_in_their_fused_class_and_restore_is_exact(family):
    model = tiny_moe(family, 2)
    original = copy.deepcopy(model)
    before, objects = snapshot(model), dict(model.named_modules())
    fused = {name: layout for name, layout in fused_experts(model).items()}
    handle = surgery.shrink(model, 0.5, calibration=(IDS,))
    assert fused_experts(model).keys() == fused.keys()  # the model's own class again, smaller
    for name in fused:
        module = model.get_submodule(name)
        assert type(module) is type(objects[name])
        down = module.down_proj
        assert down.shape[1 if fused[name].transposed else 2] == 24  # 48 wide, half removed in every expert
    assert handle.params()["after"] < handle.params()["before"]
    assert handle.coverage is not None and handle.coverage.changed_params > 0
    if family in WITH_HEADS:
        assert model.model.layers[0].self_attn.q_proj.out_features == 16  # half the heads
    with torch.no_grad():
        torch.testing.assert_close(model(IDS).logits, zeroed(original, handle)(IDS).logits, rtol=1e-4, atol=1e-5)
    handle.restore()
    assert snapshot_differences(before, snapshot(model)) == []
    assert all(module is objects[name] for name, module in model.named_modules())
    assert handle.coverage is None


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_the_config_follows_the_experts_width_and_the_saved_model_loads(family, tmp_path):
    model = tiny_moe(family, 2)
    field = "moe_intermediate_size" if family == "qwen3_moe" else "intermediate_size"
    handle = surgery.shrink(
        model, 0.5, calibration=(IDS,), exclude=["model.layers.0.self_attn", "model.layers.1.self_attn"]
    )
    assert handle.config_changes == {field: (48, 24)} and getattr(model.config, field) == 24
    model.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        assert torch.equal(loaded(IDS).logits, model(IDS).logits)
    handle.restore()
    assert getattr(model.config, field) == 48


def test_experts_of_one_layer_only_keep_the_config_and_say_so(caplog):
    model = tiny_moe("qwen3_moe", 2)
    with caplog.at_level(logging.WARNING, logger="surgery"):
        handle = surgery.shrink(model, 0.5, calibration=(IDS,), select="model.layers.0.mlp")
    assert model.model.layers[0].mlp.experts.down_proj.shape[2] == 24
    assert model.model.layers[1].mlp.experts.down_proj.shape[2] == 48
    assert model.config.moe_intermediate_size == 48 and handle.config_changes == {}
    assert "not one the config can hold" in caplog.text
    structure = handle.structure()
    assert structure["model.layers.0.mlp.experts"]["parameters"]["down_proj"] == [4, 32, 24]


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_rebuild_makes_the_shrunk_fused_experts_from_the_structure(family):
    model = tiny_moe(family, 2)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    handle = surgery.shrink(model, 0.5, calibration=(ids,))
    with torch.no_grad():
        expected = model(ids).logits
    plan = handle.structure()  # sealed with the fused model, as its constructor builds it
    handle.bake()
    rebuilt = surgery.rebuild(lambda: tiny_moe(family, 2), plan)
    rebuilt.load_state_dict(model.state_dict(), strict=True)
    with torch.no_grad():
        assert torch.equal(rebuilt(ids).logits, expected)
