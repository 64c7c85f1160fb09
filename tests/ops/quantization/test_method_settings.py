"""A weight method's own settings, apart from the grid: given as quantize(method=...), registered with the method."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import surgery
from surgery.core.errors import ConfigError, ConfigTypeError
from surgery.ops.numerics.weight_methods import weight_method

GRID = surgery.GridSpec(bits=4, group_size=32)


@pytest.fixture(scope="module")
def model_and_batches():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 16))
    return model, [torch.randn(32, 64) for _ in range(4)]


def quantized(model_and_batches, **keywords) -> list[torch.Tensor]:
    model, batches = model_and_batches
    model = copy.deepcopy(model)
    surgery.quantize(model, calibration=batches, progress=False, **keywords)
    return [p.detach().clone() for p in model.parameters()]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_each_method_registers_its_settings_and_rtn_has_none():
    assert weight_method("gptq").settings is surgery.GptqSettings
    assert weight_method("gptaq").settings is surgery.GptaqSettings
    assert weight_method("autoround").settings is surgery.AutoRoundSettings
    assert weight_method("rtn").settings is None


def test_the_method_by_name_beside_the_grid_computes_what_the_grid_s_method_does(model_and_batches):
    by_grid = quantized(model_and_batches, weights=surgery.GridSpec(bits=4, group_size=32), method="gptq")
    assert same(by_grid, quantized(model_and_batches, weights=GRID, method="gptq"))
    assert same(by_grid, quantized(model_and_batches, weights=GRID, method=surgery.GptqSettings()))
    assert same(by_grid, quantized(model_and_batches, weights=GRID, method={"name": "gptq", "damping": 0.01}))


def test_gptq_s_damping_and_block_size_reach_the_solver(model_and_batches):
    default = quantized(model_and_batches, weights=GRID, method="gptq")
    assert same(default, quantized(model_and_batches, weights=GRID, method=surgery.GptqSettings(block_size=128)))
    damped = quantized(model_and_batches, weights=GRID, method=surgery.GptqSettings(damping=0.5))
    assert not same(default, damped)
    # a block of 16 columns: the groups of 32 starting inside the 64-column block no longer do (the
    # reference's own dependence on the block size: a group's scale is taken at its block's start)
    blocked = quantized(model_and_batches, weights=GRID, method=surgery.GptqSettings(block_size=16))
    assert not same(default, blocked)


def test_autoround_s_seed_batch_and_rate_reach_the_tuning(model_and_batches):
    base = {"weights": GRID}  # 4 calibration batches: a batch of 2 draws half of them each step, by seed
    default = quantized(model_and_batches, **base, method=surgery.AutoRoundSettings(iterations=20, batch=2))
    given = {"name": "autoround", "iterations": 20, "batch": 2}
    assert same(default, quantized(model_and_batches, **base, method=given))
    for changed in ({"seed": 7}, {"batch": 1}, {"lr": 0.2}):
        settings = surgery.AutoRoundSettings(**{"iterations": 20, "batch": 2, **changed})
        assert not same(default, quantized(model_and_batches, **base, method=settings)), changed


def test_the_grid_describes_the_grid_only_and_its_pre_0_3_method_fields_warn_and_move_to_the_method():
    spec = surgery.QuantizeSpec(weights=surgery.GridSpec(bits=4, group_size=32), method="gptq")
    assert spec.weights == surgery.GridSpec(bits=4, group_size=32) and spec.weights.method is None
    assert "method" not in spec.weights.as_dict() and "actorder" not in repr(spec.weights)
    assert spec.method == surgery.GptqSettings() and spec.weight_method.name == "gptq"
    assert surgery.QuantizeSpec(weights=surgery.GridSpec(bits=4)).method == "rtn"  # a method without settings: its name
    with pytest.warns(DeprecationWarning, match=r"GridSpec\(method=, actorder=\) is deprecated.*quantize\(method="):
        old = surgery.GridSpec(bits=4, method="gptq", actorder="weight")
    moved = surgery.QuantizeSpec(weights=old)
    assert moved.method == surgery.GptqSettings(actorder="weight") and moved.weights == surgery.GridSpec(bits=4)
    assert moved.weights.method is None and moved.weights.actorder is None
    assert surgery.QuantizeSpec(weights=old, method="gptq").method == surgery.GptqSettings(actorder="weight")


@pytest.mark.filterwarnings("ignore:GridSpec.*is deprecated:DeprecationWarning")
def test_a_pre_0_3_grid_naming_the_method_computes_what_quantize_method_does_bit_for_bit(model_and_batches):
    old = quantized(
        model_and_batches, weights=surgery.GridSpec(bits=4, group_size=32, method="gptq", actorder="weight")
    )
    new = quantized(model_and_batches, weights=GRID, method=surgery.GptqSettings(actorder="weight"))
    assert same(old, new) and not same(old, quantized(model_and_batches, weights=GRID))  # not round to nearest


@pytest.mark.filterwarnings("ignore:GridSpec.*is deprecated:DeprecationWarning")
def test_a_pre_0_3_grid_s_method_and_the_given_method_agree_or_are_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"^quantize.method='gptq': is given beside weights.method='autoround'"):
        surgery.QuantizeSpec(weights=surgery.GridSpec(bits=4, method="autoround"), method="gptq")
    with pytest.raises(
        ConfigError, match=r"^quantize.method.actorder='group': is given beside weights.actorder='weight'"
    ):
        surgery.QuantizeSpec(
            weights=surgery.GridSpec(bits=4, group_size=32, method="gptq", actorder="weight"),
            method=surgery.GptqSettings(actorder="group"),
        )
    for method in ("rtn", "gptq"):  # a pre-0.3 grid as as_dict() wrote it out: iterations at its old default
        spec = surgery.QuantizeSpec(weights=surgery.GridSpec(bits=4, method=method, iterations=200))
        assert spec.weight_method.name == method
    with pytest.raises(ConfigError, match=r"^quantize.weights.iterations=5: is not a setting of method 'gptq'"):
        surgery.QuantizeSpec(weights=surgery.GridSpec(bits=4, iterations=5), method="gptq")
    with pytest.raises(ConfigError, match=r"^quantize.activations.method='gptq': applies to weights"):
        surgery.QuantizeSpec(activations=surgery.GridSpec(method="gptq"))


def test_the_method_s_own_settings_are_checked_in_one_line():
    with pytest.raises(ConfigError, match=r"^quantize.method.damping=0: must be a number in \(0, 1\]"):
        surgery.GptqSettings(damping=0)
    with pytest.raises(ConfigError, match=r"^quantize.method='rtn': has no settings of its own"):
        surgery.QuantizeSpec(method={"name": "rtn", "damping": 0.1})
    with pytest.raises(ConfigTypeError, match=r"^quantize.method=.*: must be a method's name or its settings"):
        surgery.QuantizeSpec(method=surgery.GridSpec())
    with pytest.raises(ConfigError, match=r"^quantize.method='gptq': picks the weights' method; set weights too"):
        surgery.QuantizeSpec(weights=None, activations=surgery.GridSpec(), method="gptq")


def test_a_recipe_s_quantize_method_section_builds_the_settings():
    from surgery.cli.steps.quantize import QuantizeConfig

    config = QuantizeConfig(weights={"bits": 4, "group_size": 32}, method={"name": "gptq", "block_size": 64})
    assert config.method == surgery.GptqSettings(block_size=64) and config.weights.method is None


def test_a_method_s_settings_must_be_a_frozen_dataclass_of_its_own():
    from dataclasses import dataclass

    from surgery.ops.numerics.weight_methods import register_weight_method

    @dataclass
    class Loose:
        steps: int = 1

    with pytest.raises(ConfigTypeError, match=r"^register_weight_method.settings=.*: must be a frozen dataclass"):
        register_weight_method("loose_test", lambda problem: {}, settings=Loose)
    with pytest.raises(
        ConfigError, match=r"^register_weight_method.settings='GptqSettings': already names method 'gptq'"
    ):
        register_weight_method("copy_test", lambda problem: {}, settings=surgery.GptqSettings)
    assert "loose_test" not in surgery.ops.numerics.weight_methods.WEIGHT_METHODS
