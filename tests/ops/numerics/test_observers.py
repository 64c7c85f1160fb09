"""surgery.ops.numerics.observers: settings validation, range observers and qparams against torch.ao, fused ops."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.ao.quantization.observer import (
    MinMaxObserver,
    MovingAverageMinMaxObserver,
    MovingAveragePerChannelMinMaxObserver,
    PerChannelMinMaxObserver,
)

import surgery
from surgery.core.errors import ConfigError, ConfigTypeError
from surgery.ops.numerics.fake_quant import compute_qparams, fake_quantize
from surgery.ops.numerics.grid import GridSpec
from surgery.ops.numerics.observers import NonFiniteError, Observer

BITS = list(range(2, 9))


def batches(count: int, shape: tuple[int, ...], seed: int = 0) -> list[torch.Tensor]:
    """Batches whose ranges differ (shifted and scaled), so running min/max and averages move."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) * (1 + i) + 0.3 * i for i in range(count)]


def ao_observer(spec: GridSpec, axis: int | None, moving: bool = False):
    """The torch.ao observer computing the same qparams as ``spec`` (custom range below 8 bits)."""
    quant_min, quant_max = spec.quant_range
    dtype = torch.qint8 if spec.symmetric else torch.quint8
    kwargs = {"dtype": dtype, "quant_min": quant_min, "quant_max": quant_max}
    if axis is None:
        scheme = torch.per_tensor_symmetric if spec.symmetric else torch.per_tensor_affine
        cls = MovingAverageMinMaxObserver if moving else MinMaxObserver
        extra = {"averaging_constant": spec.averaging} if moving else {}
        return cls(qscheme=scheme, **kwargs, **extra)
    scheme = torch.per_channel_symmetric if spec.symmetric else torch.per_channel_affine
    cls = MovingAveragePerChannelMinMaxObserver if moving else PerChannelMinMaxObserver
    extra = {"averaging_constant": spec.averaging} if moving else {}
    return cls(ch_axis=axis, qscheme=scheme, **kwargs, **extra)


