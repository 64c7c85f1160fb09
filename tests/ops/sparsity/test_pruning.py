"""surgery.prune: methods, scopes, runtime masking, copies, restore/bake, errors and rollback."""

from __future__ import annotations

import copy
import math
from unittest import mock

import pytest
import torch
from support import Attention, Tied, edit_in_place  # tests/support.py
from torch import nn
from torch.nn import functional as F

import surgery
from surgery.core.errors import ConfigError
from surgery.ops.sparsity.masks import MaskEnforcer
from surgery.testing import collect, module_hook_counts, snapshot, snapshot_differences

METHODS = ["l1_unstructured", "random_unstructured", "ln_structured"]
SCOPES = ["layer", "global"]


def hooks_on(model: nn.Module) -> int:
    return sum(module_hook_counts(model).values())


def weights_of(model: nn.Module, names: list[str]) -> dict[str, torch.Tensor]:
    params = dict(model.named_parameters(remove_duplicate=False))
    return {name: params[name].detach().clone() for name in names}


def masked_copy(factory, model: nn.Module, masks: dict[str, torch.Tensor]) -> nn.Module:
    """A hook-free model holding ``model``'s current tensors with ``masks`` applied by hand."""
    plain = factory()
    plain.load_state_dict(model.state_dict(), strict=True)
    params = dict(plain.named_parameters(remove_duplicate=False))
    with torch.no_grad():
        for name, mask in masks.items():
            params[name].masked_fill_(~mask, 0)
    return plain


# --- what gets pruned ----------------------------------------------------------------------


def test_default_selection_is_every_conv_and_linear_weight(convnet):
    biases = {k: v.clone() for k, v in convnet.state_dict().items() if not k.endswith("weight") or "bn" in k}
    with surgery.prune(convnet, 0.5) as handle:
        assert list(handle.masks()) == ["conv1.weight", "conv2.weight", "fc.weight"]
        state = convnet.state_dict()
        assert all(torch.equal(state[k], v) for k, v in biases.items())  # biases and BN untouched


def test_select_and_exclude_choose_the_layers(mlp):
    with surgery.prune(mlp, 0.5, select=nn.Linear, exclude="4") as handle:
        assert list(handle.masks()) == ["0.weight", "2.weight"]
        assert (mlp[4].weight != 0).all()


def test_selected_modules_without_a_matrix_weight_are_skipped(convnet):
    with surgery.prune(convnet, 0.5, select=["conv1", "bn1", "re:bn.*"]) as handle:
        assert list(handle.masks()) == ["conv1.weight"]
        assert convnet.bn1.weight.all()


@pytest.mark.parametrize("text,number", [("inf", math.inf), ("fro", 2.0)])
def test_norm_order_accepts_inf_and_fro_strings(mlp_factory, text, number):
    by_text, by_number = mlp_factory(), mlp_factory()
    with (
        surgery.prune(by_text, 0.5, method="ln_structured", n=text) as a,
        surgery.prune(by_number, 0.5, method="ln_structured", n=number) as b,
    ):
        masks_a, masks_b = a.masks(), b.masks()
        assert all(torch.equal(masks_a[k], masks_b[k]) for k in masks_a)


def test_root_module_weight_is_named_weight():
    layer = nn.Linear(4, 4)
    with surgery.prune(layer, 0.5) as handle:
        assert list(handle.masks()) == ["weight"]
        assert int((layer.weight == 0).sum()) == 8
    assert hooks_on(layer) == 0


@pytest.mark.parametrize("amount", [0.1, 0.3, 0.5, 0.9])
def test_l1_unstructured_zeroes_the_smallest_magnitudes(mlp, amount):
    names = ["0.weight", "2.weight", "4.weight"]
    original = weights_of(mlp, names)
    with surgery.prune(mlp, amount, method="l1_unstructured") as handle:
        now = weights_of(mlp, names)
        for name, mask in handle.masks().items():
            w = original[name]
            assert int((~mask).sum()) == round(amount * w.numel())
            assert torch.equal(now[name] == 0, ~mask)  # the original weights have no zeros
            assert torch.equal(now[name][mask], w[mask])  # kept entries untouched
            assert w[~mask].abs().max() <= w[mask].abs().min()
        assert handle.layer_sparsity() == pytest.approx(
            {n: round(amount * original[n].numel()) / original[n].numel() for n in names}
        )


