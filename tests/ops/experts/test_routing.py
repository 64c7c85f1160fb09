"""Tokens per expert during calibration, every expert on every token on request, and experts that
saw too few tokens named in one line."""

from __future__ import annotations

import pytest
import torch

from surgery.core.errors import ConfigError
from surgery.core.routing import every_expert_calibrated
from surgery.ops.experts.linearizing import linear_experts
from surgery.ops.experts.routing import check_tokens, expert_inputs, gates_in, moe_blocks, tokens_per_expert
from tests.support import tiny_moe

TOKENS = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(3))


def _rows_seen(model: torch.nn.Module) -> dict[int, int]:
    """Rows each expert's up_proj received, by a forward-pre hook (what a statistic would see)."""
    seen: dict[int, int] = {}
    hooks = [
        expert.up_proj.register_forward_pre_hook(
            lambda m, args, e=e: seen.__setitem__(e, seen.get(e, 0) + args[0].shape[0])
        )
        for e, expert in enumerate(model.model.layers[0].mlp.experts)
    ]
    with torch.no_grad():
        logits = model(TOKENS).logits
    for hook in hooks:
        hook.remove()
    return seen, logits


def test_each_expert_sees_exactly_its_routed_tokens_and_they_are_counted():
    model = tiny_moe("qwen3_moe")
    with linear_experts(model):
        seen, _ = _rows_seen(model)
        counts = tokens_per_expert(model)["model.layers.0.mlp.experts"]
        assert sum(counts) == 2 * 16 * 2  # every token, top-2
        assert [seen.get(e, 0) for e in range(4)] == counts


def test_every_expert_calibrated_feeds_every_token_and_keeps_the_routed_output():
    model = tiny_moe("mixtral")
    with linear_experts(model):
        _, routed = _rows_seen(model)
        first = tokens_per_expert(model)["model.layers.0.mlp.experts"]
        with every_expert_calibrated():
            seen, everything = _rows_seen(model)
        assert seen == {e: 32 for e in range(4)}
        torch.testing.assert_close(everything, routed, rtol=1e-5, atol=1e-5)  # last-bit differences only
        assert tokens_per_expert(model, "seen")["model.layers.0.mlp.experts"] == [n + 32 for n in first]
        _, again = _rows_seen(model)
        assert torch.equal(again, routed)  # routed again after the block


def test_experts_with_too_few_tokens_are_named():
    with pytest.raises(ConfigError, match=r"quantize.experts=.*mlp.experts.2 \(0\).*too few for gptq"):
        check_tokens({"model.layers.0.mlp.experts": [40, 12, 0, 9]}, 10, "quantize.experts", "gptq")
    check_tokens({"model.layers.0.mlp.experts": [40, 12, 10, 9]}, 9, "quantize.experts", "gptq")


@pytest.mark.parametrize(
    ("family", "gates"),
    [
        ("mixtral", ["gate"]),
        ("phimoe", ["router"]),
        ("qwen2_moe", ["gate", "shared_expert_gate"]),
        ("gpt_oss", ["router"]),
    ],
)
def test_the_routers_and_gates_beside_the_experts_are_found_raw_or_linear(family, gates):
    model = tiny_moe(family, layers=1)
    with linear_experts(model):
        named = dict(model.named_modules())
        assert moe_blocks(named) == ["model.layers.0.mlp"]
        assert sorted(gates_in(named)) == [f"model.layers.0.mlp.{gate}" for gate in gates]
        experts = model.model.layers[0].mlp.experts
        assert expert_inputs("e", experts) == [f"e.{i}.{p}" for i in range(4) for p in ("gate_proj", "up_proj")]
    assert gates_in(dict(model.named_modules())) == {}  # fused experts: no block holds per-expert layers
