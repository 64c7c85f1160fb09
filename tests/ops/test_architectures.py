"""Identity, restore and bake invariants of ``surgery.prune`` on torchvision model families."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import torch
import torchvision
from torch import nn

import surgery
from surgery.testing import Snapshot, collect, max_difference, module_hook_counts, snapshot, snapshot_differences

# (name, input side, extra constructor arguments). Inputs are 64x64 wherever the network allows;
# ViT takes its image size as an argument and still holds nn.MultiheadAttention blocks whose
# out_proj weight the parent reads directly.
ARCHITECTURES = [
    ("resnet18", 64, {}),
    ("mobilenet_v3_small", 64, {}),
    ("efficientnet_b0", 64, {}),
    ("squeezenet1_0", 64, {}),
    ("shufflenet_v2_x0_5", 64, {}),
    ("regnet_x_400mf", 64, {}),
    ("densenet121", 64, {}),
    ("convnext_tiny", 64, {}),
    ("vit_b_16", 64, {"image_size": 64}),
    ("swin_t", 64, {}),
]


@dataclass
class Subject:
    name: str
    factory: Callable[..., nn.Module]
    model: nn.Module
    inputs: list[torch.Tensor]
    expected: list[torch.Tensor]
    before: Snapshot


def _randomise_zero_weights(model: nn.Module) -> nn.Module:
    """Give zero-initialised layers (ViT's classifier head) random weights, so outputs carry signal."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Linear) and not module.weight.any():
                nn.init.normal_(module.weight, std=0.05)
                nn.init.normal_(module.bias, std=0.05)
    return model.eval()


def _factory(name: str, kwargs: dict) -> Callable[..., nn.Module]:
    def build(seed: int = 0) -> nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return _randomise_zero_weights(torchvision.models.get_model(name, weights=None, num_classes=10, **kwargs))

    return build


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """Run this module single-threaded: on 1x3x64x64 inputs the thread pool buys little, and on a
    shared 2-core runner an oversubscribed pool makes these forwards several times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=ARCHITECTURES, ids=[a[0] for a in ARCHITECTURES])
def subject(request) -> Iterator[Subject]:
    """One untouched model per architecture; every test must leave it exactly as it found it."""
    name, side, kwargs = request.param
    factory = _factory(name, kwargs)
    model = factory()
    inputs = [torch.randn(1, 3, side, side, generator=torch.Generator().manual_seed(0))]
    yield Subject(name, factory, model, inputs, collect(model, inputs), snapshot(model))


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return max_difference(a, b)[0]


def test_identity_amount_zero_is_bit_identical(subject):
    with surgery.prune(subject.model, 0.0) as handle:
        assert handle.sparsity() == 0.0
        assert _same(collect(subject.model, subject.inputs), subject.expected)
    assert snapshot_differences(subject.before, snapshot(subject.model)) == []


def test_restore_is_bit_exact(subject):
    handle = surgery.prune(subject.model, 0.5)
    try:
        assert handle.sparsity() == pytest.approx(0.5, abs=0.01)
        assert not _same(collect(subject.model, subject.inputs), subject.expected)
    finally:
        handle.restore()
    assert snapshot_differences(subject.before, snapshot(subject.model)) == []
    assert _same(collect(subject.model, subject.inputs), subject.expected)


def test_bake_equals_hooked_and_loads_strictly_into_a_fresh_instance(subject):
    model = subject.factory()
    handle = surgery.prune(model, 0.5, method="ln_structured", scope="global")
    hooked = collect(model, subject.inputs)
    handle.bake()
    assert sum(module_hook_counts(model).values()) == 0
    baked = collect(model, subject.inputs)
    assert _same(baked, hooked)
    fresh = subject.factory(seed=1)
    fresh.load_state_dict(model.state_dict(), strict=True)
    assert _same(collect(fresh, subject.inputs), hooked)
    assert not _same(hooked, subject.expected)


def _tiny_vit(seed: int = 0) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = torchvision.models.VisionTransformer(
            image_size=32, patch_size=16, num_layers=1, num_heads=2, hidden_dim=32, mlp_dim=64, num_classes=10
        )
        return _randomise_zero_weights(model)


def test_vit_attention_out_proj_is_masked_even_when_changed_behind_the_hooks():
    """ViT's MultiheadAttention reads out_proj.weight itself; out_proj's own forward never runs."""
    model = _tiny_vit()
    out_proj = model.encoder.layers[0].self_attention.out_proj
    inputs = [torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))]
    with surgery.prune(model, 0.5, select="re:.*out_proj") as handle:
        mask = handle.masks()["encoder.layers.encoder_layer_0.self_attention.out_proj.weight"]
        assert list(handle.masks()) == ["encoder.layers.encoder_layer_0.self_attention.out_proj.weight"]
        with torch.no_grad():
            out_proj.weight.add_(1.0)  # e.g. an optimizer step: pruned entries are no longer zero
        reference = _tiny_vit(seed=1)
        reference.load_state_dict(model.state_dict())
        with torch.no_grad():
            reference.encoder.layers[0].self_attention.out_proj.weight.masked_fill_(~mask, 0)
        pruned = collect(model, inputs)
        assert not out_proj.weight[~mask].any()
        assert _same(pruned, collect(reference, inputs))
        assert not _same(pruned, collect(_tiny_vit(), inputs))
