"""The trace of one expert as a unit: gate/up rows coupled, every expert of a layer one width."""

from __future__ import annotations

import torch
from support import tiny_moe  # tests/support.py

import surgery


def test_global_scope_and_unrouted_experts_keep_one_width_per_layer():
    model = tiny_moe("qwen3_moe", 1, experts=8, top_k=1)
    ids = torch.tensor([[3, 5]])  # two tokens: most experts are sent none, yet all are traced
    handle = surgery.shrink(model, 0.5, calibration=(ids,), scope="global")
    experts = model.model.layers[0].mlp.experts
    assert experts.down_proj.shape[1] == 32  # the hidden width (routed sum) stays
    assert experts.down_proj.shape[2] < 48 and experts.gate_up_proj.shape[1] == 2 * experts.down_proj.shape[2]
    kept = {name: keep for name, (keep, _) in handle.kept.items() if name.endswith("down_proj")}
    assert len(kept) == 8 and len({len(k) for k in kept.values()}) == 1
    assert len({tuple(k.tolist()) for k in kept.values()}) > 1  # each expert chose its own channels