def test_random_unstructured_is_seeded_and_reproducible(mlp_factory):
    a, b, c = mlp_factory(), mlp_factory(), mlp_factory()
    ha = surgery.prune(a, 0.5, method="random_unstructured", seed=11)
    hb = surgery.prune(b, 0.5, method="random_unstructured", seed=11)
    hc = surgery.prune(c, 0.5, method="random_unstructured", seed=12)
    try:
        masks_a, masks_b, masks_c = ha.masks(), hb.masks(), hc.masks()
        assert all(torch.equal(masks_a[k], masks_b[k]) for k in masks_a)
        assert all(torch.equal(pa, pb) for pa, pb in zip(a.parameters(), b.parameters()))
        assert not all(torch.equal(masks_a[k], masks_c[k]) for k in masks_a)
        for _name, mask in masks_a.items():
            assert int((~mask).sum()) == round(0.5 * mask.numel())
    finally:
        for handle in (ha, hb, hc):
            handle.restore()


def test_random_unstructured_does_not_follow_magnitudes(mlp):
    original = weights_of(mlp, ["2.weight"])["2.weight"]
    with surgery.prune(mlp, 0.5, method="random_unstructured", select="2") as handle:
        mask = handle.masks()["2.weight"]
        # With L1 every pruned |w| would be below every kept |w|; 128 random picks of 256 almost never are.
        assert original[~mask].abs().max() > original[mask].abs().min()


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("n", [1, 2, math.inf])
def test_ln_structured_zeroes_whole_channels_with_smallest_norm(convnet, dim, n):
    original = convnet.conv2.weight.detach().clone()
    others = [d for d in range(4) if d != dim]
    with surgery.prune(convnet, 0.5, method="ln_structured", n=n, dim=dim, select="conv2"):
        weight = convnet.conv2.weight.detach()
        zero_slices = weight.abs().amax(dim=others) == 0
        assert int(zero_slices.sum()) == 4
        kept = ~zero_slices
        index = [slice(None)] * 4
        index[dim] = kept
        assert torch.equal(weight[tuple(index)], original[tuple(index)])  # kept slices untouched
        norms = torch.linalg.vector_norm(original, ord=n, dim=others)
        assert norms[zero_slices].max() <= norms[kept].min()


def test_ln_structured_output_channels_of_linear(mlp):
    with surgery.prune(mlp, 0.25, method="ln_structured", select="2"):
        rows_zero = (mlp[2].weight == 0).all(dim=1)
        assert int(rows_zero.sum()) == 4
        assert not (mlp[2].weight == 0).all(dim=0).any()


@pytest.mark.parametrize("method", ["l1_unstructured", "random_unstructured"])
def test_global_scope_prunes_round_amount_of_all_entries_together(mlp, method):
    total = sum(mlp[i].weight.numel() for i in (0, 2, 4))
    with surgery.prune(mlp, 0.4, method=method, scope="global") as handle:
        pruned = sum(int((~m).sum()) for m in handle.masks().values())
        assert pruned == round(0.4 * total)
        assert handle.sparsity() == pytest.approx(pruned / total)


def test_global_l1_uses_one_threshold_across_layers(mlp):
    with torch.no_grad():
        mlp[2].weight.mul_(100.0)  # per-layer scope would still prune 50 % of this layer
    names = ["0.weight", "2.weight", "4.weight"]
    original = weights_of(mlp, names)
    with surgery.prune(mlp, 0.5, scope="global") as handle:
        masks = handle.masks()
        pruned = torch.cat([original[n][~masks[n]].abs() for n in names])
        kept = torch.cat([original[n][masks[n]].abs() for n in names])
        assert pruned.max() <= kept.min()
        sparsity = handle.layer_sparsity()
        # 224 of 448 entries go; the scaled layer holds 256 of them and loses few, the others most.
        assert sparsity["2.weight"] < 0.25 and sparsity["0.weight"] > 0.9


def test_layer_scope_prunes_each_layer_by_amount(mlp):
    with torch.no_grad():
        mlp[2].weight.mul_(100.0)
    with surgery.prune(mlp, 0.5, scope="layer") as handle:
        assert handle.layer_sparsity() == {"0.weight": 0.5, "2.weight": 0.5, "4.weight": 0.5}


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("scope", SCOPES)
def test_amount_zero_is_bit_identical_to_the_untouched_model(convnet, image_input, method, scope):
    before = snapshot(convnet)
    expected = collect(convnet, [image_input])
    with surgery.prune(convnet, 0.0, method=method, scope=scope) as handle:
        assert handle.sparsity() == 0.0
        assert all(torch.equal(a, b) for a, b in zip(collect(convnet, [image_input]), expected))
        assert [
            d for d in snapshot_differences(before, snapshot(convnet)) if not d.startswith(("hooks", "global"))
        ] == []


