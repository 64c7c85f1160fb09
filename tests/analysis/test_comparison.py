"""surgery.compare: drift metrics computed by hand, and no side effects on the models."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from support import Poisoned  # tests/support.py
from torch import nn

import surgery


class Offset(nn.Module):
    """Adds a fixed tensor to the wrapped model's output."""

    def __init__(self, inner: nn.Module, offset: torch.Tensor) -> None:
        super().__init__()
        self.inner = inner
        self.register_buffer("offset", offset)

    def forward(self, x):
        return self.inner(x) + self.offset


class TwoOutputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        y = self.fc(x)
        return {"logits": y, "index": y.argmax(-1), "features": (y * 2,)}


def test_identical_models_have_no_drift(convnet, image_input):
    drift = surgery.compare(convnet, copy.deepcopy(convnet), image_input)
    assert drift.max_abs == 0.0
    assert drift.cosine == pytest.approx(1.0, abs=1e-12)  # float64 rounding of dot / norms only
    assert drift.sqnr_db is None
    assert drift.top1_agreement == 1.0
    assert drift.identical
    assert drift.as_dict() == {
        "max_abs": 0.0,
        "cosine": drift.cosine,
        "sqnr_db": None,
        "top1_agreement": 1.0,
        "nonfinite": {"reference_nan": 0, "reference_inf": 0, "candidate_nan": 0, "candidate_inf": 0},
    }


def test_a_model_compared_with_itself_has_no_drift(mlp, mlp_input):
    drift = surgery.compare(mlp, mlp, mlp_input)
    assert drift.identical and drift.sqnr_db is None and drift.top1_agreement == 1.0


def test_halved_outputs_give_six_decibels(mlp, mlp_input):
    half = copy.deepcopy(mlp)
    with torch.no_grad():
        half[4].weight.mul_(0.5)  # scaling by a power of two is exact in floating point,
        half[4].bias.mul_(0.5)  # so the candidate's outputs are exactly half the reference's
    reference = mlp(mlp_input).detach().double()
    drift = surgery.compare(mlp, half, mlp_input)
    # noise = r - r/2 = r/2  ->  SQNR = 10 log10(sum r^2 / sum (r/2)^2) = 10 log10(4)
    assert drift.sqnr_db == pytest.approx(10 * math.log10(4), abs=1e-9)
    assert drift.cosine == pytest.approx(1.0, abs=1e-12)
    assert drift.max_abs == pytest.approx(reference.abs().max().item() / 2, rel=1e-12)
    assert drift.top1_agreement == 1.0  # a positive scale keeps every argmax
    assert not drift.identical


def test_known_additive_noise_gives_the_hand_computed_metrics(mlp, mlp_input):
    generator = torch.Generator().manual_seed(5)
    noise = 0.05 * torch.randn(6, 4, generator=generator)
    candidate = Offset(copy.deepcopy(mlp), noise)
    r = mlp(mlp_input).detach()
    c = (r + noise).double()
    r = r.double()
    expected_sqnr = 10 * math.log10(float((r * r).sum()) / float(((r - c) ** 2).sum()))
    expected_cosine = float((r * c).sum()) / math.sqrt(float((r * r).sum()) * float((c * c).sum()))
    expected_top1 = float((r.argmax(-1) == c.argmax(-1)).double().mean())
    drift = surgery.compare(mlp, candidate, mlp_input)
    # Tolerances cover float32 rounding of r + noise inside the candidate (~1e-7 relative).
    assert drift.sqnr_db == pytest.approx(expected_sqnr, abs=1e-4)
    assert drift.cosine == pytest.approx(expected_cosine, abs=1e-6)
    assert drift.max_abs == pytest.approx(noise.abs().max().item(), rel=1e-5)
    assert drift.top1_agreement == expected_top1