def assert_same_qparams(ours: tuple[torch.Tensor, torch.Tensor], theirs: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Bit-identical scales and equal zero points (ours int32 and 0-d per tensor; torch.ao's shape [1])."""
    scale, zero_point = ours
    ao_scale, ao_zero_point = theirs
    assert scale.dtype == torch.float32 and zero_point.dtype == torch.int32
    assert torch.equal(scale.reshape(-1), ao_scale.reshape(-1))
    assert torch.equal(zero_point.reshape(-1).long(), ao_zero_point.reshape(-1).long())


def observed(spec: GridSpec, axis: int | None, data: list[torch.Tensor]) -> Observer:
    observer = Observer(spec, axis, "layer")
    for x in data:
        observer.observe(x)
    return observer


# --- settings --------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", BITS)
def test_quant_range_is_signed_for_symmetric_and_unsigned_for_affine(bits):
    assert GridSpec(bits=bits, symmetric=True).quant_range == (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
    assert GridSpec(bits=bits, symmetric=False).quant_range == (0, 2**bits - 1)


def test_default_spec_is_valid_and_validate_returns_it():
    spec = GridSpec()
    assert spec.validate("quantize.activations") is spec
    assert (spec.bits, spec.symmetric, spec.per_channel, spec.observer) == (8, False, False, "minmax")


BAD_SPECS = [
    ({"bits": 1}, "bits", ConfigError),
    ({"bits": 9}, "bits", ConfigError),
    ({"bits": 0}, "bits", ConfigError),
    ({"bits": -8}, "bits", ConfigError),
    ({"bits": True}, "bits", ConfigTypeError),
    ({"bits": "8"}, "bits", ConfigTypeError),
    ({"bits": 8.0}, "bits", ConfigTypeError),
    ({"bits": None}, "bits", ConfigTypeError),
    ({"observer": "histogram"}, "observer", ConfigError),
    ({"observer": "MinMax"}, "observer", ConfigError),
    ({"percentile": 50}, "percentile", ConfigError),
    ({"percentile": 100.5}, "percentile", ConfigError),
    ({"percentile": "99"}, "percentile", ConfigError),
    ({"averaging": 0}, "averaging", ConfigError),
    ({"averaging": 1.5}, "averaging", ConfigError),
]


@pytest.mark.parametrize("kwargs,key,error", BAD_SPECS, ids=[str(k) for k, _, _ in BAD_SPECS])
def test_validate_names_the_field_and_the_value(kwargs, key, error):
    with pytest.raises(error) as info:
        GridSpec.build(kwargs, "quantize.weights")
    assert info.value.field == f"quantize.weights.{key}"
    assert str(info.value).startswith(f"quantize.weights.{key}=")
    with pytest.raises(error) as info:  # a spec is validated when built, not when first used
        GridSpec(**kwargs)
    assert info.value.field == f"GridSpec.{key}"
    assert info.value.value == next(iter(kwargs.values()))


def test_a_spec_is_frozen_so_sharing_it_between_calls_is_safe(mlp):
    handle = surgery.quantize(mlp)
    spec = handle.weights["0.weight"].spec
    with pytest.raises(AttributeError):
        spec.bits = 4  # used to change the default of every later quantize() call
    handle.restore()
    with surgery.quantize(mlp) as again:
        assert again.weights["0.weight"].spec.bits == 8


def test_bits_errors_state_the_allowed_range():
    for bits in (1, 9, True, "8"):
        with pytest.raises(ConfigError, match=r"\[2, 8\]"):
            GridSpec(bits=bits).validate("quantize.weights")


def test_non_finite_error_is_a_config_error():
    assert issubclass(NonFiniteError, ConfigError) and issubclass(NonFiniteError, ValueError)


# --- scale and zero point as torch.ao ---------------------------------------------------------


@pytest.mark.parametrize("symmetric", [True, False], ids=["symmetric", "affine"])
def test_minmax_per_tensor_matches_torch_ao_minmax_observer(symmetric):
    spec = GridSpec(bits=8, symmetric=symmetric)
    data = batches(4, (16, 32))
    reference = ao_observer(spec, None)
    for x in data:
        reference(x)
    assert_same_qparams(observed(spec, None, data).qparams(), reference.calculate_qparams())


@pytest.mark.parametrize(
    "axis,shape",
    [(0, (8, 3, 3, 3)), (1, (4, 8, 5, 5)), (1, (6, 8))],
    ids=["conv-weight", "conv-output", "linear-output"],
)
@pytest.mark.parametrize("symmetric", [True, False], ids=["symmetric", "affine"])
def test_minmax_per_channel_matches_torch_ao_per_channel_observer(axis, shape, symmetric):
    spec = GridSpec(bits=8, symmetric=symmetric, per_channel=True)
    data = batches(3, shape, seed=1)
    reference = ao_observer(spec, axis)
    for x in data:
        reference(x)
    ours = observed(spec, axis, data).qparams()
    assert ours[0].shape == (shape[axis],)
    assert_same_qparams(ours, reference.calculate_qparams())


def test_default_weight_and_activation_settings_match_torch_ao_defaults():
    """Symmetric qint8 per output channel for weights, affine quint8 per tensor for activations."""
    weight = torch.randn(16, 8, 3, 3, generator=torch.Generator().manual_seed(3))
    reference = PerChannelMinMaxObserver(ch_axis=0, dtype=torch.qint8, qscheme=torch.per_channel_symmetric)
    reference(weight)
    ours = observed(GridSpec(bits=8, symmetric=True, per_channel=True), 0, [weight]).qparams()
    assert_same_qparams(ours, reference.calculate_qparams())
    assert not ours[1].any()

    data = batches(3, (4, 16, 6, 6), seed=4)
    reference = MinMaxObserver(dtype=torch.quint8, qscheme=torch.per_tensor_affine)
    for x in data:
        reference(x)
    assert_same_qparams(observed(GridSpec(), None, data).qparams(), reference.calculate_qparams())


@pytest.mark.parametrize("per_channel", [False, True], ids=["per-tensor", "per-channel"])
@pytest.mark.parametrize("symmetric", [True, False], ids=["symmetric", "affine"])
def test_moving_average_matches_torch_ao_moving_average_observer(per_channel, symmetric):
    spec = GridSpec(bits=8, symmetric=symmetric, per_channel=per_channel, observer="moving_average")
    assert spec.averaging == 0.01
    axis = 1 if per_channel else None
    data = batches(6, (4, 8, 5, 5), seed=5)
    reference = ao_observer(spec, axis, moving=True)
    for x in data:
        reference(x)
    ours = observed(spec, axis, data)
    assert_same_qparams(ours.qparams(), reference.calculate_qparams())
    # The average really moved: plain running extremes would give another range.
    assert not torch.equal(
        ours.qparams()[0], observed(GridSpec(symmetric=symmetric, per_channel=per_channel), axis, data).qparams()[0]
    )


def test_moving_average_uses_the_averaging_constant():
    data = batches(5, (32,), seed=6)
    spec = GridSpec(observer="moving_average", averaging=0.5)
    reference = MovingAverageMinMaxObserver(averaging_constant=0.5, dtype=torch.quint8)
    for x in data:
        reference(x)
    assert_same_qparams(observed(spec, None, data).qparams(), reference.calculate_qparams())


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("per_channel", [False, True], ids=["per-tensor", "per-channel"])
@pytest.mark.parametrize("symmetric", [True, False], ids=["symmetric", "affine"])
def test_every_bit_width_matches_torch_ao_with_a_custom_range(bits, per_channel, symmetric):
    spec = GridSpec(bits=bits, symmetric=symmetric, per_channel=per_channel)
    axis = 0 if per_channel else None
    data = batches(2, (6, 20), seed=bits)
    reference = ao_observer(spec, axis)
    for x in data:
        reference(x)
    assert_same_qparams(observed(spec, axis, data).qparams(), reference.calculate_qparams())


RANGES = {
    "positive-only": torch.tensor([0.5, 1.0, 3.0]),
    "negative-only": torch.tensor([-4.0, -1.0, -0.25]),
    "all-zero": torch.zeros(3),
    "constant": torch.full((3,), 2.5),
    "tiny": torch.tensor([-1e-30, 1e-30, 0.0]),
}


@pytest.mark.parametrize("symmetric", [True, False], ids=["symmetric", "affine"])
@pytest.mark.parametrize("values", RANGES.values(), ids=RANGES.keys())
def test_degenerate_ranges_match_torch_ao(values, symmetric):
    """Zero is always representable and the scale never drops below float32 eps."""
    spec = GridSpec(bits=8, symmetric=symmetric)
    reference = ao_observer(spec, None)
    reference(values)
    scale, zero_point = observed(spec, None, [values]).qparams()
    assert_same_qparams((scale, zero_point), reference.calculate_qparams())
    assert scale >= torch.finfo(torch.float32).eps
    assert fake_quantize(torch.zeros(()), scale, zero_point, None, spec) == 0


def test_compute_qparams_widens_the_range_to_include_zero():
    spec = GridSpec(bits=8)
    scale, zero_point = compute_qparams(torch.tensor(2.0), torch.tensor(4.0), spec)
    assert torch.equal(scale, torch.tensor(4.0 / 255)) and zero_point == 0
    scale, zero_point = compute_qparams(torch.tensor(-4.0), torch.tensor(-2.0), spec)
    assert torch.equal(scale, torch.tensor(4.0 / 255)) and zero_point == 255


def test_observer_accepts_half_precision_and_leaves_the_input_alone():
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(7)).half().requires_grad_()
    before = x.detach().clone()
    scale, _ = observed(GridSpec(), None, [x]).qparams()
    reference = MinMaxObserver(dtype=torch.quint8)
    reference(x.detach().float())
    assert torch.equal(scale.reshape(1), reference.calculate_qparams()[0])
    assert torch.equal(x.detach(), before)


# --- percentile ---------------------------------------------------------------------------------


def _with_outlier(seed: int = 8) -> torch.Tensor:
    x = torch.randn(100_000, generator=torch.Generator().manual_seed(seed))
    x[1234] = 1000.0
    return x


def test_percentile_clips_a_single_huge_outlier():
    x = _with_outlier()
    minmax_scale, _ = observed(GridSpec(bits=8), None, [x]).qparams()
    percentile_scale, _ = observed(GridSpec(bits=8, observer="percentile"), None, [x]).qparams()
    assert minmax_scale > 1000 / 255
    assert percentile_scale < minmax_scale / 50  # the bulk of N(0, 1) spans about +-4
    spec = GridSpec(bits=8, observer="percentile")
    clipped = fake_quantize(x, *observed(spec, None, [x]).qparams(), None, spec)
    assert clipped.max() < 10


def test_percentile_is_the_mean_of_per_batch_quantiles():
    data = batches(3, (4, 500), seed=9)
    spec = GridSpec(observer="percentile", percentile=99.0, per_channel=True)
    q = torch.tensor([0.01, 0.99])
    quantiles = [torch.quantile(x.reshape(4, -1), q, dim=1) for x in data]
    low = sum(lo for lo, _ in quantiles) / 3
    high = sum(hi for _, hi in quantiles) / 3
    expected = compute_qparams(low, high, spec)
    ours = observed(spec, 0, data).qparams()
    torch.testing.assert_close(ours[0], expected[0], rtol=1e-6, atol=0)  # running mean vs direct mean
    assert (ours[1] - expected[1]).abs().max() <= 1


def test_percentile_100_is_minmax():
    data = batches(1, (64,), seed=10)
    minmax = observed(GridSpec(), None, data).qparams()
    percentile = observed(GridSpec(observer="percentile", percentile=100), None, data).qparams()
    assert torch.equal(minmax[0], percentile[0]) and torch.equal(minmax[1], percentile[1])


# --- bad data -------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("kind", ["minmax", "moving_average", "percentile"])
def test_non_finite_values_raise_and_keep_the_range(bad, kind):
    observer = Observer(GridSpec(observer=kind), None, "block.fc")
    observer.observe(torch.linspace(-1, 1, 11))
    before = observer.qparams()
    x = torch.zeros(5)
    x[2] = bad
    with pytest.raises(NonFiniteError, match="block.fc") as info:
        observer.observe(x)
    assert isinstance(info.value, ConfigError)
    assert observer.count == 1
    after = observer.qparams()
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])


