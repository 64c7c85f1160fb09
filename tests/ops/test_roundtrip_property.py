"""Property-based round trips: random small models x random surgery plans keep every invariant.

A plan is a sequence of one to three steps in random order, each a ``surgery.prune``, a
``surgery.quantize`` (weights and/or activations, calibrated on seeded batches) or a
``surgery.rewrite_inputs`` with a built-in rewrite. Plans respect the documented constraints:
one transform of a kind per weight (so at most one prune step and one weight-quantizing step),
undo last-in-first-out per weight.
"""

from __future__ import annotations

import copy
import math
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from support import examples  # tests/support.py
from torch import nn

import surgery
from surgery.core.handles import Handle, HandleGroup
from surgery.ops.numerics.grid import OBSERVERS, WEIGHTED_OBSERVERS, GridSpec
from surgery.ops.rewrite.rewriting import Cast, ChannelsLast, Clamp, Identity, Normalize, Resize
from surgery.testing import (
    collect,
    global_hook_counts,
    max_difference,
    module_hook_counts,
    snapshot,
    snapshot_differences,
    transformed_parameters,
)

CONV_KINDS = ["conv", "conv", "bn", "relu", "gelu", "tanh", "residual", "shared"]
LINEAR_KINDS = ["linear", "linear", "bn", "relu", "tanh", "sigmoid", "shared"]
ACTIVATIONS = (nn.ReLU, nn.GELU, nn.Tanh, nn.Sigmoid)
SETTINGS = settings(max_examples=examples(3))
CALIBRATION = [
    torch.randn(4, 3, 5, 5, generator=torch.Generator().manual_seed(10)),
    torch.randn(2, 3, 5, 5, generator=torch.Generator().manual_seed(11)),
]


