"""REAP's router-weighted expert activation norm and the routed-token counts, checked against a
hand computation from the fused weights on the same tokens."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from surgery.ops.experts.expert_pruning import prune_experts
from surgery.ops.experts.expert_scores import EXPERT_CRITERIA, ExpertStats, register_expert_criterion
from tests.support import tiny_moe

TOKENS = torch.randint(0, 128, (3, 16), generator=torch.Generator().manual_seed(5))


def _by_hand(model: torch.nn.Module, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """REAP scores and routed counts of one layer: the block's input captured, then the router's
    softmax over all logits and each expert's SwiGLU output computed from the fused tensors."""
    block = model.model.layers[layer].mlp
    seen = []
    hook = block.register_forward_pre_hook(lambda m, args: seen.append(args[0].reshape(-1, args[0].shape[-1])))
    with torch.no_grad():
        model(TOKENS)
    hook.remove()
    h = torch.cat(seen).detach()
    probs = torch.softmax(h @ block.gate.weight.T, dim=-1)
    chosen = probs.topk(block.gate.top_k, dim=-1).indices
    experts = block.experts
    return _reap_of(h, probs, chosen, experts)


@torch.no_grad()
def _reap_of(h: torch.Tensor, probs: torch.Tensor, chosen: torch.Tensor, experts: torch.nn.Module) -> tuple:
    """Per expert: the mean of g_j * ||f_j|| over the rows that chose j, and how many did."""
    scores, counts = torch.zeros(experts.num_experts), torch.zeros(experts.num_experts, dtype=torch.long)
    for j in range(experts.num_experts):
        rows = (chosen == j).any(dim=-1)
        gate, up = (h[rows] @ experts.gate_up_proj[j].T).chunk(2, dim=-1)
        out = (F.silu(gate) * up) @ experts.down_proj[j].T
        counts[j] = int(rows.sum())
        scores[j] = (probs[rows, j] * out.norm(dim=-1)).mean() if rows.any() else 0.0
    return scores, counts


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "olmoe"])
def test_reap_score_matches_the_formula_by_hand(family: str) -> None:
    model = tiny_moe(family, 2, experts=6, top_k=2)
    expected, counts = _by_hand(model)
    with torch.no_grad():
        handle = prune_experts(model, 2, calibration=[TOKENS], criterion="reap")
    name = "model.layers.0.mlp.experts"
    torch.testing.assert_close(torch.tensor(handle.scores[name], dtype=torch.float32), expected, rtol=1e-4, atol=1e-5)
    assert handle.tokens_per_expert[name] == counts.tolist()
    assert sum(counts.tolist()) == TOKENS.numel() * 2  # top-2: every token counted twice
    lowest = sorted(range(6), key=lambda e: float(expected[e]))[:2]
    assert sorted(handle.removed[name]) == sorted(lowest)


def test_frequency_removes_the_experts_routed_fewest_tokens() -> None:
    model = tiny_moe("qwen3_moe", 1, experts=6, top_k=2)
    _, counts = _by_hand(model)
    handle = prune_experts(model, 3, calibration=[TOKENS], criterion="frequency")
    name = "model.layers.0.mlp.experts"
    assert handle.scores[name] == [float(c) for c in counts.tolist()]
    kept_counts = [counts[e] for e in handle.kept[name]]
    assert min(kept_counts) >= max(counts[e] for e in handle.removed[name])


def test_a_registered_criterion_chooses_the_experts() -> None:
    register_expert_criterion("last_first", lambda stats: -torch.arange(stats.num_experts, dtype=torch.float64))
    try:
        model = tiny_moe("mixtral", 1, experts=4, top_k=2)
        handle = prune_experts(model, 0.5, calibration=[TOKENS], criterion="last_first")
        assert handle.removed["model.layers.0.mlp.experts"] == [2, 3]
    finally:
        EXPERT_CRITERIA.unregister("last_first")


def test_random_is_seeded_and_needs_no_calibration() -> None:
    picks = []
    for _ in range(2):
        model = tiny_moe("olmoe", 2, experts=8, top_k=2)
        picks.append(prune_experts(model, 0.5, criterion="random", seed=3).removed)
    assert picks[0] == picks[1]
    stats = ExpertStats(torch.zeros(4, dtype=torch.long), torch.zeros(4, dtype=torch.float64))
    assert EXPERT_CRITERIA.get("random")(stats).shape == (4,)