def test_an_observer_that_saw_nothing_names_the_layer():
    with pytest.raises(ConfigError, match="layer3.conv") as info:
        Observer(GridSpec(), None, "layer3.conv").qparams()
    assert "no data" in str(info.value)


# --- the fused ops ----------------------------------------------------------------------------------


@pytest.mark.parametrize("symmetric", [True, False], ids=["symmetric", "affine"])
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_fake_quantize_is_torch_fused_op(bits, symmetric):
    x = torch.randn(5, 7, 3, generator=torch.Generator().manual_seed(bits))
    per_tensor = GridSpec(bits=bits, symmetric=symmetric)
    per_channel = GridSpec(bits=bits, symmetric=symmetric, per_channel=True)
    quant_min, quant_max = per_tensor.quant_range
    scale, zero_point = observed(per_tensor, None, [x]).qparams()
    assert torch.equal(
        fake_quantize(x, scale, zero_point, None, per_tensor),
        torch.fake_quantize_per_tensor_affine(x, scale, zero_point, quant_min, quant_max),
    )
    scale, zero_point = observed(per_channel, 1, [x]).qparams()
    expected = torch.fake_quantize_per_channel_affine(x, scale, zero_point, 1, quant_min, quant_max)
    got = fake_quantize(x, scale, zero_point, 1, per_channel)
    assert torch.equal(got, expected)
    assert all(got[:, c].unique().numel() <= 2**bits for c in range(7))
    assert torch.equal(fake_quantize(got, scale, zero_point, 1, per_channel), got)  # on the grid


