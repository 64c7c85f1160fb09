"""OWL's layer-wise sparsity against a re-implementation of the OWL repository's
``prune_wanda_outlier`` ratio pass, and the allocation as ``prune(amounts=...)`` uses it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support import tiny_llama  # tests/support.py
from torch import nn

import surgery
from surgery.core.errors import ConfigError


def batches(vocab: int = 128) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (2, 16), generator=generator) for _ in range(4)]


def reference_owl(model: nn.Module, data: list[torch.Tensor], sparsity: float, lam: float, m: float) -> list[float]:
    """The OWL repository's ratio pass: per decoder layer, Wanda's metric |W| · sqrt(scaler_row)
    (scaler_row the running mean over samples of each input feature's squared norm) of every
    Linear, pooled; the percentage above M × its mean; min-max scaled to [0, 2λ], centred on
    1 − sparsity."""
    layers = model.model.layers
    scaler: dict[nn.Module, list] = {}

    def hook(module, args):
        inp = args[0].detach()
        count = inp.shape[0]
        rows = inp.reshape(-1, inp.shape[-1]).t().float()
        value, seen = scaler.get(module, (torch.zeros(rows.shape[0]), 0))
        value = value * seen / (seen + count) + torch.norm(rows, p=2, dim=1) ** 2 / (seen + count)
        scaler[module] = (value, seen + count)

    linears = [[mod for mod in layer.modules() if isinstance(mod, nn.Linear)] for layer in layers]
    handles = [mod.register_forward_pre_hook(hook) for group in linears for mod in group]
    with torch.no_grad():
        for x in data:
            model(x)
    for handle in handles:
        handle.remove()
    ratios = []
    for group in linears:
        metric = torch.cat([(mod.weight.abs() * torch.sqrt(scaler[mod][0].reshape(1, -1))).flatten() for mod in group])
        ratios.append(float((metric > torch.mean(metric) * m).sum().item()) / metric.numel() * 100)
    ratios = np.array(ratios)
    ratios = (ratios - ratios.min()) * (1 / (ratios.max() - ratios.min()) * lam * 2)
    ratios = ratios - np.mean(ratios) + (1 - sparsity)
    return [1 - r for r in ratios]


@pytest.mark.parametrize(("sparsity", "lam", "m"), [(0.7, 0.08, 5.0), (0.5, 0.2, 3.0)])
def test_block_sparsities_equal_the_reference_ratio_pass(sparsity, lam, m):
    model = tiny_llama(layers=6, vocab=128)
    allocation = surgery.owl_amounts(model, batches(), sparsity, lam=lam, m=m, progress=False)
    expected = reference_owl(model, batches(), sparsity, lam, m)
    assert list(allocation.blocks) == [f"model.layers.{i}" for i in range(6)]
    # measured equal to 1e-16; a score a rounding away from the threshold could move one count
    assert list(allocation.blocks.values()) == pytest.approx(expected, abs=1e-6)
    assert np.mean(list(allocation.blocks.values())) == pytest.approx(sparsity)
    assert max(allocation.blocks.values()) - min(allocation.blocks.values()) == pytest.approx(2 * lam)  # the span is 2λ
    assert allocation["model.layers.2.mlp.down_proj"] == allocation.blocks["model.layers.2"]
    assert "lm_head" not in allocation  # outside the blocks: prune's own amount applies


def test_prune_with_the_allocation_reaches_each_blocks_sparsity_and_restores():
    model = tiny_llama(layers=4, vocab=128)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    allocation = surgery.owl_amounts(model, batches(), 0.6, progress=False)
    handle = surgery.prune(model, 0.6, method="wanda", amounts=allocation, calibration=batches(), exclude="lm_head")
    for block, amount in allocation.blocks.items():
        weights = [
            mod.weight
            for name, mod in model.named_modules()
            if name.startswith(block + ".") and isinstance(mod, nn.Linear)
        ]
        zeros = sum(int((w == 0).sum()) for w in weights) / sum(w.numel() for w in weights)
        assert abs(zeros - amount) < 1 / 64  # per row, floor(64 × amount) of 64 inputs (128 for down_proj)
    handle.restore()
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())


def test_an_offloaded_model_gets_the_same_allocation(tmp_path):
    model = tiny_llama(layers=3, vocab=128)
    model.save_pretrained(tmp_path)
    in_memory = surgery.owl_amounts(model, batches(), 0.5, progress=False)
    offloaded = surgery.owl_amounts(surgery.offloaded(tmp_path), batches(), 0.5, progress=False)
    assert dict(offloaded) == dict(in_memory) and offloaded.outlier_ratios == in_memory.outlier_ratios


def test_a_timm_vision_transformer_gets_an_allocation_for_its_blocks():
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8).eval()
    images = [torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    allocation = surgery.owl_amounts(model, images, 0.5, lam=0.1, progress=False)
    assert list(allocation.blocks) == [f"blocks.{i}" for i in range(12)]
    assert np.mean(list(allocation.blocks.values())) == pytest.approx(0.5)
    assert "head" not in allocation and "blocks.0.attn.qkv" in allocation


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"sparsity": 1.5}, "owl.sparsity"),
        ({"sparsity": 0.05}, "owl.lam"),  # 0.05 - 0.08 < 0
        ({"sparsity": 0.5, "m": 0}, "owl.m"),
        ({"sparsity": 0.5, "lam": float("nan")}, "owl.lam"),
        ({"sparsity": 0.5, "blocks": False}, "owl.blocks"),
    ],
)
def test_bad_settings_are_one_line_errors(kwargs, field):
    model = tiny_llama(layers=2, vocab=128)
    with pytest.raises(ConfigError) as caught:
        surgery.owl_amounts(model, batches(), progress=False, **kwargs)
    assert caught.value.field == field and "\n" not in str(caught.value)


def test_no_calibration_is_refused():
    with pytest.raises(ConfigError, match="prune.calibration"):
        surgery.owl_amounts(tiny_llama(layers=2, vocab=128), [], 0.5, progress=False)


def test_a_block_pushed_outside_0_1_by_the_span_is_refused_naming_it():
    from surgery.ops.sparsity.owl import _sparsities

    surgery.ops.sparsity.owl.check_settings(0.95, 0.05, 5.0)  # passes: 0.95 ± 0.05 is inside [0, 1] ...
    with pytest.raises(ConfigError, match=r"owl.lam=0.05: puts a at sparsity 1.025, outside \[0, 1\]"):
        _sparsities({"a": 1.0, "b": 10.0, "c": 10.0, "d": 10.0}, 0.95, 0.05)  # ... but one block stands apart


def test_the_old_name_owl_plan_is_the_allocation_and_warns():
    import surgery.ops.sparsity.owl as owl

    for module in (surgery, owl):
        with pytest.deprecated_call(match="OwlPlan is now OwlAllocation"):
            assert module.OwlPlan is surgery.OwlAllocation
    assert "OwlPlan" not in surgery.__all__ and "OwlAllocation" in surgery.__all__
