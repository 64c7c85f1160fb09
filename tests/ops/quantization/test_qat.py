"""Quantization-aware training: quantize(train=True) trains float shadows seen fake-quantized."""

from __future__ import annotations

import pytest
import torch
from support import Attention  # tests/support.py
from torch import nn

import surgery
from surgery import GridSpec
from surgery.core.errors import ConfigError
from surgery.ops.numerics.fake_quant import fake_quantize
from surgery.testing import collect, module_hook_counts, snapshot, snapshot_differences

W3 = GridSpec(bits=3, symmetric=True, per_channel=True)


def quantized(shadow) -> torch.Tensor:
    """The shadow weight as the forward sees it: fake-quantized with the range of its values."""
    weight = shadow.param.detach()
    return fake_quantize(weight, shadow.scale, shadow.zero_point, shadow.axis, shadow.spec)


def steps(model: nn.Module, x: torch.Tensor, lr: float, count: int = 3) -> torch.optim.Optimizer:
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, fused=True)
    model.train()
    for _ in range(count):
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()
    model.eval()
    return optimizer


def test_small_updates_accumulate_in_the_shadow_instead_of_being_rounded_away(mlp_factory, mlp_input):
    plain, shadowed = mlp_factory(), mlp_factory()
    rounded = surgery.quantize(plain, weights=W3, select="0", progress=False)  # not train: the grid is re-imposed
    on_grid = plain[0].weight.detach().clone()
    steps(plain, mlp_input, lr=1e-5)
    assert torch.equal(plain[0].weight.detach(), on_grid)  # each tiny step was rounded away
    trained = surgery.quantize(shadowed, weights=W3, select="0", progress=False, train=True)
    start = shadowed[0].weight.detach().clone()
    steps(shadowed, mlp_input, lr=1e-5)
    moved = (shadowed[0].weight.detach() - start).abs()
    assert moved.max() > 0 and moved.max() < 1e-3  # the float shadow took the small steps
    rounded.restore()
    trained.restore()


def test_the_forward_sees_quantized_weights_and_the_gradient_passes_straight_through(mlp, mlp_input):
    with surgery.quantize(mlp, weights=W3, select="0", progress=False, train=True) as handle:
        shadow = handle.weights["0.weight"]
        quantized = fake_quantize(mlp[0].weight.detach(), shadow.scale, shadow.zero_point, 0, W3)
        reference = nn.Linear(8, 16)
        with torch.no_grad():
            reference.weight.copy_(quantized)
            reference.bias.copy_(mlp[0].bias)
        reference.weight.requires_grad_(True)
        assert torch.equal(mlp[0](mlp_input), reference(mlp_input))
        mlp[0](mlp_input).square().sum().backward()
        reference(mlp_input).square().sum().backward()
        # d loss / d quantized, passed to the shadow; PyTorch's estimator stops it where rounding left the grid
        # (each row's largest positive value: 3.5 scales rounds to 4 > 3)
        inside = (mlp[0].weight.detach() / shadow.scale[:, None]).round().le(3)
        assert torch.equal(mlp[0].weight.grad[inside], reference.weight.grad[inside])
        assert not mlp[0].weight.grad[~inside].any() and inside.float().mean() > 0.8
        assert isinstance(mlp[0].weight, nn.Parameter)  # the slot is only on loan during the forward


def test_restore_gives_back_the_exact_original_floats_after_training(mlp, mlp_input):
    before = snapshot(mlp)
    handle = surgery.quantize(mlp, weights=W3, progress=False, train=True)
    steps(mlp, mlp_input, lr=1e-2)
    handle.restore()
    diffs = snapshot_differences(before, snapshot(mlp))
    assert diffs and all(d.startswith("tensor param:") and ".bias" in d for d in diffs)  # biases trained; weights exact


def test_bake_folds_the_shadows_to_the_grid_with_the_outputs_the_hooks_gave(mlp, mlp_input):
    handle = surgery.quantize(mlp, weights=W3, progress=False, train=True)
    steps(mlp, mlp_input, lr=1e-2)
    hooked = collect(mlp, [mlp_input])
    expected = {name: quantized(shadow) for name, shadow in handle.weights.items()}
    handle.bake()
    assert sum(module_hook_counts(mlp).values()) == 0
    assert all(torch.equal(mlp.get_parameter(name).detach(), value) for name, value in expected.items())
    assert all(torch.equal(a, b) for a, b in zip(collect(mlp, [mlp_input]), hooked))


def test_a_parent_reading_the_weight_itself_sees_it_quantized():
    torch.manual_seed(0)
    model = Attention().eval()
    x = torch.randn(2, 5, 16)
    float_out = model(x)
    with surgery.quantize(model, weights=W3, select="attn.out_proj", progress=False, train=True) as handle:
        shadow = handle.weights["attn.out_proj.weight"]
        seen = []
        hook = model.attn.register_forward_pre_hook(lambda m, a: seen.append(m.out_proj.weight.detach().clone()))
        quantized_out = model(x)
        hook.remove()
        assert torch.equal(seen[0], quantized(shadow)) and not torch.equal(quantized_out, float_out)