def test_moving_average_of_a_constant_channel_keeps_low_at_most_high():
    """Found by the round-trip property test: with averaging 1, ``a + (b - a)`` can round the
    two extremes of a channel whose values are all 0.1 one ulp the wrong way round."""
    from surgery.ops.numerics.grid import ObservedRange
    from surgery.ops.numerics.observers import moving_average

    spec = GridSpec(observer="moving_average", averaging=1.0)
    x = torch.full((3, 5), 0.1)
    previous = ObservedRange(torch.tensor([-0.007486820220947266, -0.7420351505279541, -0.781231164932251]), torch.tensor([0.514417290687561, -0.3851543664932251, 0.26815736293792725]), 1)  # fmt: skip
    low, high = moving_average(x, previous, spec)
    assert (low <= high).all() and torch.allclose(low, torch.full((3,), 0.1))


def test_a_range_whose_scale_overflows_float32_is_refused_naming_the_layer():
    observer = Observer(GridSpec(bits=8, symmetric=False), None, "k_proj")
    observer.observe(torch.tensor([3e38, -3e38]))  # finite values, but high - low is not
    with pytest.raises(NonFiniteError, match=r"quantize.calibration='k_proj'.*overflows float32"):
        observer.qparams()


def test_rounding_is_divide_or_reciprocal_and_reciprocal_multiplies_by_the_inverse_scale():
    from surgery.ops.numerics.fake_quant import fake_quantize_dynamic

    with pytest.raises(ConfigError, match=r"^GridSpec.rounding='up': must be divide or reciprocal$"):
        surgery.GridSpec(rounding="up")
    x = torch.randn(512, 64, generator=torch.Generator().manual_seed(0))
    spec = surgery.GridSpec(bits=8, symmetric=True, dynamic="token", rounding="reciprocal")
    found, scale = fake_quantize_dynamic(x, spec)
    expected = torch.clamp(torch.round(x * (1.0 / scale.reshape(-1, 1))), -128, 127) * scale.reshape(-1, 1)
    assert torch.equal(found, expected)
    assert not torch.equal(found, fake_quantize_dynamic(x, dataclasses.replace(spec, rounding="divide"))[0])


