"""surgery.ops.masks: keep-mask computation (pure) and bit packing."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from support import examples  # tests/support.py

from surgery.ops.sparsity.criteria import compute_masks, pack, unpack


def _weights(*shapes: tuple[int, ...], seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator) for shape in shapes]


@pytest.mark.parametrize("method", ["l1_unstructured", "random_unstructured", "ln_structured"])
@pytest.mark.parametrize("scope", ["layer", "global"])
def test_compute_masks_reads_and_never_writes(method, scope):
    weights = _weights((6, 5), (4, 3, 2, 2))
    copies = [w.clone() for w in weights]
    versions = [w._version for w in weights]
    masks = compute_masks(weights, 0.5, method=method, scope=scope)
    assert [m.dtype for m in masks] == [torch.bool, torch.bool]
    assert [m.shape for m in masks] == [w.shape for w in weights]
    assert all(torch.equal(w, c) for w, c in zip(weights, copies))
    assert [w._version for w in weights] == versions


@pytest.mark.parametrize("amount", [0.0, 0.1, 0.25, 0.5, 0.7, 0.99, 1.0])
def test_l1_layer_prunes_round_amount_times_numel_smallest_magnitudes(amount):
    weights = _weights((7, 9), (5, 3, 3, 3))
    for weight, mask in zip(weights, compute_masks(weights, amount, method="l1_unstructured", scope="layer")):
        pruned, kept = weight[~mask].abs(), weight[mask].abs()
        assert pruned.numel() == round(amount * weight.numel())
        if pruned.numel() and kept.numel():
            assert pruned.max() <= kept.min()


def test_l1_global_uses_one_threshold_across_weights():
    small, large = _weights((10, 10), (10, 10))
    large = large * 100  # a per-layer threshold would prune half of each; a global one prunes `small`
    masks = compute_masks([small, large], 0.5, method="l1_unstructured", scope="global")
    pruned = torch.cat([w[~m].abs() for w, m in zip([small, large], masks)])
    kept = torch.cat([w[m].abs() for w, m in zip([small, large], masks)])
    assert pruned.numel() == round(0.5 * 200)
    assert pruned.max() <= kept.min()
    assert (~masks[0]).sum() > 90 and (~masks[1]).sum() < 10


def test_global_amount_counts_entries_of_all_weights_together():
    weights = _weights((3, 3), (4, 5), (2, 2, 3))
    masks = compute_masks(weights, 0.3, method="l1_unstructured", scope="global")
    assert sum(int((~m).sum()) for m in masks) == round(0.3 * (9 + 20 + 12))


@pytest.mark.parametrize("scope", ["layer", "global"])
def test_random_is_reproducible_from_the_seed_and_counts_right(scope):
    weights = _weights((8, 8), (6, 4))
    first = compute_masks(weights, 0.4, method="random_unstructured", scope=scope, seed=7)
    again = compute_masks(weights, 0.4, method="random_unstructured", scope=scope, seed=7)
    other = compute_masks(weights, 0.4, method="random_unstructured", scope=scope, seed=8)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not all(torch.equal(a, b) for a, b in zip(first, other))
    if scope == "layer":
        assert [int((~m).sum()) for m in first] == [round(0.4 * 64), round(0.4 * 24)]
    else:
        assert sum(int((~m).sum()) for m in first) == round(0.4 * 88)


def test_random_ignores_magnitudes_and_the_global_rng():
    weights = _weights((20, 20))
    state = torch.random.get_rng_state()
    mask = compute_masks(weights, 0.5, method="random_unstructured", scope="layer", seed=3)[0]
    assert torch.equal(torch.random.get_rng_state(), state)
    l1 = compute_masks(weights, 0.5, method="l1_unstructured", scope="layer")[0]
    assert not torch.equal(mask, l1)  # 200 of 400 chosen at random coincide with L1 with odds ~1e-119


@pytest.mark.parametrize("dim", [0, 1, -1])
@pytest.mark.parametrize("n", [1.0, 2.0, math.inf])
def test_ln_structured_prunes_whole_slices_with_smallest_norm(dim, n):
    (weight,) = _weights((6, 5, 3, 3))
    mask = compute_masks([weight], 0.5, method="ln_structured", scope="layer", n=n, dim=dim)[0]
    d = dim % weight.dim()
    other = [i for i in range(weight.dim()) if i != d]
    slice_kept = mask.amax(dim=other)
    assert torch.equal(slice_kept, mask.amin(dim=other))  # every slice is all kept or all pruned
    assert int((~slice_kept).sum()) == round(0.5 * weight.shape[d])
    norms = torch.linalg.vector_norm(weight, ord=n, dim=other)
    assert norms[~slice_kept].max() <= norms[slice_kept].min()


def test_ln_structured_norm_order_matters():
    # Slice 0 has the larger L1 norm (4 x 1.0 = 4 vs 3.0) but the smaller L-inf norm (1.0 vs 3.0).
    weight = torch.tensor([[1.0, 1.0, 1.0, 1.0], [3.0, 0.0, 0.0, 0.0]])
    l1 = compute_masks([weight], 0.5, method="ln_structured", scope="layer", n=1.0)[0]
    linf = compute_masks([weight], 0.5, method="ln_structured", scope="layer", n=math.inf)[0]
    assert l1[:, 0].tolist() == [True, False]
    assert linf[:, 0].tolist() == [False, True]


def test_ln_structured_global_normalises_by_fan_in():
    # Wide slices of small entries vs narrow slices of large entries: by raw L2 norm the narrow
    # slices (2.0) are weaker than the wide ones (5.0); per entry (0.5 vs 1.0) the wide ones are.
    wide = torch.full((4, 100), 0.5)
    narrow = torch.full((4, 4), 1.0)
    wide_mask, narrow_mask = compute_masks([wide, narrow], 0.5, method="ln_structured", scope="global")
    assert not wide_mask.any()
    assert narrow_mask.all()


@pytest.mark.parametrize("method", ["l1_unstructured", "random_unstructured", "ln_structured"])
@pytest.mark.parametrize("scope", ["layer", "global"])
def test_amount_zero_keeps_everything_and_one_prunes_everything(method, scope):
    weights = _weights((4, 6), (3, 2, 2))
    assert all(m.all() for m in compute_masks(weights, 0.0, method=method, scope=scope))
    assert not any(m.any() for m in compute_masks(weights, 1.0, method=method, scope=scope))


@settings(max_examples=examples(0.6))
@given(st.lists(st.integers(1, 6), min_size=1, max_size=4), st.data())
def test_pack_unpack_round_trip(shape, data):
    numel = math.prod(shape)
    bits = data.draw(st.lists(st.booleans(), min_size=numel, max_size=numel))
    mask = torch.tensor(bits, dtype=torch.bool).view(shape)
    packed = pack(mask)
    assert packed.dtype == torch.uint8
    assert packed.numel() == math.ceil(numel / 8)
    assert torch.equal(unpack(packed, mask.shape), mask)
