"""Property-based round trips: random small models x random prune plans keep every invariant."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import surgery
from surgery.checks import (
    collect,
    global_hook_counts,
    max_difference,
    module_hook_counts,
    snapshot,
    snapshot_differences,
)

CONV_KINDS = ["conv", "conv", "bn", "relu", "gelu", "tanh", "residual"]
LINEAR_KINDS = ["linear", "linear", "bn", "relu", "tanh", "sigmoid"]
SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])


class Residual(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)
        self.bn = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 1, bias=False)

    def forward(self, x):
        return x + self.conv2(torch.relu(self.bn(self.conv1(x))))


@dataclass(frozen=True)
class Spec:
    conv: tuple[tuple[str, int], ...]  # (kind, output channels)
    linear: tuple[tuple[str, int], ...]  # (kind, output features)

    def build(self, seed: int) -> nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return self._build()

    def _build(self) -> nn.Module:
        layers: list[nn.Module] = []
        channels = 3
        for kind, width in self.conv:
            if kind == "conv":
                layers.append(nn.Conv2d(channels, width, 3, padding=1))
                channels = width
            elif kind == "bn":
                layers.append(nn.BatchNorm2d(channels))
            elif kind == "residual":
                layers.append(Residual(channels))
            else:
                layers.append(_activation(kind))
        layers += [nn.AdaptiveAvgPool2d(2), nn.Flatten()]
        features = channels * 4
        for kind, width in self.linear:
            if kind == "linear":
                layers.append(nn.Linear(features, width))
                features = width
            elif kind == "bn":
                layers.append(nn.BatchNorm1d(features))
            else:
                layers.append(_activation(kind))
        layers.append(nn.Linear(features, 5))
        model = nn.Sequential(*layers)
        with torch.no_grad():
            for module in model.modules():
                if isinstance(module, nn.modules.batchnorm._BatchNorm):
                    module.running_mean.uniform_(-0.5, 0.5)
                    module.running_var.uniform_(0.5, 2.0)
                    module.weight.uniform_(0.5, 1.5)
                    module.bias.uniform_(-0.2, 0.2)
        return model.eval()


def _activation(kind: str) -> nn.Module:
    return {"relu": nn.ReLU(), "gelu": nn.GELU(), "tanh": nn.Tanh(), "sigmoid": nn.Sigmoid()}[kind]


specs = st.builds(
    Spec,
    conv=st.lists(st.tuples(st.sampled_from(CONV_KINDS), st.integers(1, 6)), max_size=5).map(tuple),
    linear=st.lists(st.tuples(st.sampled_from(LINEAR_KINDS), st.integers(1, 8)), max_size=4).map(tuple),
)


def prunable(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if isinstance(m, (nn.Conv2d, nn.Linear))]


@st.composite
def plans(draw, model: nn.Module) -> dict[str, Any]:
    """Random keyword arguments for ``surgery.prune`` that are valid for ``model``."""
    names = prunable(model)
    has_conv = any(isinstance(m, nn.Conv2d) for m in model.modules())
    choices = [st.none(), st.just(nn.Linear), st.lists(st.sampled_from(names), min_size=1, unique=True),
               st.sampled_from(names).map(lambda n: "re:" + re.escape(n)),
               st.just(lambda module, name: isinstance(module, nn.Linear) or name.endswith("conv1"))]
    if has_conv:
        choices += [st.just("type:Conv2d"), st.just((nn.Conv2d, nn.Linear))]
    plan = {
        "amount": draw(st.one_of(st.sampled_from([0.0, 1.0, 0.5]), st.floats(0.0, 1.0))),
        "method": draw(st.sampled_from(["l1_unstructured", "random_unstructured", "ln_structured"])),
        "scope": draw(st.sampled_from(["layer", "global"])),
        "select": draw(st.one_of(choices)),
        "n": draw(st.sampled_from([1.0, 2.0, math.inf])),
        "dim": draw(st.sampled_from([0, 1, -1])),
        "seed": draw(st.integers(0, 1000)),
    }
    chosen = list(surgery.select(model, plan["select"] if plan["select"] is not None else (nn.Conv2d, nn.Linear)))
    chosen = [name for name in chosen if name in names]
    if len(chosen) > 1 and draw(st.booleans()):
        plan["exclude"] = draw(st.lists(st.sampled_from(chosen), min_size=1, max_size=len(chosen) - 1, unique=True))
    return plan


def inputs_for() -> list[torch.Tensor]:
    return [torch.randn(3, 3, 5, 5, generator=torch.Generator().manual_seed(0))]


def identical(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return max_difference(a, b)[0]


def hooks_on(model: nn.Module) -> int:
    return sum(module_hook_counts(model).values())


@SETTINGS
@given(spec=specs, data=st.data())
def test_identity_restore_and_bake_invariants(spec, data):
    model = spec.build(seed=0)
    plan = data.draw(plans(model), label="plan")
    inputs = inputs_for()
    expected = collect(model, inputs)
    before = snapshot(model)
    global_before = global_hook_counts()

    # identity: the same plan with amount 0 is bit-identical to the untouched model
    neutral = surgery.prune(model, **(plan | {"amount": 0.0}))
    assert identical(collect(model, inputs), expected)
    neutral.restore()
    assert snapshot_differences(before, snapshot(model)) == []

    # restore: parameters, buffers, keys, hooks and outputs come back bit for bit
    handle = surgery.prune(model, **plan)
    assert list(model.state_dict()) == before.keys
    assert 0.0 <= handle.sparsity() <= 1.0
    handle.restore()
    assert snapshot_differences(before, snapshot(model)) == []
    assert identical(collect(model, inputs), expected)

    # bake: baked == hooked, no hook left, strict load into a fresh instance reproduces it
    handle = surgery.prune(model, **plan)
    hooked = collect(model, inputs)
    masks = handle.masks()
    handle.bake()
    assert hooks_on(model) == 0
    assert identical(collect(model, inputs), hooked)
    params = dict(model.named_parameters())
    assert all(not params[name][~mask].any() for name, mask in masks.items())
    fresh = spec.build(seed=1)
    fresh.load_state_dict(model.state_dict(), strict=True)
    assert identical(collect(fresh, inputs), hooked)
    assert global_hook_counts() == global_before


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=specs, data=st.data())
def test_apply_and_restore_a_hundred_times_leaves_no_trace(spec, data):
    model = spec.build(seed=0)
    plan = data.draw(plans(model), label="plan")
    inputs = inputs_for()
    expected = collect(model, inputs)
    before = snapshot(model)
    global_before = global_hook_counts()
    first_masks = None
    for _ in range(100):
        handle = surgery.prune(model, **plan)
        masks = handle.masks()
        if first_masks is None:
            first_masks = masks
        assert masks.keys() == first_masks.keys()
        assert all(torch.equal(masks[k], first_masks[k]) for k in masks)  # deterministic every time
        handle.restore()
    assert snapshot_differences(before, snapshot(model)) == []
    assert hooks_on(model) == 0
    assert global_hook_counts() == global_before
    assert identical(collect(model, inputs), expected)