def test_actorder_group_is_accepted_for_gptq_and_a_bad_value_names_the_allowed_ones():
    spec = surgery.QuantizeSpec(weights=GridSpec(bits=4, group_size=32), method={"name": "gptq", "actorder": "group"})
    assert spec.method == surgery.GptqSettings(actorder="group")
    assert surgery.GptaqSettings(actorder="group").actorder == "group"  # without groups: "weight"
    with pytest.raises(ConfigError, match=r"^quantize.method.actorder='desc': must be null or one of weight, group$"):
        surgery.GptqSettings(actorder="desc")
    with pytest.raises(ConfigError, match=r"^quantize.method='rtn': has no settings of its own; got \['actorder'\]$"):
        surgery.QuantizeSpec(weights=GridSpec(bits=4, group_size=32), method={"name": "rtn", "actorder": "group"})


def test_groups_by_a_group_index_round_each_column_on_its_own_groups_grid():
    from surgery.ops.numerics.fake_quant import fake_quantize_groups, g_idx_problem

    spec = GridSpec(bits=4, group_size=4)
    weight = torch.randn(3, 10, generator=torch.Generator().manual_seed(0))
    g_idx = torch.tensor([2, 0, 1, 0, 2, 1, 0, 1, 1, 0], dtype=torch.int32)  # groups of 4, 4 and 2 columns
    scale = torch.rand(3, 3) + 0.1
    zero_point = torch.randint(0, 16, (3, 3), dtype=torch.int32)
    ours = fake_quantize_groups(weight, scale, zero_point, 0, spec, g_idx)
    s, z = scale[:, g_idx.long()], zero_point[:, g_idx.long()]
    assert torch.equal(ours, (torch.clamp(torch.round(weight / s) + z, 0, 15) - z) * s)
    assert g_idx_problem(g_idx, 10, 4) is None
    assert "exactly 4 columns in each group" in g_idx_problem(torch.zeros(10, dtype=torch.int32), 10, 4)
    assert "shape (9,)" in g_idx_problem(g_idx[:9], 10, 4)
    assert "dtype torch.float32" in g_idx_problem(g_idx.float(), 10, 4)


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 8])
def test_full_range_is_llama_cpps_q4_0_grid_held_as_an_affine_one(bits):
    """llama.cpp's Q4_0 (and auto-round's int_sym): d = max / -2^(bits-1), the value of largest
    magnitude (its sign kept) the grid's extra level; here scale |d| and a zero point."""
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(bits))
    x[0] = x[0].abs()  # rows whose extreme is on either side, and one all positive
    spec = GridSpec(bits=bits, per_channel=True, observer="full_range")
    observer = Observer(spec, 0, "w")
    observer.observe(x[:, :16])
    observer.observe(x[:, 16:])  # a second batch keeps the running extremes
    scale, zero_point = observer.qparams()
    largest = x.abs().amax(1)
    signed = torch.where(-x.amin(1) > x.amax(1), -largest, largest)  # the value of largest magnitude
    d = signed / -(2 ** (bits - 1))  # llama.cpp: d = max / -8 at 4 bits
    levels = torch.arange(-(2 ** (bits - 1)), 2 ** (bits - 1)).float()  # q - 2^(bits-1), q in [0, 2^bits)
    theirs = (x / d[:, None]).round().clamp(levels[0], levels[-1]) * d[:, None]
    ours = fake_quantize(x, scale, zero_point, 0, spec)
    torch.testing.assert_close(scale, d.abs(), rtol=1e-6, atol=0)
    assert set(zero_point.tolist()) <= {2 ** (bits - 1), 2 ** (bits - 1) - 1}
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6 * float(largest.max()))


@pytest.mark.parametrize("kwargs", [{"symmetric": True}, {"format": "fp8_e4m3"}])
def test_full_range_refuses_a_grid_that_is_already_symmetric_or_not_integer(kwargs):
    with pytest.raises(ConfigError, match=r"^quantize.weights.observer='full_range': is symmetric about zero on an"):
        GridSpec.build({"observer": "full_range", **kwargs}, "quantize.weights")