@pytest.fixture(autouse=True, scope="module")
def one_intra_op_thread():
    """The models are tiny: torch's intra-op threads only add waiting, which grows a hundredfold
    when other processes share the two cores (a 5x5 convolution then takes milliseconds)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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
        """``shared`` appends again the last block that keeps the width (a Residual, a square
        Linear), so one module sits at two places; if there is none, it appends a new one."""
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
            elif kind == "shared":
                layers.append(_last_keeping(layers, Residual, channels) or Residual(channels))
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
            elif kind == "shared":
                layers.append(_last_keeping(layers, nn.Linear, features) or nn.Linear(features, features))
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


def _last_keeping(layers: list[nn.Module], kind: type, width: int) -> nn.Module | None:
    """The last layer of ``kind`` whose input and output have ``width`` channels or features."""
    for layer in reversed(layers):
        if isinstance(layer, Residual) and kind is Residual and layer.bn.num_features == width:
            return layer
        if isinstance(layer, nn.Linear) and kind is nn.Linear and layer.in_features == layer.out_features == width:
            return layer
    return None


def _activation(kind: str) -> nn.Module:
    return {"relu": nn.ReLU(), "gelu": nn.GELU(), "tanh": nn.Tanh(), "sigmoid": nn.Sigmoid()}[kind]


specs = st.builds(
    Spec,
    conv=st.lists(st.tuples(st.sampled_from(CONV_KINDS), st.integers(1, 6)), max_size=5).map(tuple),
    linear=st.lists(st.tuples(st.sampled_from(LINEAR_KINDS), st.integers(1, 8)), max_size=4).map(tuple),
)


def prunable(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if isinstance(m, (nn.Conv2d, nn.Linear))]


# --------------------------------------------------------------------------- plans


@dataclass(frozen=True)
class Step:
    """One surgery verb with its settings; ``rewrites`` are applied one after the other."""

    kind: str  # "prune", "quantize" or "rewrite"
    kwargs: dict[str, Any] = field(default_factory=dict)
    rewrites: tuple = ()

    @property
    def quantizes_weights(self) -> bool:
        return self.kind == "quantize" and self.kwargs["weights"] is not None

    def apply(self, model: nn.Module, *, neutral: bool = False) -> Handle:
        """Apply the step; ``neutral`` uses the settings of the identity check (surgery/steps.py):
        amount 0, quantization off, identity rewrites."""
        if self.kind == "prune":
            return surgery.prune(model, **(self.kwargs | ({"amount": 0.0} if neutral else {})))
        if self.kind == "quantize":
            if neutral:
                return Handle("quantize", model)
            return surgery.quantize(model, calibration=CALIBRATION, progress=False, **self.kwargs)
        handles: list[Handle] = []
        try:
            for fn in self.rewrites:
                handles.append(surgery.rewrite_inputs(model, Identity() if neutral else fn, **self.kwargs))
        except BaseException:
            for handle in reversed(handles):
                handle.restore()
            raise
        return surgery.compose(*handles)


Plan = tuple[Step, ...]


@st.composite
def prune_settings(draw, model: nn.Module) -> dict[str, Any]:
    """Random keyword arguments for ``surgery.prune`` that are valid for ``model``."""
    names = prunable(model)
    has_conv = any(isinstance(m, nn.Conv2d) for m in model.modules())
    choices = [
        st.none(),
        st.just(nn.Linear),
        st.lists(st.sampled_from(names), min_size=1, unique=True),
        st.sampled_from(names).map(lambda n: "re:" + re.escape(n)),
        st.just(lambda module, name: isinstance(module, nn.Linear) or name.endswith("conv1")),
    ]
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


@st.composite
def quant_specs(draw) -> GridSpec:
    """A random grid. A weighted observer (imatrix_mse) is weights-only, per row, post-calibration:
    its refusals are tested beside it; here only the observers every grid accepts, full_range
    (symmetric by construction) on the affine grids it is defined for."""
    observer = draw(st.sampled_from([name for name in OBSERVERS.names() if name not in WEIGHTED_OBSERVERS]))
    return GridSpec(
        bits=draw(st.integers(2, 8)),
        symmetric=False if observer == "full_range" else draw(st.booleans()),
        per_channel=draw(st.booleans()),
        observer=observer,
        percentile=draw(st.sampled_from([90.0, 99.0, 99.99, 100.0])),
        averaging=draw(st.sampled_from([0.01, 0.3, 1.0])),
    )


@st.composite
def quantize_settings(draw, model: nn.Module, weights_allowed: bool, taken: set[tuple[str, str]]) -> dict | None:
    """Random keyword arguments for ``surgery.quantize``, or None if no valid step is left.

    Per-channel settings only select layers with a channel axis (Conv2d, Linear); per-tensor
    ones may also pick BatchNorm and activation modules, and the root. A layer's output (or
    input) already quantized by an earlier step (in ``taken``) is not quantized again: that
    is refused with ``AlreadyModifiedError``.
    """
    where = draw(st.sampled_from(["output", "input"]))
    weights = draw(st.none() | quant_specs()) if weights_allowed else None
    activations = draw(quant_specs()) if weights is None else draw(st.none() | quant_specs())
    per_channel = any(s is not None and s.per_channel for s in (weights, activations))
    kinds = (
        (nn.Conv2d, nn.Linear)
        if per_channel
        else (nn.Conv2d, nn.Linear, nn.modules.batchnorm._BatchNorm, *ACTIVATIONS, nn.Sequential)
    )  # Sequential: the root
    layers = [name for name, m in model.named_modules() if isinstance(m, kinds)]
    if activations is not None:
        free = [name for name in layers if (name, where) not in taken]
        if not free and weights is None:
            return None
        activations, layers = (activations, free) if free else (None, layers)
    if activations is None:  # weights only: a selection without any weight is refused (ConfigError)
        layers = [name for name in layers if model.get_submodule(name)._parameters.get("weight") is not None]
        if not layers:
            return None
    default_free = bool(prunable(model)) and (
        activations is None or not any((name, where) in taken for name in prunable(model))
    )
    select = draw(
        (st.none() if default_free else st.nothing())
        | st.lists(st.sampled_from(layers), min_size=1, max_size=4, unique=True)
    )
    return {"weights": weights, "activations": activations, "select": select, "where": where}


def activation_sites(model: nn.Module, step: Step) -> set[tuple[str, str]]:
    """(layer, "output"/"input") pairs whose activations ``step`` quantizes."""
    if step.kind != "quantize" or step.kwargs["activations"] is None:
        return set()
    chosen = surgery.select(model, step.kwargs["select"] or (nn.Conv2d, nn.Linear))
    return {(name, step.kwargs["where"]) for name in chosen}


ROOT_REWRITES = st.sampled_from(
    [
        (Identity(),),
        (Normalize((0.5, -0.25, 0.0), (0.5, 2.0, 1.5)),),
        (Normalize(0.1, 3.0),),
        (Clamp(-1.0, 0.5),),
        (Clamp(min=0.0),),
        (Cast(torch.float32),),
        (Cast(torch.float64), Cast(torch.float32)),
        (ChannelsLast(),),
        (Resize(3, mode="nearest"),),
        (Resize((7, 4), mode="bilinear"),),
        (Resize(6, mode="bicubic"),),
        (Resize(2, mode="area"),),
    ]
)
INNER_REWRITES = st.sampled_from(
    [
        (Identity(),),
        (Normalize(-0.2, 0.7),),
        (Clamp(-0.5, 0.5),),
        (Clamp(max=0.1),),
        (Cast(torch.float32),),
        (Cast(torch.float64), Cast(torch.float32)),
        (ChannelsLast(),),
    ]
)


@st.composite
def rewrite_step(draw, model: nn.Module) -> Step:
    """Built-in rewrites of the root's inputs or of a few submodules' inputs. A cast to float64
    is always followed by a cast back (the float32 layers refuse float64 inputs), which also
    checks that stacked rewrites run in the order they were attached. ``AddNoise`` is left
    out: its generator advances with every call, so re-attaching it after bake cannot
    reproduce the hooked outputs by design."""
    if draw(st.booleans()):
        return Step("rewrite", {"select": None}, draw(ROOT_REWRITES))
    names = [name for name, _ in model.named_modules() if name]
    select = draw(st.lists(st.sampled_from(names), min_size=1, max_size=3, unique=True))
    return Step("rewrite", {"select": select}, draw(INNER_REWRITES))


@st.composite
def plans(draw, model: nn.Module) -> Plan:
    """One to three steps in random order: at most one prune step and one weight-quantizing
    step (a weight takes one transform of each kind), activation quantization at most once
    per layer output or input; rewrites may repeat."""
    steps: list[Step] = []
    for _ in range(draw(st.integers(1, 3))):
        kinds = ["quantize", "rewrite"] + ([] if any(s.kind == "prune" for s in steps) else ["prune"])
        kind = draw(st.sampled_from(kinds))
        if kind == "prune":
            steps.append(Step("prune", draw(prune_settings(model))))
        elif kind == "quantize":
            weights_allowed = not any(s.quantizes_weights for s in steps)
            taken = set().union(*(activation_sites(model, s) for s in steps))
            settings = draw(quantize_settings(model, weights_allowed, taken))
            steps.append(Step("quantize", settings) if settings is not None else draw(rewrite_step(model)))
        else:
            steps.append(draw(rewrite_step(model)))
    return tuple(steps)


@st.composite
def stacked_plans(draw, model: nn.Module) -> Plan:
    """A prune step and a weight-quantizing step on the same default layers, in random order,
    with an optional third step: every weight carries two transforms."""
    prune_step = Step("prune", draw(prune_settings(model)) | {"select": None, "exclude": None})
    quantize_step = Step(
        "quantize", {"weights": draw(quant_specs()), "activations": None, "select": None, "where": "output"}
    )
    steps = draw(st.permutations([prune_step, quantize_step]))
    extra = draw(st.none() | rewrite_step(model))
    return tuple(steps) if extra is None else tuple(draw(st.permutations([*steps, extra])))


def apply_plan(model: nn.Module, plan: Plan, *, neutral: bool = False) -> HandleGroup:
    """Apply every step in order, all or nothing, as one handle (as surgery/steps.py does)."""
    handles: list[Handle] = []
    try:
        for step in plan:
            handles.append(step.apply(model, neutral=neutral))
    except BaseException:
        for handle in reversed(handles):
            handle.restore()
        raise
    return HandleGroup(handles, model)


def reattach(model: nn.Module, plan: Plan, qparams: list[dict | Path | None]) -> HandleGroup:
    """Re-attach what bake cannot fold into weights, in step order, as surgery/steps.py does:
    activation quantization from its saved parameters (a dict or a file; no calibration) and
    input rewrites."""
    handles: list[Handle] = []
    for step, saved in zip(plan, qparams):
        if step.kind == "quantize" and step.kwargs["activations"] is not None:
            handles.append(
                surgery.quantize(
                    model,
                    weights=None,
                    activations=step.kwargs["activations"],
                    select=step.kwargs["select"],
                    where=step.kwargs["where"],
                    qparams=saved,
                    progress=False,
                )
            )
        elif step.kind == "rewrite":
            handles.append(step.apply(model))
    return HandleGroup(handles, model)


# --------------------------------------------------------------------------- helpers


def inputs_for() -> list[torch.Tensor]:
    return [torch.randn(3, 3, 5, 5, generator=torch.Generator().manual_seed(0))]


def identical(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return max_difference(a, b)[0]


def hooks_on(model: nn.Module) -> int:
    return sum(module_hook_counts(model).values())


def guarded(model: nn.Module) -> list[str]:
    """Parameters of ``model`` still registered with surgery's tensor guards."""
    return transformed_parameters(model)


