"""Tests of ``surgery.ops.rewrite.rewriting``: input-rewriting hooks, the built-in rewrites and config names."""

from __future__ import annotations

import copy
import pickle
from unittest import mock

import pytest
import torch
from torch import nn

import surgery
from surgery.core.errors import ConfigError
from surgery.core.handles import Handle
from surgery.ops.rewrite.rewriting import (
    AddNoise,
    Cast,
    ChannelsLast,
    Clamp,
    Identity,
    InputRewriter,
    Normalize,
    Resize,
    identity_rewrite,
    rewrite_from_config,
    rewrite_inputs,
)
from surgery.testing import module_hook_counts


class Scaled(nn.Module):
    """``forward(x, *, scale=None)``: a keyword-only input the rewrite must reach."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, *, scale: torch.Tensor | None = None) -> torch.Tensor:
        y = self.linear(x)
        return y if scale is None else y * scale


class Recorder(nn.Module):
    """Records the positional inputs it receives and returns the first unchanged."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(x)
        return x


def assert_no_hooks(model: nn.Module) -> None:
    """Fail if any module of ``model`` still carries a hook of any kind."""
    leftover = {name: count for name, count in module_hook_counts(model).items() if count}
    assert not leftover, f"hooks left on the model: {leftover}"


def double(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    return tuple(a * 2 for a in args), {k: v * 2 for k, v in kwargs.items()}


def drop_first(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    return args[1:], kwargs


def pre_hook_count(model: nn.Module) -> int:
    """Forward-pre hooks on every module, also checking each is flagged ``with_kwargs``."""
    for m in model.modules():
        assert set(m._forward_pre_hooks_with_kwargs) == set(m._forward_pre_hooks)
    return sum(n for key, n in module_hook_counts(model).items() if key.endswith(":_forward_pre_hooks"))


# --------------------------------------------------------------------------- the verb


def test_keyword_inputs_are_rewritten() -> None:
    model = Scaled().eval()
    x, scale = torch.randn(3, 4), torch.tensor(3.0)
    expected = model(x * 2, scale=scale * 2)
    with rewrite_inputs(model, double):
        assert torch.equal(model(x, scale=scale), expected)
    assert_no_hooks(model)


def test_positional_input_rewritten_on_root(mlp: nn.Module, mlp_input: torch.Tensor) -> None:
    expected = mlp(mlp_input * 2)
    with rewrite_inputs(mlp, double) as handle:
        assert isinstance(handle, Handle) and handle.kind == "rewrite"
        assert torch.equal(mlp(mlp_input), expected)
        assert {k: n for k, n in module_hook_counts(mlp).items() if n} == {
            ":_forward_pre_hooks": 1,
            ":_forward_pre_hooks_with_kwargs": 1,
        }
        assert pre_hook_count(mlp) == 1


def test_selected_submodule_only(mlp: nn.Module, mlp_input: torch.Tensor) -> None:
    hidden = mlp[1](mlp[0](mlp_input))
    expected = mlp[4](mlp[3](mlp[2](hidden * 2)))
    with rewrite_inputs(mlp, double, select="2"):
        out = mlp(mlp_input)
        assert len(mlp[2]._forward_pre_hooks) == 1 and len(mlp._forward_pre_hooks) == 0
    assert torch.equal(out, expected)


def test_select_and_exclude(mlp: nn.Module) -> None:
    with rewrite_inputs(mlp, identity_rewrite, select=nn.Linear, exclude="4"):
        assert [name for name, m in mlp.named_modules() if m._forward_pre_hooks] == ["0", "2"]


def test_no_selection_means_root_only(mlp: nn.Module) -> None:
    with rewrite_inputs(mlp, identity_rewrite, select=None, exclude=[]):
        assert [name for name, m in mlp.named_modules() if m._forward_pre_hooks] == [""]
    with pytest.raises(ConfigError, match="rewrite.exclude"):
        rewrite_inputs(mlp, identity_rewrite, exclude="0")


def test_selection_matching_nothing_is_named(mlp: nn.Module) -> None:
    with pytest.raises(ConfigError, match="rewrite.select"):
        rewrite_inputs(mlp, identity_rewrite, select="nope")


def test_not_callable_is_rejected(mlp: nn.Module) -> None:
    with pytest.raises(ConfigError, match="rewrite.fn"):
        rewrite_inputs(mlp, "normalize")  # type: ignore[arg-type]


def test_restore_removes_every_hook_and_is_exact(convnet: nn.Module, image_input: torch.Tensor) -> None:
    before = convnet(image_input)
    handle = rewrite_inputs(convnet, Clamp(min=-0.1, max=0.1), select=(nn.Conv2d, nn.Linear))
    assert pre_hook_count(convnet) == 3
    assert not torch.equal(convnet(image_input), before)
    handle.restore()
    handle.restore()  # idempotent
    assert handle.state == "restored"
    assert all(not m._forward_pre_hooks and not m._forward_pre_hooks_with_kwargs for m in convnet.modules())
    assert not any(module_hook_counts(convnet).values())
    assert torch.equal(convnet(image_input), before)


def test_bake_removes_hooks_and_returns_plain_model(mlp: nn.Module, mlp_input: torch.Tensor) -> None:
    before = mlp(mlp_input)
    handle = rewrite_inputs(mlp, double, select=nn.Linear)
    assert handle.bake() is mlp
    assert handle.state == "baked"
    assert_no_hooks(mlp)
    assert torch.equal(mlp(mlp_input), before)  # the rewrite is gone, not folded in
    assert "without" in type(handle).bake.__doc__


def test_context_manager_restores(mlp: nn.Module, mlp_input: torch.Tensor) -> None:
    before = mlp(mlp_input)
    with rewrite_inputs(mlp, double) as handle:
        assert not torch.equal(mlp(mlp_input), before)
    assert handle.state == "restored"
    assert torch.equal(mlp(mlp_input), before)


def test_applying_is_all_or_nothing(mlp: nn.Module) -> None:
    real = nn.Module.register_forward_pre_hook
    calls = {"n": 0}

    def fail_on_third(self: nn.Module, *args: object, **kwargs: object):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected")
        return real(self, *args, **kwargs)

    with mock.patch.object(nn.Module, "register_forward_pre_hook", fail_on_third):
        with pytest.raises(RuntimeError, match="injected"):
            rewrite_inputs(mlp, double, select=nn.Linear)
    assert calls["n"] == 3
    assert_no_hooks(mlp)


def test_changing_positional_count_names_the_module(mlp: nn.Module, mlp_input: torch.Tensor) -> None:
    with rewrite_inputs(mlp, drop_first, select="2"), pytest.raises(ConfigError, match=r"rewrite='2'.*from 1 to 0"):
        mlp(mlp_input)
    with rewrite_inputs(mlp, drop_first), pytest.raises(ConfigError, match="<root>"):
        mlp(mlp_input)


def test_rewrite_must_return_a_pair(mlp: nn.Module, mlp_input: torch.Tensor) -> None:
    with rewrite_inputs(mlp, lambda args, kwargs: args):
        with pytest.raises(ConfigError, match=r"must return \(args, kwargs\)"):
            mlp(mlp_input)


@pytest.mark.parametrize("copier", [copy.deepcopy, lambda m: pickle.loads(pickle.dumps(m))], ids=["deepcopy", "pickle"])
def test_copy_with_builtin_attached(mlp: nn.Module, mlp_input: torch.Tensor, copier) -> None:
    with rewrite_inputs(mlp, Normalize(0.5, 2.0), select="0"):
        expected = mlp(mlp_input)
        clone = copier(mlp)
    assert isinstance(next(iter(clone[0]._forward_pre_hooks.values())), InputRewriter)
    assert torch.equal(clone(mlp_input), expected)


def test_pickle_add_noise_keeps_generator_position(mlp: nn.Module, mlp_input: torch.Tensor) -> None:
    with rewrite_inputs(mlp, AddNoise(std=0.5, seed=3)):
        first = mlp(mlp_input)  # advances the generator once
        clone, twin = pickle.loads(pickle.dumps(mlp)), copy.deepcopy(mlp)
        second = mlp(mlp_input)
        assert not torch.equal(first, second)
        assert torch.equal(clone(mlp_input), second)
        assert torch.equal(twin(mlp_input), second)


# --------------------------------------------------------------------------- built-ins


def record(rewrite, *inputs: torch.Tensor) -> tuple[Recorder, torch.Tensor]:
    model = Recorder()
    with rewrite_inputs(model, rewrite):
        out = model(*inputs)
    assert_no_hooks(model)
    return model, out


def test_normalize_matches_manual() -> None:
    x = torch.randn(2, 3, 5, 5, generator=torch.Generator().manual_seed(0))
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    _, out = record(Normalize(mean, std), x)
    manual = (x - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(1, 3, 1, 1)
    assert torch.equal(out, manual)


def test_normalize_wrong_channel_count() -> None:
    with pytest.raises(ConfigError, match="3 channels"):
        record(Normalize((0.1, 0.2, 0.3), (1.0, 1.0, 1.0)), torch.randn(2, 4, 3, 3))


def test_resize_output_shape() -> None:
    _, out = record(Resize((7, 9)), torch.randn(2, 3, 12, 12))
    assert out.shape == (2, 3, 7, 9)
    _, out = record(Resize(5, mode="nearest"), torch.randn(1, 2, 10, 10))
    assert out.shape == (1, 2, 5, 5)


def test_channels_last_seen_inside() -> None:
    model, _ = record(ChannelsLast(), torch.randn(2, 3, 4, 5))
    inside = model.seen[0]
    assert inside.is_contiguous(memory_format=torch.channels_last)
    assert not inside.is_contiguous()


def test_clamp() -> None:
    x = torch.linspace(-2, 2, 9)
    _, out = record(Clamp(min=-0.5, max=1.0), x)
    assert torch.equal(out, x.clamp(-0.5, 1.0))
    _, out = record(Clamp(max=0.0), x)
    assert out.max().item() == 0.0 and out.min().item() == -2.0


def test_cast_dtype_seen_inside() -> None:
    model, _ = record(Cast("float64"), torch.randn(3))
    assert model.seen[0].dtype == torch.float64
    model, _ = record(Cast(torch.float16), torch.randn(3))
    assert model.seen[0].dtype == torch.float16


def test_builtins_leave_non_floating_inputs_alone() -> None:
    ids = torch.arange(4)
    args, kwargs = Cast("float64")((ids, 3), {"mask": ids, "x": torch.ones(2)})
    assert args[0] is ids and args[1] == 3 and kwargs["mask"] is ids
    assert kwargs["x"].dtype == torch.float64


def test_index_and_keys_choose_inputs() -> None:
    a, b = torch.ones(2), torch.ones(2)
    args, kwargs = Clamp(max=0.0, index=1, keys=["s"])((a, b), {"s": torch.ones(1), "t": torch.ones(1)})
    assert args[0] is a and torch.equal(args[1], torch.zeros(2))
    assert torch.equal(kwargs["s"], torch.zeros(1)) and torch.equal(kwargs["t"], torch.ones(1))


def test_add_noise_reproducible_by_seed(mlp_input: torch.Tensor) -> None:
    def run(seed: int) -> list[torch.Tensor]:
        model = Recorder()
        with rewrite_inputs(model, AddNoise(std=0.1, seed=seed)):
            return [model(mlp_input) for _ in range(3)]

    first, again, other = run(7), run(7), run(8)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not torch.equal(first[0], first[1])  # the sequence advances per call
    assert not any(torch.equal(a, b) for a, b in zip(first, other))
    assert not torch.equal(first[0], mlp_input)


def test_identity_is_bit_identical(convnet: nn.Module, image_input: torch.Tensor) -> None:
    plain = convnet(image_input)
    with rewrite_inputs(convnet, Identity(), select=nn.Conv2d):
        hooked = convnet(image_input)
    with rewrite_inputs(convnet, identity_rewrite):
        by_function = convnet(image_input)
    assert torch.equal(hooked, plain) and torch.equal(by_function, plain)


@pytest.mark.parametrize(
    ("rewrite", "kwargs", "field"),
    [
        (AddNoise, {"std": -0.1}, "rewrite.std"),
        (Normalize, {"mean": 0.0, "std": (1.0, -1.0)}, "rewrite.std"),
        (Normalize, {"mean": (0.0, 0.0), "std": (1.0, 1.0, 1.0)}, "rewrite.std"),
        (Resize, {"size": 0}, "rewrite.size"),
        (Resize, {"size": (4, -2)}, "rewrite.size"),
        (Resize, {"size": 4, "mode": "cubic"}, "rewrite.mode"),
        (Clamp, {}, "rewrite.min"),
        (Clamp, {"min": 1.0, "max": 0.0}, "rewrite.max"),
        (Cast, {"dtype": "float65"}, "rewrite.dtype"),
        (AddNoise, {"seed": 1.5}, "rewrite.seed"),
        (Identity, {"index": "0"}, "rewrite.index"),
    ],
)
def test_builtin_validation_names_the_field(rewrite, kwargs, field) -> None:
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")) as info:
        rewrite(**kwargs)
    assert info.value.field == field


# --------------------------------------------------------------------------- by name


def test_from_config_builds_builtins() -> None:
    cast = rewrite_from_config("cast", dtype="float64")
    assert cast == Cast(torch.float64)
    assert isinstance(rewrite_from_config("channels_last"), ChannelsLast)
    assert rewrite_from_config("normalize", mean=[0.5], std=[0.25]) == Normalize(0.5, 0.25)
    assert rewrite_from_config("add_noise", std=0.2, seed=1) == AddNoise(std=0.2, seed=1)
    assert isinstance(rewrite_from_config("identity"), Identity)
    assert rewrite_from_config("resize", size=[8, 8]).size == (8, 8)
    assert rewrite_from_config("clamp", min=0).min == 0


def test_from_config_dotted_path(mlp: nn.Module, mlp_input: torch.Tensor) -> None:
    fn = rewrite_from_config("surgery.ops.rewrite.rewriting.identity_rewrite")
    assert fn is identity_rewrite
    before = mlp(mlp_input)
    with rewrite_inputs(mlp, fn):
        assert torch.equal(mlp(mlp_input), before)


def test_from_config_unknown_name() -> None:
    with pytest.raises(ConfigError, match="must be one of cast, normalize") as info:
        rewrite_from_config("normalise")
    assert info.value.field == "rewrite.name"


@pytest.mark.parametrize("path", ["surgery.no_such_module.fn", "surgery.ops.rewrite.rewriting.no_such_fn"])
def test_from_config_unimportable_path(path: str) -> None:
    with pytest.raises(ConfigError, match="could not be imported") as info:
        rewrite_from_config(path)
    message = str(info.value)
    assert path in message and "\n" not in message
    assert info.value.field == "rewrite.name"


def test_from_config_bad_parameters() -> None:
    with pytest.raises(ConfigError, match="invalid parameters for 'clamp'"):
        rewrite_from_config("clamp", minimum=0)
    with pytest.raises(ConfigError, match="takes no parameters"):
        rewrite_from_config("surgery.ops.rewrite.rewriting.identity_rewrite", std=1)
    with pytest.raises(ConfigError, match="is not callable"):
        rewrite_from_config("surgery.ops.rewrite.rewriting.RESIZE_MODES")


def test_a_registered_rewrite_is_built_by_name_with_its_parameters(mlp, mlp_input):
    from surgery.ops.rewrite.rewriting import REWRITES, rewrite_from_config

    def scale(factor: float):
        return lambda args, kwargs: ((args[0] * factor, *args[1:]), kwargs)

    surgery.register_rewrite("scale_demo", scale)
    try:
        expected = mlp(mlp_input * 0.5)
        with surgery.rewrite_inputs(mlp, rewrite_from_config("scale_demo", factor=0.5)):
            assert torch.equal(mlp(mlp_input), expected)
        with pytest.raises(ConfigError, match="rewrite.name='scale_dem'.*did you mean 'scale_demo'"):
            rewrite_from_config("scale_dem")
    finally:
        REWRITES.unregister("scale_demo")
