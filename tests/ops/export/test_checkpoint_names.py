"""Each layer by the name its checkpoint gives it, as transformers' own conversion mapping reverts
the model's names: per-expert names where the family's checkpoints have them, none where they
keep the experts fused."""

from __future__ import annotations

import pytest
from support import tiny_moe  # tests/support.py

import surgery
from surgery.core.errors import ConfigError
from surgery.ops.export.formats.checkpoint_names import checkpoint_names

pytest.importorskip("transformers")


def test_mixtral_experts_are_named_as_its_checkpoints_name_them():
    model = tiny_moe("mixtral")
    layers = ["model.layers.0.mlp.experts.1.gate_proj", "model.layers.0.mlp.experts.1.up_proj"]
    layers += ["model.layers.0.mlp.experts.3.down_proj", "model.layers.0.self_attn.q_proj"]
    with surgery.linear_experts(model):
        names = checkpoint_names(model, layers, "test")
    assert names == {
        "model.layers.0.mlp.experts.1.gate_proj": "model.layers.0.block_sparse_moe.experts.1.w1",
        "model.layers.0.mlp.experts.1.up_proj": "model.layers.0.block_sparse_moe.experts.1.w3",
        "model.layers.0.mlp.experts.3.down_proj": "model.layers.0.block_sparse_moe.experts.3.w2",
        "model.layers.0.self_attn.q_proj": "model.layers.0.self_attn.q_proj",
    }


def test_experts_a_checkpoint_keeps_fused_have_no_names():
    model = tiny_moe("gpt_oss")
    layers = ["model.layers.0.mlp.experts.0.gate_proj", "model.layers.0.self_attn.q_proj"]
    with surgery.linear_experts(model):
        assert checkpoint_names(model, layers, None) == {layers[1]: layers[1]}
        with pytest.raises(ConfigError, match=r"gpt_oss experts \(model.layers.0.mlp.experts\) have no per-expert"):
            checkpoint_names(model, layers, "a format needs them")