def test_a_forward_that_raises_still_puts_the_parameter_back(mlp):
    with surgery.quantize(mlp, weights=W3, progress=False, train=True):
        with pytest.raises(RuntimeError):
            mlp(torch.randn(2, 5))  # wrong width: the first Linear raises inside the forward
        assert all(isinstance(mlp[i].weight, nn.Parameter) for i in (0, 2, 4))


@pytest.mark.parametrize("after", [0, 2, None])
def test_activation_ranges_learn_in_training_until_frozen(mlp_factory, mlp_input, after):
    model = mlp_factory()
    handle = surgery.quantize(
        model,
        weights=None,
        activations=GridSpec(bits=8, observer="moving_average"),
        calibration=[mlp_input],
        progress=False,
        train=True,
        freeze_observers_after=after,
    )
    quantizer = handle.activations["0"]
    calibrated = quantizer.scale.clone()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scales = []
    for step in range(4):
        optimizer.zero_grad()
        model.train()(mlp_input * (step + 2)).square().mean().backward()  # wider inputs: the range must grow
        optimizer.step()
        scales.append(quantizer.scale.clone())
    changed = [not torch.equal(s, calibrated) for s in scales]
    if after == 0:
        assert not any(changed)
    elif after == 2:  # learned in the forwards before the 2nd step, fixed from then on
        assert changed[0] and torch.equal(scales[1], scales[2]) and torch.equal(scales[2], scales[3])
    else:
        assert all(changed) and not torch.equal(scales[2], scales[3])
    handle.restore()


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"train": "yes"}, r"quantize\.train='yes': must be true or false"),
        (
            {"train": True, "freeze_observers_after": -1},
            r"quantize\.freeze_observers_after=-1: must be null or an integer",
        ),
        ({"freeze_observers_after": 3}, r"quantize\.freeze_observers_after=3: applies to quantization-aware training"),
    ],
)
def test_bad_training_settings_are_one_line_errors(mlp, mlp_input, kwargs, match):
    with pytest.raises(ConfigError, match=match):
        surgery.quantize(mlp, activations=GridSpec(), calibration=[mlp_input], progress=False, **kwargs)


def test_pruning_and_quantization_aware_training_together_keep_zeros_on_the_grid(mlp, mlp_input):
    pruned = surgery.prune(mlp, 0.5, progress=False)
    trained = surgery.quantize(mlp, weights=W3, progress=False, train=True)
    masks = pruned.masks()
    steps(mlp, mlp_input, lr=1e-2)
    assert all(not mlp.get_parameter(name).detach()[~mask].any() for name, mask in masks.items())
    surgery.compose(pruned, trained).bake()
    assert all(not mlp.get_parameter(name).detach()[~mask].any() for name, mask in masks.items())


@pytest.mark.parametrize("first,second", [(True, True), (True, False), (False, True)])
def test_a_weight_is_quantized_once_whichever_mode(mlp, first, second):
    with surgery.quantize(mlp, weights=W3, progress=False, train=first):
        with pytest.raises(surgery.AlreadyModifiedError, match=r"quantize: 0\.weight already has quantize attached"):
            surgery.quantize(mlp, weights=W3, progress=False, train=second)


def test_a_deployment_export_during_training_drops_the_swap_hooks_from_its_copy(tmp_path):
    """The pickled torchao model holds integer weights and none of surgery's hooks (a bound
    method's type is ``method``: found by its function's module)."""
    pytest.importorskip("torchao")
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)), torch.randn(8, 16)
    weights = GridSpec(bits=8, symmetric=True, per_channel=True)
    with surgery.quantize(model, weights=weights, train=True) as handle:
        record = surgery.export(handle, tmp_path / "model.pt", format="torchao", inputs=[x])
    assert record.parity.holds, record.parity
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in record.load().modules())


def test_a_compressed_tensors_export_during_training_computes_what_the_simulation_computes(tmp_path):
    """The float shadows are off the grid: their integers are rounded as the simulation rounds
    them (``x × (1 / scale)``), so the folder loads with outputs equal bit for bit."""
    pytest.importorskip("compressed_tensors")
    from support import tiny_llama  # tests/support.py

    model, ids = tiny_llama(), torch.randint(0, 128, (2, 16))
    weights = GridSpec(bits=4, symmetric=True, per_channel=True)
    with surgery.quantize(model, weights=weights, select="**.*_proj", train=True) as handle:
        record = surgery.export(handle, tmp_path / "llama", format="compressed-tensors", inputs=[ids])
    assert record.parity.equal and record.parity.expected == "exact", record.parity