def transformed(handle: Handle) -> set[int]:
    """Ids of the parameters a prune or quantize handle transforms in place."""
    return {id(record.param) for record in handle.records}


def assert_as_before(model: nn.Module, before, inputs: list, expected: list[torch.Tensor]) -> None:
    assert snapshot_differences(before, snapshot(model)) == []
    assert identical(collect(model, inputs), expected)
    assert guarded(model) == []


# --------------------------------------------------------------------------- properties


@SETTINGS
@given(spec=specs, data=st.data())
def test_identity_restore_and_bake_invariants(spec, data):
    model = spec.build(seed=0)
    plan = data.draw(plans(model) | stacked_plans(model), label="plan")
    inputs = inputs_for()
    expected = collect(model, inputs)
    before = snapshot(model)
    global_before = global_hook_counts()

    # identity: the same plan with neutral settings is bit-identical to the untouched model
    neutral = apply_plan(model, plan, neutral=True)
    assert identical(collect(model, inputs), expected)
    neutral.restore()
    assert_as_before(model, before, inputs, expected)

    # restore: parameters, buffers, keys, classes, hooks and outputs come back bit for bit;
    # a deep copy taken while attached keeps computing what the hooked model computed
    handle = apply_plan(model, plan)
    assert list(model.state_dict()) == before.keys
    hooked = collect(model, inputs)
    copied = copy.deepcopy(model)
    handle.restore()
    assert_as_before(model, before, inputs, expected)
    assert identical(collect(copied, inputs), hooked)

    # bake: baked (+ re-attached activation quantization and rewrites) == hooked, bit for bit
    handle = apply_plan(model, plan)
    hooked = collect(model, inputs)
    qparams = [h.qparams() if isinstance(h, surgery.QuantizeHandle) else {} for h in handle.handles]
    folder = tempfile.TemporaryDirectory()
    files = [
        h.save_qparams(Path(folder.name) / f"{i}.qparams.safetensors")
        if isinstance(h, surgery.QuantizeHandle)
        else None
        for i, h in enumerate(handle.handles)
    ]
    masks = {k: v for h in handle.handles if isinstance(h, surgery.PruneHandle) for k, v in h.masks().items()}
    handle.bake()
    assert hooks_on(model) == 0 and guarded(model) == []
    handle.bake(), handle.restore()  # both harmless once baked
    params = dict(model.named_parameters())
    assert all(not params[name][~mask].any() for name, mask in masks.items())  # zeros stay zero, also on the grid
    extra = reattach(model, plan, qparams)
    assert identical(collect(model, inputs), hooked)
    extra.restore()
    assert hooks_on(model) == 0
    fresh = spec.build(seed=1)  # as the save_load check: a fresh instance, parameters from files
    fresh.load_state_dict(model.state_dict(), strict=True)
    with folder:
        extra = reattach(fresh, plan, files)
    assert identical(collect(fresh, inputs), hooked)
    extra.restore()
    assert hooks_on(fresh) == 0
    assert global_hook_counts() == global_before