@pytest.mark.parametrize("method", METHODS)
def test_amount_one_zeroes_every_selected_weight(mlp, mlp_input, method):
    with surgery.prune(mlp, 1, method=method) as handle:
        assert handle.sparsity() == 1.0
        assert all(not mlp[i].weight.any() for i in (0, 2, 4))
        out = collect(mlp, [mlp_input])[0]
        assert torch.equal(out, mlp[4].bias.detach().expand_as(out))


# --- tied weights and parents that read a child's weight directly --------------------------


def make_tied(seed: int = 0) -> Tied:
    torch.manual_seed(seed)
    return Tied().eval()


@pytest.mark.parametrize("scope", SCOPES)
def test_tied_weight_is_pruned_once_and_stays_shared(scope):
    model = make_tied()
    before = snapshot(model)
    x = torch.randn(3, 8)
    with surgery.prune(model, 0.5, method="random_unstructured", scope=scope) as handle:
        assert model.b.weight is model.a.weight
        assert list(handle.masks()) == ["a.weight"]
        # Pruned twice by two independent random masks would leave ~75 % zeros.
        assert int((model.a.weight == 0).sum()) == 32
        assert list(model.state_dict()) == ["a.weight", "b.weight", "b.bias"]
        expected = masked_copy(make_tied, model, {"a.weight": handle.masks()["a.weight"]})
        assert torch.equal(collect(model, [x])[0], collect(expected, [x])[0])
    assert model.b.weight is model.a.weight
    assert snapshot_differences(before, snapshot(model)) == []


def test_tied_weight_bake_loads_into_a_fresh_tied_instance():
    model = make_tied()
    x = torch.randn(3, 8)
    handle = surgery.prune(model, 0.5)
    hooked = collect(model, [x])[0]
    handle.bake()
    fresh = make_tied(seed=1)
    fresh.load_state_dict(model.state_dict(), strict=True)
    assert torch.equal(collect(fresh, [x])[0], hooked)
    assert hooks_on(model) == 0


class DirectRead(nn.Module):
    """Reads ``self.child.weight`` with ``F.linear``: the child's own forward never runs."""

    def __init__(self) -> None:
        super().__init__()
        self.child = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(torch.tanh(F.linear(x, self.child.weight, self.child.bias)))


