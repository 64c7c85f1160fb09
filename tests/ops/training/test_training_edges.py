"""Edges of training under surgery found by review: ordering, replaced and tied parameters,
interrupts, frozen weights, lifetimes. Each was silently wrong once."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import surgery
from surgery import GridSpec
from surgery.core.errors import AlreadyModifiedError, ConfigError, ParameterReplacedError
from surgery.testing import snapshot, snapshot_differences

W4 = GridSpec(bits=4, symmetric=True, per_channel=True)


def pairs(x: torch.Tensor, count: int = 2) -> list:
    return [(x, torch.arange(x.shape[0]) % 4) for _ in range(count)]


def test_pruning_under_quantization_aware_training_is_undone_last(mlp):
    pruned = surgery.prune(mlp, 0.5, progress=False)
    trained = surgery.quantize(mlp, weights=W4, progress=False, train=True)
    with pytest.raises(AlreadyModifiedError, match=r"prune: .* also has quantize attached after it"):
        pruned.restore()
    surgery.compose(pruned, trained).restore()


def test_a_finetune_on_top_is_undone_before_the_surgery_it_trained_under(mlp, mlp_input):
    before = snapshot(mlp)
    pruned = surgery.prune(mlp, 0.5, progress=False)
    tuned = surgery.finetune(mlp, calibration=pairs(mlp_input), progress=False)
    with pytest.raises(AlreadyModifiedError, match=r"prune: finetune was applied after it and is still attached"):
        pruned.restore()
    tuned.restore()
    pruned.restore()
    assert snapshot_differences(before, snapshot(mlp)) == []


def test_bake_after_a_replacing_load_is_refused_until_enforce(mlp_factory):
    model = mlp_factory()
    handle = surgery.prune(model, 0.5, progress=False)
    model.load_state_dict(mlp_factory(seed=1).state_dict(), assign=True)
    with pytest.raises(ParameterReplacedError, match=r"prune: 0\.weight was replaced"):
        handle.bake()
    assert handle.state == "attached"
    handle.enforce()
    handle.bake()
    assert (model[0].weight == 0).float().mean() == 0.5


def test_a_replaced_weight_read_by_its_parent_is_detected():
    attention = nn.MultiheadAttention(8, 2)
    x = torch.randn(3, 1, 8)
    handle = surgery.prune(attention, 0.5, select="out_proj", progress=False)
    attention.out_proj.weight = nn.Parameter(torch.ones(8, 8))  # the parent reads it; out_proj never runs
    with pytest.raises(ParameterReplacedError, match=r"out_proj\.weight was replaced"):
        attention(x, x, x)
    handle.enforce()
    attention(x, x, x)
    assert (attention.out_proj.weight == 0).float().mean() == 0.5
    handle.restore()


def test_quantization_aware_training_of_a_tied_weight_quantizes_every_use():
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False)
            self.b.weight = self.a.weight

        def forward(self, x):
            return self.a(x), self.b(x)

    torch.manual_seed(0)
    model, x = Tied(), torch.randn(2, 8)
    with surgery.quantize(model, weights=GridSpec(bits=2), progress=False, train=True):
        a, b = model(x)
        assert torch.equal(a, b) and not torch.allclose(b, x @ model.a.weight.detach().t())
        assert model.b(x).equal(b)  # called on its own too


class Interrupting(nn.Module):
    armed = False

    def forward(self, x):
        if Interrupting.armed:
            raise KeyboardInterrupt
        return x


def test_an_interrupted_forward_under_quantization_aware_training_is_recovered(mlp_input):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), Interrupting())
    handle = surgery.quantize(model, weights=W4, progress=False, train=True)
    shadow = model[0].weight
    Interrupting.armed = True
    with pytest.raises(KeyboardInterrupt):
        model(mlp_input)
    Interrupting.armed = False
    before = model(mlp_input).detach()  # the next call puts the loaned weight back before quantizing again
    assert model[0]._parameters["weight"] is shadow
    with torch.no_grad():
        shadow.add_(1.0)
    assert not torch.equal(model(mlp_input).detach(), before)
    handle.restore()


def test_an_interrupted_forward_inside_finetune_puts_the_real_parameters_back(mlp_input):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4), Interrupting())
    handle = surgery.quantize(model, weights=W4, progress=False, train=True)
    before = snapshot(model)
    calls = []

    def loss(output, target):
        calls.append(1)
        Interrupting.armed = len(calls) == 2  # the next forward is cut short
        return F.cross_entropy(output, target)

    try:
        with pytest.raises(KeyboardInterrupt):
            surgery.finetune(model, calibration=pairs(mlp_input, 4), loss=loss, progress=False)
    finally:
        Interrupting.armed = False
    assert isinstance(model[0].weight, nn.Parameter)
    assert snapshot_differences(before, snapshot(model)) == []
    handle.restore()


def test_a_weight_frozen_when_pruned_has_its_gradient_masked_once_unfrozen(mlp, mlp_input):
    mlp[0].weight.requires_grad_(False)
    with surgery.prune(mlp, 0.5, progress=False) as handle:
        assert not mlp[0].weight.requires_grad
        mlp[0].weight.requires_grad_(True)
        mlp(mlp_input).sum().backward()
        assert not mlp[0].weight.grad[~handle.masks()["0.weight"]].any()
        mlp.zero_grad(set_to_none=True)


def test_a_model_dropped_with_surgery_attached_frees_its_weights(mlp_factory):
    for attach in (
        lambda m: surgery.prune(m, 0.5, progress=False),
        lambda m: surgery.quantize(m, weights=W4, progress=False, train=True),
    ):
        model = mlp_factory()
        weight = weakref.ref(model[0].weight)
        attach(model)
        del model
        gc.collect()
        assert weight() is None


def test_a_pruned_embedding_with_sparse_gradients_trains():
    embedding = nn.Embedding(10, 4, sparse=True)
    with surgery.prune(embedding, 0.5, select="", progress=False) as handle:
        optimizer = torch.optim.SGD(embedding.parameters(), lr=0.5)
        embedding(torch.tensor([1, 2, 3])).sum().backward()
        optimizer.step()
        assert not embedding.weight.detach()[~handle.masks()["weight"]].any()


def test_finetune_fails_when_the_last_step_diverges_and_keeps_the_callers_gradients(mlp, mlp_input):
    before = snapshot(mlp)
    mlp(mlp_input).sum().backward()
    grads = [p.grad.clone() for p in mlp.parameters()]
    with pytest.raises(ConfigError, match=r"finetune\.lr=1e\+30: .* became NaN or Inf in training"):
        surgery.finetune(mlp, calibration=pairs(mlp_input, 1), lr=1e30, optimizer="sgd", progress=False)
    assert snapshot_differences(before, snapshot(mlp)) == []
    assert all(torch.equal(p.grad, g) for p, g in zip(mlp.parameters(), grads))
    tuned = surgery.finetune(mlp, calibration=pairs(mlp_input), progress=False)
    assert all(torch.equal(p.grad, g) for p, g in zip(mlp.parameters(), grads))
    tuned.restore()
    mlp.zero_grad(set_to_none=True)


def test_finetune_restore_puts_learned_activation_ranges_back(mlp, mlp_input):
    handle = surgery.quantize(
        mlp,
        weights=None,
        activations=GridSpec(bits=8, observer="moving_average"),
        calibration=[mlp_input],
        progress=False,
        train=True,
    )
    expected = [t.clone() for t in surgery.testing.collect(mlp, [mlp_input])]
    scale = handle.activations["0"].scale.clone()
    tuned = surgery.finetune(
        mlp,
        calibration=[(mlp_input * 5, torch.zeros(mlp_input.shape[0], dtype=torch.long))] * 3,
        lr=0.01,
        progress=False,
    )
    assert not torch.equal(handle.activations["0"].scale, scale)
    tuned.restore()
    assert torch.equal(handle.activations["0"].scale, scale)
    assert all(torch.equal(a, b) for a, b in zip(surgery.testing.collect(mlp, [mlp_input]), expected))
    handle.restore()


def test_capturing_the_gradient_of_a_frozen_weight_is_refused(mlp):
    mlp[0].weight.requires_grad_(False)
    with pytest.raises(ConfigError, match=r"capture\.select='0': its weight does not require a gradient"):
        with surgery.capture(mlp, select="0", what="weight_grads"):
            pass


def test_gradient_statistics_leave_torch_global_backward_hook_state_as_found(mlp, mlp_input):
    from torch.nn.modules import module as module_globals

    from surgery.analysis.inspection import gradient_statistics

    before = module_globals._global_is_full_backward_hook
    gradient_statistics(mlp, pairs(mlp_input), F.cross_entropy)
    assert module_globals._global_is_full_backward_hook == before