@settings(max_examples=examples(1.5))
@given(spec=specs, data=st.data())
def test_out_of_order_restore_is_refused_or_exact(spec, data):
    """Restoring handles in any order: a handle with a later transform on one of its weights
    is refused and changes nothing; any other is undone; in the end the model is as before."""
    model = spec.build(seed=0)
    plan = data.draw(plans(model) | stacked_plans(model), label="plan")
    inputs = inputs_for()
    expected = collect(model, inputs)
    before = snapshot(model)
    handles = [step.apply(model) for step in plan]
    try:
        order = data.draw(st.permutations(range(len(handles))), label="restore order")
    except BaseException:  # hypothesis may abandon the example here: its handles hold global step hooks
        surgery.compose(*handles).restore()
        raise
    for i in order:
        later = set().union(*(transformed(h) for h in handles[i + 1 :] if h.state == "attached"))
        if transformed(handles[i]) & later:
            state, outputs = snapshot(model), collect(model, inputs)
            with pytest.raises(surgery.AlreadyModifiedError):
                handles[i].restore()
            assert handles[i].state == "attached"
            assert snapshot_differences(state, snapshot(model)) == []
            assert identical(collect(model, inputs), outputs)
        else:
            handles[i].restore()
    for handle in reversed(handles):
        handle.restore()
    assert_as_before(model, before, inputs, expected)


@settings(max_examples=examples(0.2))
@given(spec=specs, data=st.data())
def test_apply_and_restore_a_hundred_times_leaves_no_trace(spec, data):
    model = spec.build(seed=0)
    plan = data.draw(plans(model), label="plan")
    inputs = inputs_for()
    expected = collect(model, inputs)
    before = snapshot(model)
    global_before = global_hook_counts()
    first = None
    for _ in range(100):
        handle = apply_plan(model, plan)
        outputs = collect(model, inputs)
        first = outputs if first is None else first
        assert identical(outputs, first)  # deterministic every time
        handle.restore()
    assert_as_before(model, before, inputs, expected)
    assert hooks_on(model) == 0
    assert global_hook_counts() == global_before