def make_direct(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return DirectRead().eval()


def make_attention(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return Attention().eval()


DIRECT_CASES = [
    pytest.param(make_direct, "child", "child.weight", (5, 8), id="F.linear(child.weight)"),
    pytest.param(make_attention, "attn.out_proj", "attn.out_proj.weight", (2, 5, 16), id="MultiheadAttention"),
]


@pytest.mark.parametrize("factory,layer,param,shape", DIRECT_CASES)
def test_weight_read_directly_by_a_parent_is_masked(factory, layer, param, shape):
    model = factory()
    x = torch.randn(shape)
    unpruned = collect(model, [x])[0]
    with surgery.prune(model, 0.5, select=layer) as handle:
        mask = handle.masks()[param]
        expected = collect(masked_copy(factory, model, {param: mask}), [x])[0]
        got = collect(model, [x])[0]
        assert torch.equal(got, expected)
        assert not torch.equal(got, unpruned)


@pytest.mark.parametrize("factory,layer,param,shape", DIRECT_CASES)
def test_weight_read_directly_is_masked_again_after_an_in_place_edit(factory, layer, param, shape):
    model = factory()
    x = torch.randn(shape)
    with surgery.prune(model, 0.5, select=layer) as handle:
        mask = handle.masks()[param]
        weight = dict(model.named_parameters())[param]
        edit_in_place(model)
        assert (weight.detach()[~mask] != 0).any(), "the edit should have revived pruned entries"
        expected = collect(masked_copy(factory, model, {param: mask}), [x])[0]
        got = collect(model, [x])[0]  # the root forward-pre hook re-masks before anything reads it
        assert torch.equal(got, expected)
        assert not weight.detach()[~mask].any()


def test_a_pruned_layer_called_on_its_own_is_masked_again(mlp, mlp_input):
    with surgery.prune(mlp, 0.5) as handle:
        mask = handle.masks()["0.weight"]
        with torch.no_grad():
            mlp[0].weight.add_(1.0)  # pruned entries revived; the root model is not called below
        expected = F.linear(mlp_input, mlp[0].weight.detach().masked_fill(~mask, 0), mlp[0].bias)
        assert torch.equal(mlp[0](mlp_input), expected)


def test_masks_survive_load_state_dict_while_attached(mlp, mlp_factory, mlp_input):
    dense = mlp_factory(seed=5).state_dict()
    with surgery.prune(mlp, 0.5) as handle:
        masks = handle.masks()
        mlp.load_state_dict(dense)
        expected = collect(masked_copy(mlp_factory, mlp, masks), [mlp_input])[0]
        assert torch.equal(collect(mlp, [mlp_input])[0], expected)


def test_masks_survive_replacing_the_parameter_storage(mlp, mlp_factory, mlp_input):
    with surgery.prune(mlp, 0.5) as handle:
        masks = handle.masks()
        with torch.no_grad():
            for i in (0, 2, 4):
                mlp[i].weight.data = torch.ones_like(mlp[i].weight)
        expected = collect(masked_copy(mlp_factory, mlp, masks), [mlp_input])[0]
        assert torch.equal(collect(mlp, [mlp_input])[0], expected)


def test_masks_and_restore_survive_a_dtype_change(mlp, mlp_input):
    before = snapshot(mlp)
    handle = surgery.prune(mlp, 0.5)
    masks = handle.masks()
    mlp.double()
    assert all(not mlp[i].weight[~masks[f"{i}.weight"]].any() for i in (0, 2, 4))
    handle.restore()
    mlp.float()
    assert snapshot_differences(before, snapshot(mlp)) == []


# --- state while attached, copies ----------------------------------------------------------


def test_state_dict_keys_parameter_objects_and_classes_unchanged_while_attached(convnet):
    keys = list(convnet.state_dict())
    params = dict(convnet.named_parameters())
    buffers = dict(convnet.named_buffers())
    with surgery.prune(convnet, 0.5):
        assert list(convnet.state_dict()) == keys
        assert dict(convnet.named_parameters()) == params  # same Parameter objects
        assert all(type(p) is nn.Parameter and p.requires_grad for p in convnet.parameters())
        assert dict(convnet.named_buffers()) == buffers
        assert not any("orig" in k or "mask" in k for k in convnet.state_dict())


def _fill_weights(model: nn.Module, value: float) -> None:
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (nn.Conv2d, nn.Linear)):
                module.weight.fill_(value)


def test_copies_of_a_model_under_surgery_stay_masked(convnet, convnet_factory, image_input, duplicate):
    handle = surgery.prune(convnet, 0.5)
    masks = handle.masks()
    hooked = collect(convnet, [image_input])[0]
    duplicate_model = duplicate(convnet)
    assert torch.equal(collect(duplicate_model, [image_input])[0], hooked)
    assert list(duplicate_model.state_dict()) == list(convnet.state_dict())
    # The copy keeps enforcing its own masks after its weights change.
    _fill_weights(duplicate_model, 0.1)
    expected = collect(masked_copy(convnet_factory, duplicate_model, masks), [image_input])[0]
    assert torch.equal(collect(duplicate_model, [image_input])[0], expected)
    # Restoring the original does not touch the copy, and the copy does not hold the original.
    handle.restore()
    assert all(not duplicate_model.get_parameter(n)[~m].any() for n, m in masks.items())
    assert all(convnet.get_parameter(n)[~m].all() for n, m in masks.items())


def test_copy_of_a_pruned_model_can_be_pruned_independently(mlp):
    with surgery.prune(mlp, 0.5):
        twin = copy.deepcopy(mlp)
        original = mlp[0].weight.detach().clone()
        twin_before = twin[0].weight.detach().clone()
        with surgery.prune(twin, 0.5, select="**.weight", method="random_unstructured") as again:
            # the original's claim on its parameters does not extend to the copy's: the copy's
            # prune attaches (a second prune of the same parameter would raise) and zeroes more
            assert again.parameters == ["0.weight", "2.weight", "4.weight"]
            assert (twin[0].weight == 0).sum() > (twin_before == 0).sum()
            assert torch.equal(mlp[0].weight, original)  # the original is untouched
        assert torch.equal(twin[0].weight, twin_before)


# --- restore and bake ----------------------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("scope", SCOPES)
def test_restore_is_bit_exact(convnet, image_input, method, scope):
    before = snapshot(convnet)
    expected = collect(convnet, [image_input])
    handle = surgery.prune(convnet, 0.6, method=method, scope=scope)
    assert not torch.equal(collect(convnet, [image_input])[0], expected[0])
    handle.restore()
    assert handle.state == "restored"
    assert snapshot_differences(before, snapshot(convnet)) == []
    assert torch.equal(collect(convnet, [image_input])[0], expected[0])


def test_restore_puts_back_negative_zeros_and_exact_bits():
    layer = nn.Linear(4, 4, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([[-0.0, 1e-38, -1e-45, 3.0]] * 4))
    bits = layer.weight.detach().clone().view(torch.int32)
    with surgery.prune(layer, 0.75):
        assert torch.equal(layer.weight.detach().view(torch.int32)[:, :3], torch.zeros(4, 3, dtype=torch.int32))
    assert torch.equal(layer.weight.detach().view(torch.int32), bits)


def test_restore_is_idempotent(mlp):
    before = snapshot(mlp)
    handle = surgery.prune(mlp, 0.5)
    handle.restore()
    with torch.no_grad():
        mlp[0].weight[0, 0] = 42.0  # a second restore must not put anything back
    handle.restore()
    assert mlp[0].weight[0, 0].item() == 42.0
    with torch.no_grad():
        mlp[0].weight[0, 0] = before.tensors["param:0.weight"][0, 0]
    assert snapshot_differences(before, snapshot(mlp)) == []


@pytest.mark.parametrize("method", METHODS)
def test_bake_keeps_outputs_removes_hooks_and_loads_strictly(convnet, convnet_factory, image_input, method):
    params = dict(convnet.named_parameters())
    handle = surgery.prune(convnet, 0.5, method=method)
    hooked = collect(convnet, [image_input])[0]
    sparsity = handle.sparsity()
    assert handle.bake() is convnet
    assert handle.state == "baked"
    assert hooks_on(convnet) == 0
    assert dict(convnet.named_parameters()) == params  # optimizers keep their references
    assert torch.equal(collect(convnet, [image_input])[0], hooked)
    fresh = convnet_factory(seed=3)
    fresh.load_state_dict(convnet.state_dict(), strict=True)
    assert torch.equal(collect(fresh, [image_input])[0], hooked)
    zeros = sum(int((convnet.get_parameter(n) == 0).sum()) for n in ("conv1.weight", "conv2.weight", "fc.weight"))
    total = sum(convnet.get_parameter(n).numel() for n in ("conv1.weight", "conv2.weight", "fc.weight"))
    assert zeros / total == pytest.approx(sparsity)


def test_bake_is_idempotent_and_restore_after_bake_does_nothing(mlp):
    handle = surgery.prune(mlp, 0.5)
    baked = {k: v.clone() for k, v in mlp.state_dict().items()}
    assert handle.bake() is mlp
    assert handle.bake() is mlp
    handle.restore()
    assert handle.state == "baked"
    assert all(torch.equal(mlp.state_dict()[k], v) for k, v in baked.items())


def test_bake_after_restore_raises(mlp):
    handle = surgery.prune(mlp, 0.5)
    handle.restore()
    with pytest.raises(RuntimeError, match="restored"):
        handle.bake()


def test_baked_model_is_no_longer_enforced(mlp):
    handle = surgery.prune(mlp, 0.5)
    handle.bake()
    _fill_weights(mlp, 1.0)
    mlp(torch.randn(2, 8))
    assert all(mlp[i].weight.detach().eq(1.0).all() for i in (0, 2, 4))


def test_disjoint_handles_restore_in_any_order(mlp, mlp_input):
    before = snapshot(mlp)
    expected = collect(mlp, [mlp_input])
    first = surgery.prune(mlp, 0.5, select="0")
    second = surgery.prune(mlp, 0.5, select=["2", "4"], method="ln_structured")
    first.restore()  # not last-in-first-out: the handles touch different parameters
    assert not mlp[2].weight.detach().all(dim=1).all()
    second.restore()
    assert snapshot_differences(before, snapshot(mlp)) == []
    assert torch.equal(collect(mlp, [mlp_input])[0], expected[0])


# --- errors leave the model untouched ------------------------------------------------------


def test_pruning_an_attached_parameter_again_raises(mlp):
    handle = surgery.prune(mlp, 0.5, select="2")
    during = snapshot(mlp)
    for kwargs in ({"select": "2"}, {}, {"select": ["0", "2"], "method": "random_unstructured"}):
        with pytest.raises(surgery.AlreadyModifiedError, match=r"2\.weight"):
            surgery.prune(mlp, 0.3, **kwargs)
        assert snapshot_differences(during, snapshot(mlp)) == []
    # The failed attempts claimed nothing: the other layers can still be pruned.
    with surgery.prune(mlp, 0.3, select=["0", "4"]):
        pass
    handle.restore()
    with surgery.prune(mlp, 0.3, select="2"):
        pass


def test_baking_releases_the_claim(mlp):
    surgery.prune(mlp, 0.5).bake()
    baked = mlp[0].weight.detach().clone()
    with surgery.prune(mlp, 0.5) as again:  # would raise AlreadyModifiedError if still claimed
        assert (mlp[0].weight == 0).float().mean().item() == pytest.approx(0.5)  # the baked zeros rank lowest
        assert again.sparsity() == pytest.approx(0.5)
    assert torch.equal(mlp[0].weight, baked)  # restoring the second prune gives back the baked weights


BAD_INPUTS = [
    ({"amount": -0.1}, "prune.amount"),
    ({"amount": 1.5}, "prune.amount"),
    ({"amount": math.nan}, "prune.amount"),
    ({"amount": math.inf}, "prune.amount"),
    ({"amount": True}, "prune.amount"),
    ({"amount": "0.5"}, "prune.amount"),
    ({"amount": None}, "prune.amount"),
    ({"method": "l2_unstructured"}, "prune.method"),
    ({"method": None}, "prune.method"),
    ({"scope": "model"}, "prune.scope"),
    ({"dim": 2, "method": "ln_structured"}, "prune.dim"),
    ({"dim": -3, "method": "ln_structured"}, "prune.dim"),
    ({"n": 0, "method": "ln_structured"}, "prune.n"),
    ({"n": -1.0, "method": "ln_structured"}, "prune.n"),
    ({"n": "two", "method": "ln_structured"}, "prune.n"),
    ({"n": math.nan, "method": "ln_structured"}, "prune.n"),
    ({"seed": 1.5, "method": "random_unstructured"}, "prune.seed"),
    ({"select": "layer9"}, "prune.select"),
    ({"select": nn.ReLU}, "prune.select"),
    ({"select": ["0", "9"]}, "prune.select"),
    ({"exclude": "9"}, "prune.exclude"),
    ({"select": "0", "exclude": "0"}, "prune.select"),
]


@pytest.mark.parametrize("kwargs,field", BAD_INPUTS, ids=[f"{k}" for k, _ in BAD_INPUTS])
def test_bad_input_raises_config_error_naming_the_field_and_changes_nothing(mlp, kwargs, field):
    before = snapshot(mlp)
    kwargs = {"amount": 0.5} | kwargs
    with pytest.raises(ConfigError) as info:
        surgery.prune(mlp, **kwargs)
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}=")
    assert snapshot_differences(before, snapshot(mlp)) == []
    with surgery.prune(mlp, 0.5):  # nothing was claimed by the failed call
        pass