def test_negated_outputs_have_cosine_minus_one_and_known_sqnr(mlp, mlp_input):
    negated = copy.deepcopy(mlp)
    with torch.no_grad():
        negated[4].weight.neg_()
        negated[4].bias.neg_()
    drift = surgery.compare(mlp, negated, mlp_input)
    # noise = 2r -> SQNR = 10 log10(1/4); argmax of -r is argmin of r, never the same row-wise.
    assert drift.cosine == pytest.approx(-1.0, abs=1e-12)
    assert drift.sqnr_db == pytest.approx(-10 * math.log10(4), abs=1e-9)
    assert drift.top1_agreement == 0.0


def test_many_batches_accumulate_like_one_big_batch(mlp, mlp_input):
    candidate = Offset(copy.deepcopy(mlp), torch.full((4,), 0.1))
    whole = surgery.compare(mlp, candidate, mlp_input)
    parts = surgery.compare(mlp, candidate, [mlp_input[:2], (mlp_input[2:5],), [mlp_input[5:]]])
    # float32 matmul kernels may round differently for different batch sizes: ~1e-7 relative.
    assert parts.max_abs == pytest.approx(whole.max_abs, rel=1e-5)
    assert parts.top1_agreement == whole.top1_agreement
    assert parts.cosine == pytest.approx(whole.cosine, rel=1e-6)
    assert parts.sqnr_db == pytest.approx(whole.sqnr_db, rel=1e-5)


def test_structured_outputs_use_every_floating_tensor():
    torch.manual_seed(0)
    model = TwoOutputs()
    x = torch.randn(5, 8)
    drift = surgery.compare(model, copy.deepcopy(model), x)
    assert drift.identical and drift.top1_agreement == 1.0
    half = copy.deepcopy(model)
    with torch.no_grad():
        half.fc.weight.mul_(0.5)
        half.fc.bias.mul_(0.5)
    # Both floating outputs (logits and 2 * logits) are halved: the SQNR is still 10 log10(4).
    assert surgery.compare(model, half, x).sqnr_db == pytest.approx(10 * math.log10(4), abs=1e-9)


def test_outputs_without_a_class_dimension_have_no_top1():
    model = nn.Linear(4, 1)
    x = torch.randn(3, 4)
    flat = nn.Sequential(model, nn.Flatten(0))
    assert surgery.compare(flat, copy.deepcopy(flat), x).top1_agreement is None


def test_shape_mismatch_is_an_error(mlp, mlp_input):
    other = nn.Sequential(nn.Linear(8, 3))
    with pytest.raises(ValueError, match="shapes differ"):
        surgery.compare(mlp, other, mlp_input)


def test_compare_keeps_training_flags_and_batch_norm_statistics(convnet, image_input):
    convnet.train()
    convnet.bn2.eval()  # a mixed state must come back exactly, module by module
    candidate = copy.deepcopy(convnet)
    candidate.train()
    flags = {name: m.training for name, m in convnet.named_modules()}
    buffers = {k: v.clone() for k, v in convnet.named_buffers()}
    candidate_buffers = {k: v.clone() for k, v in candidate.named_buffers()}
    drift = surgery.compare(convnet, candidate, image_input)
    # In train mode BatchNorm would normalise with batch statistics and update its buffers.
    assert drift.identical
    assert {name: m.training for name, m in convnet.named_modules()} == flags
    assert all(m.training for m in candidate.modules())
    assert all(torch.equal(v, buffers[k]) for k, v in convnet.named_buffers())
    assert all(torch.equal(v, candidate_buffers[k]) for k, v in candidate.named_buffers())


def test_compare_runs_in_eval_mode_so_dropout_is_off():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 4)).train()
    drift = surgery.compare(model, model, torch.randn(16, 8))
    assert drift.identical
    assert model.training and model[1].training


def test_compare_builds_no_autograd_graph(mlp, mlp_input):
    seen = []
    twin = copy.deepcopy(mlp)
    hook = mlp.register_forward_hook(lambda module, args, output: seen.append(output.requires_grad))
    try:
        surgery.compare(mlp, twin, mlp_input)
    finally:
        hook.remove()
    assert seen == [False]


