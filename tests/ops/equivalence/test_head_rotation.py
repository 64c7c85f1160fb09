"""Per-head value rotations (SpinQuant's R2): found in every attention with v_proj, o_proj and
a head_dim, and folded into both so the model computes the same function."""

from __future__ import annotations

import pytest
import torch
from support import tiny_llama  # tests/support.py

from surgery.ops.equivalence.head_rotation import Heads, find_heads, rotate_heads
from surgery.ops.equivalence.rotation import hadamard

pytest.importorskip("transformers")


def test_a_rotation_of_each_heads_values_and_outputs_keeps_the_function():
    model = tiny_llama(layers=2)  # 4 heads, 2 key/value heads of 16
    heads = find_heads(dict(model.named_modules()), ["model.layers.0", "model.layers.1"])
    assert heads["model.layers.1.self_attn"] == Heads(
        "model.layers.1.self_attn.v_proj", "model.layers.1.self_attn.o_proj", 16
    )
    weights = {name: p.detach() for name, p in model.named_parameters()}
    values: dict[str, torch.Tensor] = {}
    for seed, found in enumerate(heads.values()):
        rotate_heads(values, weights, found, hadamard(16, seed))
    assert set(values) == {f"model.layers.{i}.self_attn.{p}.weight" for i in range(2) for p in ("v_proj", "o_proj")}
    x = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(x).logits
        after = torch.func.functional_call(model, values, (x,)).logits
    assert not torch.equal(
        values["model.layers.0.self_attn.v_proj.weight"], weights["model.layers.0.self_attn.v_proj.weight"]
    )
    assert ((after - before).abs().max() / before.abs().max()) < 1e-5


def test_layers_outside_the_blocks_are_not_attentions():
    model = tiny_llama(layers=2)
    assert find_heads(dict(model.named_modules()), []) == {}