def test_wrong_type_errors_are_also_type_errors(mlp):
    for kwargs in ({"amount": "0.5"}, {"amount": True}, {"amount": 0.5, "seed": "1"}):
        with pytest.raises(TypeError):
            surgery.prune(mlp, **({"amount": 0.5} | kwargs))


def test_non_floating_weight_is_a_config_error():
    model = nn.Sequential(nn.Linear(2, 2))
    model[0].weight = nn.Parameter(torch.ones(2, 2, dtype=torch.int64), requires_grad=False)
    before = snapshot(model)
    with pytest.raises(ConfigError, match="int64") as info:
        surgery.prune(model, 0.5)
    assert info.value.field == "prune.select"
    assert snapshot_differences(before, snapshot(model)) == []


# --- all-or-nothing: failures injected while attaching --------------------------------------


def _fail_on_call(number: int, real=None):
    """A side effect that calls ``real`` (if given) and raises on the ``number``-th call."""
    calls = {"n": 0}

    def side_effect(*args, **kwargs):
        calls["n"] += 1
        result = real(*args, **kwargs) if real is not None else None
        if calls["n"] == number:
            raise RuntimeError("injected failure")
        return result

    return side_effect


@pytest.mark.parametrize("after_write", [False, True], ids=["before-masking", "after-masking"])
@pytest.mark.parametrize("method", METHODS)
def test_failure_while_enforcing_the_third_mask_rolls_everything_back(mlp, mlp_input, method, after_write):
    before = snapshot(mlp)
    expected = collect(mlp, [mlp_input])
    real = MaskEnforcer.apply if after_write else None
    with mock.patch.object(MaskEnforcer, "apply", autospec=True, side_effect=_fail_on_call(3, real)) as patched:
        with pytest.raises(RuntimeError, match="injected failure"):
            surgery.prune(mlp, 0.5, method=method)
        assert patched.call_count == 3
    assert snapshot_differences(before, snapshot(mlp)) == []
    assert torch.equal(collect(mlp, [mlp_input])[0], expected[0])
    with surgery.prune(mlp, 0.5):  # no parameter is left claimed
        pass