def test_compare_restores_flags_even_when_the_candidate_fails(mlp, mlp_input):
    mlp.train()
    broken = nn.Sequential(nn.Linear(3, 3)).train()  # wrong input size: raises inside compare
    with pytest.raises(RuntimeError):
        surgery.compare(mlp, broken, mlp_input)
    assert all(m.training for m in mlp.modules()) and all(m.training for m in broken.modules())


# --- non-finite outputs: never "identical", never a passing bound -------------------------------


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_candidate_outputs_are_counted_and_make_every_metric_fail(mlp, mlp_input, value):
    drift = surgery.compare(mlp, Poisoned(copy.deepcopy(mlp), value, 3), mlp_input)
    assert not drift.identical and not drift.finite
    counts = drift.nonfinite
    assert (counts.candidate_nan, counts.candidate_inf) == ((3, 0) if math.isnan(value) else (0, 3))
    assert counts.reference == 0
    assert math.isnan(drift.max_abs) and math.isnan(drift.cosine) and math.isnan(drift.sqnr_db)
    assert not drift.cosine > 0.9 and not drift.max_abs < 1e9  # any bound written either way fails
    assert drift.top1_agreement is None


def test_all_nan_outputs_are_not_identical_to_finite_ones(mlp, mlp_input):
    """The bug: max(0, nan) kept max_abs at 0, so all-NaN outputs were reported identical."""
    drift = surgery.compare(mlp, Poisoned(copy.deepcopy(mlp), math.nan, 10**6), mlp_input)
    assert not drift.identical and drift.nonfinite.candidate_nan == mlp(mlp_input).numel()


def test_the_same_nan_in_both_models_is_identical_and_reported_as_a_non_finite_reference(mlp, mlp_input):
    reference = Poisoned(mlp, math.nan, 2)
    drift = surgery.compare(reference, copy.deepcopy(reference), mlp_input)
    assert drift.identical and drift.max_abs == 0.0 and drift.sqnr_db is None
    assert drift.nonfinite.reference_nan == 2 and drift.nonfinite.candidate_nan == 2


def test_huge_finite_outputs_give_numbers_not_a_math_domain_error(mlp, mlp_input):
    class Huge(nn.Module):
        def forward(self, x):
            return torch.full((2, 3), 3e38)

    class Zero(nn.Module):
        def forward(self, x):
            return torch.zeros(2, 3)

    drift = surgery.compare(Huge(), Zero(), mlp_input)
    assert drift.finite and drift.sqnr_db == pytest.approx(0.0) and drift.cosine == 0.0


def test_outputs_of_different_counts_are_a_config_error(mlp, mlp_input):
    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = copy.deepcopy(mlp)

        def forward(self, x):
            y = self.inner(x)
            return y, y * 2

    with pytest.raises(surgery.ConfigError, match=r"compare.candidate='2 output tensor\(s\)'.*reference's 1"):
        surgery.compare(mlp, Two(), mlp_input)


def test_inputs_are_streamed_one_batch_at_a_time(mlp):
    """A generator of batches is consumed lazily: each batch is made when reached and the NaN
    check names the batch without materialising the rest."""
    made = []

    def stream():
        for index in range(5):
            made.append(index)
            yield torch.full((2, 8), math.nan) if index == 2 else torch.randn(2, 8)

    with pytest.raises(surgery.ConfigError, match="batch 2"):
        surgery.compare(mlp, copy.deepcopy(mlp), stream())
    assert made == [0, 1, 2]


def test_top1_agreement_reads_the_logits_of_a_dict_output_whatever_their_position():
    class Features(torch.nn.Module):
        def __init__(self, flip: bool) -> None:
            super().__init__()
            self.flip = flip

        def forward(self, x):
            logits = -x if self.flip else x
            return {"features": x.flip(-1), "logits": logits}  # features first, and unchanged by flip

    x = torch.randn(8, 5)
    drift = surgery.compare(Features(False), Features(True), x)
    assert drift.top1_agreement == pytest.approx(float((x.argmax(-1) == (-x).argmax(-1)).float().mean()))
