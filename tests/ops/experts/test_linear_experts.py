"""Fused experts as per-expert Linear layers: the same outputs bit for bit in every layout, an exact
restore, and baking that writes each expert's layers back where the fused parameter keeps them."""

from __future__ import annotations

import pytest
import torch

import surgery
from surgery.core.errors import AlreadyModifiedError
from surgery.ops.experts.layouts import fused_experts
from surgery.ops.experts.linear_experts import LinearExperts
from surgery.ops.experts.linearizing import linear_experts
from tests.support import MOE_FAMILIES, tiny_moe

TOKENS = torch.randint(0, 128, (2, 23), generator=torch.Generator().manual_seed(1))


def _logits(model: torch.nn.Module, implementation: str) -> torch.Tensor:
    model.set_experts_implementation(implementation)
    with torch.no_grad():
        return model(TOKENS).logits


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_per_expert_layers_compute_what_the_fused_module_computes(family):
    model = tiny_moe(family)
    before = {name: (param, param.detach().clone()) for name, param in model.named_parameters()}
    fused_class = type(model.model.layers[0].mlp.experts)
    expected = {impl: _logits(model, impl) for impl in ("grouped_mm", "eager")}

    handle = linear_experts(model)
    experts = model.model.layers[0].mlp.experts
    assert isinstance(experts, LinearExperts) and len(experts) == 4
    assert isinstance(experts[3].down_proj, torch.nn.Linear)
    for impl, logits in expected.items():
        assert torch.equal(_logits(model, impl), logits), impl

    handle.restore()
    assert type(model.model.layers[0].mlp.experts) is fused_class
    after = dict(model.named_parameters())
    assert after.keys() == before.keys()
    for name, (param, value) in before.items():
        assert after[name] is param and torch.equal(param, value), name


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_many_tokens_per_expert_still_give_the_grouped_kernel_s_bits(family):
    """About a thousand rows per expert: an elementwise kernel (the gate) splits its work by where a
    row sits in the tensor, so the gate must run over every expert's rows at once, in the order the
    grouped kernel sorts them, to round as it does."""
    fused = tiny_moe(family).model.layers[0].mlp.experts
    experts = LinearExperts.from_fused(fused, fused_experts(tiny_moe(family))["model.layers.0.mlp.experts"])
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(2048, 32, generator=generator)
    index = torch.stack([torch.randperm(4, generator=generator)[:2] for _ in range(2048)])
    weights = torch.rand(2048, 2, generator=generator)
    with torch.no_grad():
        assert torch.equal(experts(hidden, index, weights), fused(hidden, index, weights))
    assert experts.routed == torch.bincount(index.flatten(), minlength=4).tolist()


@pytest.mark.parametrize(
    ("family", "where"),
    [
        ("qwen3_moe", lambda i: ("gate_up_proj", (1, 48 + 2, 5))),  # (E, out, in), gate rows then up rows
        ("gpt_oss", lambda i: ("gate_up_proj", (1, 5, 2 * 2 + 1))),  # (E, in, out), gate and up interleaved
    ],
)
def test_bake_writes_each_expert_where_the_fused_parameter_keeps_it(family, where):
    model = tiny_moe(family)
    handle = linear_experts(model)
    with torch.no_grad():
        model.model.layers[0].mlp.experts[1].up_proj.weight[2, 5] = 7.0
        model.model.layers[0].mlp.experts[1].down_proj.weight[3, 4] = -9.0
    handle.bake()
    experts = model.model.layers[0].mlp.experts
    attr, index = where(0)
    assert getattr(experts, attr)[index] == 7.0
    down = experts.down_proj[1, 4, 3] if family == "gpt_oss" else experts.down_proj[1, 3, 4]
    assert down == -9.0
    assert int((getattr(experts, attr) == 7.0).sum()) == 1


def test_folding_back_waits_for_a_later_handle_on_the_expert_layers():
    model = tiny_moe("qwen3_moe")
    handle = linear_experts(model)
    pruned = surgery.prune(model, 0.5, select="model.layers.0.mlp.experts.0.up_proj")
    with pytest.raises(AlreadyModifiedError, match="restore or bake prune first"):
        handle.restore()
    assert isinstance(model.model.layers[0].mlp.experts, LinearExperts)
    pruned.restore()
    handle.restore()
    assert fused_experts(model)


def test_a_model_without_fused_experts_is_left_alone():
    from tests.support import tiny_llama

    model = tiny_llama(1, hidden=32)
    handle = linear_experts(model)
    assert handle.swapped == [] and handle._steps == []
