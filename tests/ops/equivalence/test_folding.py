"""Folding BatchNorm into the convolution before it (``quantize(..., target=...)``)."""

from __future__ import annotations

import pytest
import torch
from support import NormAct, trained_stats  # tests/support.py
from torch import nn

import surgery

W8 = surgery.GridSpec(bits=8, symmetric=True, per_channel=True)


def test_a_batchnorm_subclass_keeps_what_it_adds_when_folded():
    torch.manual_seed(0)
    model = trained_stats(nn.Sequential(nn.Conv2d(3, 8, 3), NormAct(8), nn.Conv2d(8, 4, 3)))
    x = torch.randn(2, 3, 12, 12)
    expected = model(x)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    handle = surgery.quantize(model, weights=W8, target="onnx", calibration=[x])
    assert handle.folded == [("0", "1")] and isinstance(model[1], NormAct)  # its SiLU is still there
    cosine = torch.nn.functional.cosine_similarity(model(x).flatten(), expected.flatten(), dim=0)
    assert cosine > 0.999  # int8 weights only: the SiLU dropped would leave it near 0.9
    handle.restore()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.equal(model(x), expected)


def test_a_timm_efficientnet_keeps_its_activations_through_folding():
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = trained_stats(timm.create_model("efficientnet_b0", num_classes=10))  # BatchNormAct2d throughout
    x = torch.randn(2, 3, 64, 64)
    expected = model(x)
    with surgery.quantize(model, weights=W8, target="onnx", calibration=[x]) as handle:
        assert len(handle.folded) > 40
        cosine = torch.nn.functional.cosine_similarity(model(x).flatten(), expected.flatten(), dim=0)
        assert cosine > 0.99, cosine


def test_a_folded_batchnorm_subclass_still_trains():
    torch.manual_seed(0)
    model = trained_stats(nn.Sequential(nn.Conv2d(3, 8, 3), NormAct(8), nn.Conv2d(8, 4, 3)))
    x = torch.randn(2, 3, 12, 12)
    handle = surgery.quantize(model, weights=W8, target="onnx", calibration=[x])
    handle.bake()
    model.train()
    model(x).sum().backward()  # its eps is its own: batch statistics still work
    assert model[0].weight.grad is not None
