"""The attribution forward's memory guard: an input whose activations would not fit is refused
in one line naming its shape and the estimate, before the forward runs; the estimate, from a
small probe, follows what autograd saves at full size."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from torch import nn

import surgery
from surgery.analysis import attribution_memory
from surgery.analysis.attribution_memory import _saved_bytes, estimated_bytes
from surgery.core.errors import ConfigError
from surgery.core.inputs import as_call


def cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 4),
    ).eval()


def test_an_input_whose_activations_do_not_fit_is_refused_before_its_forward():
    model = cnn()
    seen = []
    model.register_forward_pre_hook(lambda module, args: seen.append(tuple(args[0].shape)))
    images = torch.rand(2, 3, 1024, 1024)  # 25 MB; about 0.5 GB of saved activations with gradients
    with mock.patch.object(attribution_memory, "available_memory", return_value=64 * 2**20):
        with pytest.raises(ConfigError, match=r"^attribution.inputs='shape \(2, 3, 1024, 1024\)': .* needs about 0\."):
            surgery.attribution(model, images, select="2")
    assert seen == [(1, 3, 64, 64)]  # the probe only
    found = surgery.attribution(model, images[:1, :, :32, :32], select="2")  # small: runs
    assert found.maps.shape == (1, 32, 32)


def test_the_estimate_follows_what_autograd_saves_at_full_size():
    model = cnn()
    images = torch.rand(2, 3, 256, 256)
    estimate = estimated_bytes(model, as_call(images), images)
    actual = _saved_bytes(model, as_call(images.clone().requires_grad_(True)))
    assert 0.7 * actual < estimate < 1.3 * actual, (estimate, actual)
