"""linearize: a hook of the caller's on a fused experts module is refused (it would stop firing);
an offloaded model's hooks, which only bring its weights in, are not."""

from __future__ import annotations

import pytest
import torch

import surgery
from surgery.core.errors import ConfigError
from surgery.ops.experts.linear_experts import LinearExperts
from surgery.ops.experts.linearizing import linearized
from tests.support import tiny_moe


def test_a_hook_of_the_caller_on_fused_experts_is_refused_and_nothing_swapped():
    model = tiny_moe("mixtral", layers=1)
    experts = model.model.layers[0].mlp.experts
    experts.register_forward_hook(lambda module, args, output: None)
    with pytest.raises(ConfigError, match="has hooks of its own") as err:
        surgery.linear_experts(model)
    assert "\n" not in str(err.value) and model.model.layers[0].mlp.experts is experts


def test_an_offloaded_model_s_weight_hooks_let_its_experts_be_made_layers(tmp_path):
    tiny_moe("mixtral", layers=1).save_pretrained(tmp_path)
    source = surgery.offloaded(tmp_path)
    fused = source.model.model.layers[0].mlp.experts
    with linearized(source.model) as swapped:
        assert swapped == ["model.layers.0.mlp.experts"]
        assert isinstance(source.model.model.layers[0].mlp.experts, LinearExperts)
    assert source.model.model.layers[0].mlp.experts is fused
    assert all(p.is_meta for p in source.model.parameters())


def test_a_calibration_error_about_an_expert_s_layer_says_its_router_sent_it_nothing():
    model = tiny_moe("gpt_oss", 1)
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ConfigError, match="was sent no calibration token by its router") as err:
        surgery.sensitivity(model, (0.5,), calibration=[tokens], method="wanda", select="**.experts.**")
    assert str(err.value).startswith("calibration='model.layers.0.mlp.experts.") and "every_expert_calibrated" in str(
        err.value
    )
    assert type(model.model.layers[0].mlp.experts).__name__ == "GptOssExperts"
    with pytest.raises(ConfigError, match="^calibration='0 batches'"), linearized(model):
        raise ConfigError("calibration", "0 batches", "must hold at least one batch")  # not about an expert: as it was