def test_failure_in_attach_rolls_everything_back(convnet, image_input):
    from surgery.core import guards

    before = snapshot(convnet)
    side_effect = _fail_on_call(3, guards.attach)
    with mock.patch.object(guards, "attach", side_effect=side_effect) as patched:
        with pytest.raises(RuntimeError, match="injected failure"):
            surgery.prune(convnet, 0.5, scope="global")
        assert patched.call_count == 3
    assert snapshot_differences(before, snapshot(convnet)) == []


def test_failure_registering_the_root_hook_rolls_everything_back(convnet):
    before = snapshot(convnet)
    with mock.patch("surgery.core.transforms.SubtreeEnforcer", side_effect=RuntimeError("injected failure")):
        with pytest.raises(RuntimeError, match="injected failure"):
            surgery.prune(convnet, 0.5)
    assert snapshot_differences(before, snapshot(convnet)) == []


def test_keyboard_interrupt_while_attaching_rolls_back(mlp):
    before = snapshot(mlp)
    with mock.patch.object(MaskEnforcer, "apply", autospec=True, side_effect=KeyboardInterrupt):
        with pytest.raises(KeyboardInterrupt):
            surgery.prune(mlp, 0.5)
    assert snapshot_differences(before, snapshot(mlp)) == []


def test_a_parent_reading_the_weight_directly_and_called_on_its_own_is_masked_after_an_edit():
    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = nn.MultiheadAttention(8, 2)
            self.fc = nn.Linear(8, 2)

        def forward(self, x):
            return self.fc(self.attn(x, x, x)[0])

    torch.manual_seed(0)
    model = Head()
    x = torch.randn(3, 1, 8)
    with surgery.prune(model, 0.5) as handle:
        pruned = ~handle.masks()["attn.out_proj.weight"]
        edit_in_place(model)  # writes non-zero values into the pruned entries behind the hooks
        assert torch.count_nonzero(model.attn.out_proj.weight[pruned]) > 0
        model.attn(x, x, x)  # the parent alone: it reads out_proj.weight without calling out_proj
        assert torch.count_nonzero(model.attn.out_proj.weight[pruned]) == 0


def test_the_signature_names_the_spec_fields_then_the_call_keywords():
    import dataclasses
    import inspect

    from surgery.ops.sparsity.spec import PruneSpec

    fields = [f.name for f in dataclasses.fields(PruneSpec)]
    parameters = inspect.signature(surgery.prune).parameters
    assert list(parameters) == ["model", *fields, "spec", "calibration", "work", "progress", "loss"]
    assert parameters["amount"].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
    assert all(f"        {name}:" in surgery.prune.__doc__ for name in fields)


def test_an_unknown_keyword_is_one_line_naming_the_allowed_ones():
    model = nn.Linear(4, 2)
    before = model.weight.detach().clone()
    allowed = "amount, method, scope, n, dim, seed, pattern, select, exclude, blocks, amounts, onload, originals, unrouted, spec, calibration, work, progress, loss"
    with pytest.raises(ConfigError, match=rf"^prune='methd': unknown keyword; allowed: {allowed}$"):
        surgery.prune(model, 0.5, methd="l1_unstructured")
    with pytest.raises(TypeError, match="unknown keyword"):
        surgery.prune(model, surgery.PruneSpec(amount=0.5), methd="l1_unstructured")
    assert torch.equal(model.weight, before)
