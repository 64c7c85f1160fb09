"""A second-order method whose layer saw only zeros in calibration has nothing to weigh its error
by and gives the uncalibrated result (round to nearest, magnitude pruning): said per layer, by name,
never passed off as a calibrated result (hostile pass, wave 4, item 3)."""

from __future__ import annotations

import logging

import pytest
import torch
from support import tiny_llama  # tests/support.py

import surgery
from surgery import GridSpec

LAYERS = 7  # q, k, v, o, gate, up, down of the one block


def zeros_or_overflow(fill: float) -> list[dict]:
    # 1e30 overflows the RMSNorm's mean square to inf, and every normalised input to 0
    return [{"inputs_embeds": torch.full((2, 8, 32), fill)}]


@pytest.mark.parametrize("fill", [0.0, 1e30], ids=["zeros", "overflow"])
@pytest.mark.parametrize("method", ["gptq", "gptaq", "autoround"])
def test_a_layer_calibrated_on_zeros_is_named_as_rounded_to_nearest(caplog, method, fill):
    model = tiny_llama(layers=1, vocab=64, hidden=32)
    chosen = {"name": method, **({"iterations": 5} if method == "autoround" else {})}
    spec = GridSpec(bits=4, group_size=16)
    with caplog.at_level(logging.WARNING, logger="surgery"):
        handle = surgery.quantize(
            model, weights=spec, method=chosen, calibration=zeros_or_overflow(fill), exclude="lm_head", progress=False
        )
    said = [r.getMessage() for r in caplog.records if "its inputs were 0 in every calibration batch" in r.getMessage()]
    named = {line.split("'")[1] for line in said}
    assert len(said) == LAYERS and len(named) == LAYERS, said
    assert all(f"so {method} had no error to weigh: it was rounded to nearest (RTN's result)" in s for s in said)
    assert "model.layers.0.mlp.down_proj" in named
    handle.restore()


@pytest.mark.parametrize("method", ["gptq", "autoround"])
def test_real_inputs_say_nothing(caplog, method):
    model = tiny_llama(layers=1, vocab=64, hidden=32)
    chosen = {"name": method, **({"iterations": 5} if method == "autoround" else {})}
    batches = [{"input_ids": torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))}]
    with caplog.at_level(logging.WARNING, logger="surgery"):
        handle = surgery.quantize(
            model,
            weights=GridSpec(bits=4, group_size=16),
            method=chosen,
            calibration=batches,
            exclude="lm_head",
            progress=False,
        )
    assert not [r for r in caplog.records if "its inputs were 0" in r.getMessage()]
    handle.restore()


def test_sparsegpt_on_zeros_is_named_as_magnitude_pruning(caplog):
    model = tiny_llama(layers=1, vocab=64, hidden=32)
    with caplog.at_level(logging.WARNING, logger="surgery"):
        handle = surgery.prune(
            model, 0.5, method="sparsegpt", calibration=zeros_or_overflow(0.0), exclude="lm_head", progress=False
        )
    said = [r.getMessage() for r in caplog.records if "its inputs were 0" in r.getMessage()]
    assert len(said) == LAYERS and all("it was pruned by magnitude alone" in s for s in said)
    handle.restore()


@pytest.mark.parametrize("method", ["gptq", "gptaq"])
def test_a_layer_whose_first_input_is_always_zero_is_not_taken_for_a_dead_one(caplog, method):
    """Found by the hostile pass: the check read the first row of a (1, n, n) Hessian as its diagonal."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16)).eval()
    with torch.no_grad():
        model[0].bias[:16] = -1e3  # half the hidden units, channel 0 among them, never fire
    spec = GridSpec(bits=4, group_size=16)
    with caplog.at_level(logging.WARNING, logger="surgery"):
        handle = surgery.quantize(model, weights=spec, method=method, calibration=[torch.randn(8, 16)], progress=False)
    assert not [r for r in caplog.records if "its inputs were 0" in r.getMessage()]
    handle.restore()


@pytest.mark.parametrize("method", ["gptq", "autoround"])
def test_a_sequence_of_no_token_is_refused_naming_the_batch(method):
    """Found by the wave-4 hostile pass: transformers' own reshape error, far from the cause."""
    model = tiny_llama(layers=1, vocab=64, hidden=32)
    with pytest.raises(
        surgery.ConfigError, match=r"^quantize\.calibration='batch 0': holds an empty tensor of shape \(1, 0\)"
    ):
        surgery.quantize(
            model,
            weights=GridSpec(bits=4, group_size=16),
            method=method,
            calibration=[{"input_ids": torch.zeros(1, 0, dtype=torch.long)}],
            exclude="lm_head",
            progress=False,
        )
