"""A verb's attach holds one copy of what it changes: experts held once while per-expert layers
stand in, folded back one tensor at a time into the same parameters, grids held compactly."""

from __future__ import annotations

import gc

import pytest
import torch
from support import tiny_llama, tiny_moe  # tests/support.py
from torch import nn

import surgery
from surgery.ops.experts.layouts import fused_experts

W4G32 = surgery.GridSpec(bits=4, group_size=32)


def tensor_bytes() -> int:
    """The bytes of every distinct tensor storage the interpreter can reach (after a collection)."""
    gc.collect()
    storages = {}
    for obj in gc.get_objects():
        if type(obj) in (torch.Tensor, nn.Parameter) and obj.device.type == "cpu":  # not fake/functional ones
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def changed_bytes(handle) -> int:
    return sum(t.param.numel() * t.param.element_size() for t in handle.selection.matched.values())


@pytest.mark.parametrize(
    "build", [lambda: tiny_llama(2, hidden=128), lambda: tiny_moe("qwen3_moe", 2, hidden=128, experts=8)]
)
def test_an_attached_quantize_holds_one_copy_of_the_weights_it_changes(build):
    model = build()
    before = tensor_bytes()
    handle = surgery.quantize(model, weights=W4G32, exclude="lm_head", progress=False)
    held = tensor_bytes() - before
    changed = changed_bytes(handle)
    # the originals once (1.0), the grid: float32 scales (4 bytes) and one-byte zero points a
    # group of 32 float32 weights (128 bytes): 1.039; nothing else of the weights' size
    assert changed * 1.0 <= held <= changed * 1.045, held / changed
    handle.restore()


def test_per_expert_layers_replace_the_fused_tensors_while_attached_and_give_them_back():
    model = tiny_moe("qwen3_moe", 1, hidden=64, experts=8)
    name = next(iter(fused_experts(model)))
    fused = model.get_submodule(name)
    params = dict(fused.named_parameters())
    originals = {key: p.detach().clone() for key, p in params.items()}
    handle = surgery.quantize(model, weights=W4G32, progress=False)
    assert all(p.numel() == 0 for p in params.values())  # released: the per-expert layers hold the values
    assert model.get_submodule(name) is not fused
    handle.restore()
    assert model.get_submodule(name) is fused
    for key, param in fused.named_parameters():
        assert param is params[key]  # the same Parameter objects (an optimizer's references hold)
        assert torch.equal(param, originals[key])


def test_bake_writes_the_fused_tensors_expert_by_expert_with_the_quantized_values():
    model = tiny_moe("qwen3_moe", 1, hidden=64, experts=8)
    ids = torch.randint(0, 128, (1, 12))
    handle = surgery.quantize(model, weights=W4G32, progress=False)
    with torch.no_grad():
        expected = model(ids).logits
    handle.bake()
    assert not any(isinstance(m, nn.ModuleList) and "experts" in n and len(m) == 8 for n, m in model.named_modules())
    with torch.no_grad():
        assert torch.equal(model(ids).logits, expected)


def test_a_per_expert_layer_of_another_shape_is_refused_before_anything_is_written():
    model = tiny_moe("qwen3_moe", 1, hidden=64, experts=4)
    handle = surgery.linear_experts(model)
    name = handle.swapped[0]
    experts = model.get_submodule(name)
    fitting = experts[1].down_proj.weight
    experts[1].down_proj.weight = nn.Parameter(torch.zeros(3, 3))
    with pytest.raises(surgery.UndoError, match="now has shape"):
        handle.restore()
    assert model.get_submodule(name) is experts  # nothing folded back
    assert fitting.shape == experts[0].down_proj.weight.shape  # the other experts' layers as they were
    assert all(p.numel() for n, p in experts.named_parameters() if not n.startswith("1.down_proj"))


def test_grids_are_held_compactly_and_read_as_given():
    layer = nn.Linear(256, 64)
    handle = surgery.quantize(layer, weights=W4G32, progress=False)
    quantizer = handle.weights["weight"]
    handle.restore()
    assert quantizer._zero_point.dtype == torch.uint8 and quantizer.zero_point.dtype == torch.int32
    assert quantizer.scale.dtype == torch.float32
    half = nn.Linear(256, 64).bfloat16()
    with surgery.quantize(half, weights=W4G32, progress=False) as handle:
        quantizer = handle.weights["weight"]
    assert quantizer._scale.dtype == torch.bfloat16  # its values are bf16 values: held in 2 bytes
    assert quantizer.scale.dtype == torch.float32
    spec = surgery.GridSpec(bits=4, group_size=32, symmetric=True)
    with surgery.quantize(nn.Linear(256, 64), weights=spec, progress=False) as symmetric:
        zero = symmetric.weights["weight"]._zero_point
        assert zero.untyped_storage().nbytes() <= 4  # one value, held once
        assert torch.equal(symmetric.weights["weight"].zero_point, torch.zeros(64, 8, dtype=torch.int32))
