"""Rollback: a failure injected with ``mock.patch`` at the N-th internal call of every verb, of
``restore()``/``bake()``, of checkpoint loading, of a multi-step recipe, of a build under
``intercept`` and of a whole run leaves everything as it was (parameters, buffers, classes,
children, state_dict keys, per-module and global hook dicts), and a retry without the failure
succeeds.

Each test first runs the operation with every internal call counted, then fails it at call
1, 2, ..., last (for the recipe steps: at the first, middle and last call of each step), with
``RuntimeError`` and with ``KeyboardInterrupt``.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import importlib
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import pytest
import torch
from support import Passthrough  # tests/support.py
from torch import nn
from torch.utils.hooks import RemovableHandle

import surgery
from surgery.cli import checks
from surgery.cli import run as run_module
from surgery.cli.applying import apply_steps
from surgery.cli.config_loading import load_config
from surgery.cli.steps import STEPS, StepRun
from surgery.cli.steps import rewrite as rewrite_step
from surgery.core import guards
from surgery.core.checkpoints import load_checkpoint, save_checkpoint
from surgery.core.handles import Handle
from surgery.ops.build import rules
from surgery.ops.numerics.grid import GridSpec
from surgery.ops.numerics.observers import Observer
from surgery.ops.quantization import quantization
from surgery.ops.quantization.quantization import ActivationQuantizer, WeightQuantizer
from surgery.ops.rewrite.rewriting import Clamp
from surgery.ops.sparsity import pruning
from surgery.ops.sparsity.masks import MaskEnforcer
from surgery.testing import MODULE_HOOK_DICTS, Snapshot, collect, global_hook_counts, snapshot, snapshot_differences

intercept_module = importlib.import_module(
    "surgery.ops.build.intercept"
)  # surgery.ops.build.intercept is also the function
ERRORS = [RuntimeError, KeyboardInterrupt]
METHODS = ["l1_unstructured", "random_unstructured", "ln_structured"]
SCOPES = ["layer", "global"]
A8 = GridSpec(bits=8)


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """The models here are tiny: one intra-op thread avoids thread spin-up costs (10-100x on a
    loaded 2-core machine); the setting is put back after this module."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# --- the tripwire: count internal calls, fail at the N-th ------------------------------------


@dataclass(frozen=True)
class Target:
    """An internal call to count: ``owner.name``, a module function or a class attribute."""

    owner: object
    name: str
    after: bool = False  # fail once the real call has returned (its change is made), not before it


class Tripwire:
    """Counts the calls to all its targets, in order, and raises ``error`` at call ``fail_at``
    (``None``: only count). ``calls`` holds ``(target name, positional arguments)``."""

    def __init__(
        self, targets: list[Target], fail_at: int | None = None, error: type[BaseException] = RuntimeError
    ) -> None:
        self.targets, self.fail_at, self.error = targets, fail_at, error
        self.calls: list[tuple[str, tuple]] = []

    def _wrap(self, target: Target, real: Callable) -> Callable:
        def wrapper(*args, **kwargs):
            self.calls.append((target.name, args))
            number = len(self.calls)
            if number == self.fail_at and not target.after:
                raise self.error(f"injected failure before call {number} ({target.name})")
            result = real(*args, **kwargs)
            if number == self.fail_at:
                raise self.error(f"injected failure after call {number} ({target.name})")
            return result

        return wrapper

    @contextlib.contextmanager
    def armed(self) -> Iterator[Tripwire]:
        with contextlib.ExitStack() as stack:
            for target in self.targets:
                real = getattr(target.owner, target.name)
                stack.enter_context(mock.patch.object(target.owner, target.name, self._wrap(target, real)))
            yield self


def counted(targets: list[Target], action: Callable[[], object]) -> tuple[int, object]:
    """Run ``action`` with every target counted; return (number of calls, its result)."""
    with Tripwire(targets).armed() as wire:
        result = action()
    return len(wire.calls), result


# --- what must be as before ---------------------------------------------------------------------


@dataclass
class State:
    """Everything a failed call must leave as it was."""

    snapshot: Snapshot  # tensors bit for bit, state_dict keys, classes/children, hook counts
    hooks: dict[str, list]  # the entries of every per-module hook dict, in order
    identity: list  # the same Parameter/buffer objects, requires_grad and training flags


def state_of(model: nn.Module) -> State:
    hooks = {
        f"{name}:{kind}": list(getattr(module, kind).items())
        for name, module in model.named_modules()
        for kind in MODULE_HOOK_DICTS
    }
    identity = [(name, id(p), p.requires_grad) for name, p in model.named_parameters(remove_duplicate=False)]
    identity += [(name, id(b)) for name, b in model.named_buffers(remove_duplicate=False)]
    identity += [(name, m.training) for name, m in model.named_modules()]
    return State(snapshot(model), hooks, identity)


def assert_unchanged(model: nn.Module, before: State, where: str) -> None:
    after = state_of(model)
    assert snapshot_differences(before.snapshot, after.snapshot) == [], where
    assert after.hooks == before.hooks, where
    assert after.identity == before.identity, where


def assert_outputs(model: nn.Module, x: torch.Tensor, expected: list[torch.Tensor], where: str) -> None:
    got = collect(model, [x])
    assert len(got) == len(expected) and all(torch.equal(a, b) for a, b in zip(got, expected)), where


def fail_at_every_call(
    model: nn.Module,
    x: torch.Tensor,
    apply: Callable[[], Handle],
    targets: list[Target],
    error: type[BaseException],
    *,
    minimum: int = 3,
) -> int:
    """Fail ``apply`` at each of its internal calls in turn: each time the model must be exactly
    as before and work; then a retry succeeds, equals a clean run and restores exactly."""
    before, expected = state_of(model), collect(model, [x])
    total, handle = counted(targets, apply)
    applied = collect(model, [x])
    handle.restore()
    assert_unchanged(model, before, "a clean apply then restore")
    assert total >= minimum, f"only {total} internal calls counted"
    for n in range(1, total + 1):
        with Tripwire(targets, n, error).armed() as wire, pytest.raises(error, match="injected failure"):
            apply()
        where = f"failure at call {n} of {total} ({wire.calls[n - 1][0]})"
        assert_unchanged(model, before, where)
        assert_outputs(model, x, expected, where)
    retried = apply()  # nothing was left claimed by the failed attempts
    assert_outputs(model, x, applied, "the retry")
    retried.restore()
    assert_unchanged(model, before, "the retry, restored")
    return total


# --- every verb -------------------------------------------------------------------------------------


PRUNE_CALLS = [
    Target(pruning, "masks_from_scores"),
    Target(Handle, "add", after=True),
    Target(guards, "attach", after=True),
    Target(MaskEnforcer, "apply", after=True),
    Target(nn.Module, "register_forward_pre_hook"),
]
WEIGHT_CALLS = [
    Target(Observer, "observe"),
    Target(Handle, "add", after=True),
    Target(guards, "attach", after=True),
    Target(WeightQuantizer, "apply", after=True),
    Target(nn.Module, "register_forward_pre_hook"),
]
ACTIVATION_CALLS = [
    Target(Handle, "add", after=True),
    Target(nn.Module, "register_forward_pre_hook"),
    Target(nn.Module, "register_forward_hook"),
    Target(ActivationQuantizer, "__call__", after=True),
    Target(ActivationQuantizer, "freeze", after=True),
]


@pytest.mark.parametrize("error", ERRORS)
@pytest.mark.parametrize("scope", SCOPES)
@pytest.mark.parametrize("method", METHODS)
def test_prune(convnet, image_input, method, scope, error):
    fail_at_every_call(
        convnet, image_input, lambda: surgery.prune(convnet, 0.5, method=method, scope=scope), PRUNE_CALLS, error
    )


@pytest.mark.parametrize("error", ERRORS)
def test_prune_over_an_attached_quantization_refuses_without_changing_it(convnet, image_input, error):
    with surgery.quantize(convnet, select="conv2", progress=False):
        fail_at_every_call(
            convnet, image_input, lambda: surgery.prune(convnet, 0.5, select=["conv1", "fc"]), PRUNE_CALLS, error
        )


@pytest.mark.parametrize("error", ERRORS)
def test_quantize_weights(convnet, image_input, error):
    fail_at_every_call(convnet, image_input, lambda: surgery.quantize(convnet, progress=False), WEIGHT_CALLS, error)


@pytest.mark.parametrize("error", ERRORS)
@pytest.mark.parametrize("where", ["output", "input"])
def test_quantize_activations_with_calibration(convnet, image_input, where, error):
    calibration = [image_input, image_input * 2]
    fail_at_every_call(
        convnet,
        image_input,
        lambda: surgery.quantize(convnet, activations=A8, where=where, calibration=calibration, progress=False),
        WEIGHT_CALLS + ACTIVATION_CALLS,
        error,
    )


@pytest.mark.parametrize("error", ERRORS)
def test_quantize_activations_from_saved_qparams(convnet, image_input, tmp_path, error):
    with surgery.quantize(convnet, weights=None, activations=A8, calibration=[image_input], progress=False) as h:
        path = h.save_qparams(tmp_path / "model.qparams.safetensors")
    fail_at_every_call(
        convnet,
        image_input,
        lambda: surgery.quantize(convnet, weights=None, activations=A8, qparams=path, progress=False),
        [Target(quantization, "load_qparams"), *ACTIVATION_CALLS],
        error,
    )


@pytest.mark.parametrize("error", ERRORS)
@pytest.mark.parametrize("recorded", [False, True], ids=["before-recording", "after-recording"])
@pytest.mark.parametrize("select", [None, "type:Conv2d", ["conv1", "bn1", "fc"]], ids=["root", "type", "names"])
def test_rewrite_inputs(convnet, image_input, select, recorded, error):
    targets = [Target(nn.Module, "register_forward_pre_hook"), Target(Handle, "add", after=recorded)]
    fail_at_every_call(
        convnet,
        image_input,
        lambda: surgery.rewrite_inputs(convnet, Clamp(min=-1.0, max=1.0), select=select),
        targets,
        error,
        minimum=2,
    )


@pytest.mark.parametrize("error", ERRORS)
def test_compose_failing_leaves_every_handle_attached_and_restorable(convnet, image_input, error):
    before, expected = state_of(convnet), collect(convnet, [image_input])
    pruned = surgery.prune(convnet, 0.5)
    quantized = surgery.quantize(convnet, progress=False)
    rewritten = surgery.rewrite_inputs(convnet, Clamp(min=-1.0, max=1.0))
    during, hooked = state_of(convnet), collect(convnet, [image_input])
    targets = [Target(Handle, "__init__", after=True), Target(Handle, "add", after=True)]
    total, _ = counted(targets, lambda: surgery.compose(pruned, quantized, rewritten))
    assert total == 4
    for n in range(1, total + 1):
        with Tripwire(targets, n, error).armed(), pytest.raises(error, match="injected failure"):
            surgery.compose(pruned, quantized, rewritten)
        assert_unchanged(convnet, during, f"compose failing at call {n}")
        assert_outputs(convnet, image_input, hooked, f"compose failing at call {n}")
        assert [h.state for h in (pruned, quantized, rewritten)] == ["attached"] * 3
    surgery.compose(pruned, quantized, rewritten).restore()
    assert_unchanged(convnet, before, "the composed handles, restored")
    assert_outputs(convnet, image_input, expected, "the composed handles, restored")


# --- restore(): every other undo step still runs, failures are reported together ----------------


UNDO_CALLS = [Target(guards, "detach"), Target(RemovableHandle, "remove")]


def attach_side_by_side(model: nn.Module, x: torch.Tensor) -> Handle:
    """Prune, weight+activation quantization and an input rewrite on disjoint layers, composed."""
    return surgery.compose(
        surgery.prune(model, 0.5, select="conv1"),
        surgery.quantize(model, activations=A8, calibration=[x], select=["conv2", "fc"], progress=False),
        surgery.rewrite_inputs(model, Clamp(min=-1.0, max=1.0), select=["bn1", "fc"]),
    )


def attach_stacked(model: nn.Module, x: torch.Tensor) -> Handle:
    """Prune, then quantize the same weights (and activations), then an input rewrite, composed."""
    return surgery.compose(
        surgery.prune(model, 0.5),
        surgery.quantize(model, activations=A8, calibration=[x], progress=False),
        surgery.rewrite_inputs(model, Clamp(min=-1.0, max=1.0), select="type:Conv2d"),
    )


def remove_leftover_step_hooks() -> None:
    from torch.optim import optimizer

    for key, hook in list(optimizer._global_optimizer_post_hooks.items()):
        if isinstance(hook, guards.StepEnforcer):
            del optimizer._global_optimizer_post_hooks[key]


def leftover_of(call: tuple[str, tuple]) -> Callable[[str], bool]:
    """Which snapshot differences the failed undo call may leave: its parameter, or its hook."""
    name, args = call
    if name == "detach":
        return lambda diff: diff == f"tensor param:{args[2]} changed"
    return lambda diff: diff.startswith(("hooks ", "global "))  # a module hook, or the optimizer step hook


@pytest.mark.parametrize("error", ERRORS)
def test_restore_failing_at_any_step_still_runs_every_other_step(convnet_factory, image_input, error):
    model = convnet_factory()
    before = state_of(model)
    total, _ = counted(UNDO_CALLS, attach_side_by_side(model, image_input).restore)  # restore's calls only
    assert_unchanged(model, before, "a clean restore")
    assert total >= 8
    for n in range(1, total + 1):
        model = convnet_factory()
        handle = attach_side_by_side(model, image_input)
        expected_error = surgery.UndoError if error is RuntimeError else KeyboardInterrupt
        with Tripwire(UNDO_CALLS, n, error).armed() as wire, pytest.raises(expected_error) as info:
            handle.restore()
        where = f"restore failing at call {n} of {total} ({wire.calls[n - 1][0]})"
        assert len(wire.calls) == total, where  # every other undo step ran
        if error is RuntimeError:
            assert [str(f) for f in info.value.failures] == [
                f"injected failure before call {n} ({wire.calls[n - 1][0]})"
            ]
        assert handle.state == "restored" and [h.state for h in handle.handles] == ["restored"] * 3, where
        diffs = snapshot_differences(before.snapshot, snapshot(model))
        allowed = leftover_of(wire.calls[n - 1])
        assert diffs and all(allowed(d) for d in diffs), f"{where}: {diffs}"
        assert len({d.split(":")[0] for d in diffs}) == 1, f"{where}: more than the failed step is left: {diffs}"
        model(image_input)  # still runs
        handle.restore()  # idempotent: the failed step is reported once, not retried
        remove_leftover_step_hooks()  # a global hook whose injected removal failed would outlive the model


@pytest.mark.parametrize("error", ERRORS)
def test_restore_reports_an_out_of_order_refusal_and_keeps_going(convnet_factory, image_input, error):
    """Stacked: a failure restoring quantization of a weight makes the prune handle refuse its
    restore (undo out of order), without changing anything; everything else is restored."""
    model = convnet_factory()
    before = state_of(model)
    handle = attach_stacked(model, image_input)
    fail_first_detach = Tripwire([Target(guards, "detach")], 1, error)
    expected_error = surgery.UndoError if error is RuntimeError else KeyboardInterrupt
    with fail_first_detach.armed(), pytest.raises(expected_error):
        handle.restore()
    pruned, quantized, rewritten = handle.handles
    assert (pruned.state, quantized.state, rewritten.state) == ("attached", "restored", "restored")
    stuck = fail_first_detach.calls[0][1][2]
    diffs = snapshot_differences(before.snapshot, snapshot(model))
    assert f"tensor param:{stuck} changed" in diffs
    assert [d for d in diffs if d.startswith("global")] == ["global _global_optimizer_post_hooks: 0 -> 1"]  # prune's
    param = model.get_parameter(stuck)  # recover by hand: drop the quantizer left on top, then prune restores
    guards.detach(param, guards.transforms_of(param)[-1], stuck)
    pruned.restore()
    assert not any(d.startswith("global") for d in snapshot_differences(before.snapshot, snapshot(model)))


# --- bake(): all or nothing, hooked-and-correct after a failure -------------------------------------


BAKE_CALLS = [Target(guards, "detach", after=True), Target(RemovableHandle, "remove", after=True)]


@pytest.mark.parametrize("attach", [attach_side_by_side, attach_stacked], ids=["side-by-side", "stacked"])
@pytest.mark.parametrize("error", ERRORS)
def test_bake_failing_at_any_step_leaves_the_model_hooked_and_correct(
    convnet, convnet_factory, image_input, attach, error
):
    total, _ = counted(BAKE_CALLS, attach(convnet_factory(), image_input).bake)
    assert total >= 8
    before, expected = state_of(convnet), collect(convnet, [image_input])
    handle = attach(convnet, image_input)
    hooked = collect(convnet, [image_input])
    handle.restore()
    for n in range(1, total + 1):
        handle = attach(convnet, image_input)
        during = state_of(convnet)
        with Tripwire(BAKE_CALLS, n, error).armed() as wire, pytest.raises(error, match="injected failure"):
            handle.bake()
        where = f"bake failing at call {n} of {total} ({wire.calls[n - 1][0]})"
        assert handle.state == "attached" and all(h.state == "attached" for h in handle.handles), where
        assert_unchanged(convnet, during, where)
        assert_outputs(convnet, image_input, hooked, where)
        handle.restore()  # the originals are still there
        assert_unchanged(convnet, before, f"{where}, then restored")
        assert_outputs(convnet, image_input, expected, f"{where}, then restored")
    handle = attach(convnet, image_input)
    handle.bake()  # the retry
    assert sum(checks.module_hook_counts(convnet).values()) == 0
    assert all(torch.equal(during.snapshot.tensors[k], v) for k, v in snapshot(convnet).tensors.items())
    surgery.prune(convnet, 0.3).restore()  # baking released every claim
    surgery.quantize(convnet, progress=False).restore()


def test_bake_out_of_order_is_refused_before_anything_changes(convnet, image_input):
    pruned = surgery.prune(convnet, 0.5)
    quantized = surgery.quantize(convnet, progress=False)
    during, hooked = state_of(convnet), collect(convnet, [image_input])
    with pytest.raises(surgery.AlreadyModifiedError, match="quantize"):
        pruned.bake()
    assert pruned.state == "attached"
    assert_unchanged(convnet, during, "refused bake")
    assert_outputs(convnet, image_input, hooked, "refused bake")
    surgery.compose(pruned, quantized).bake()
    assert_outputs(convnet, image_input, hooked, "baked in order")


@pytest.mark.parametrize("quantized", [False, True], ids=["prune", "prune+quantize"])
def test_bake_keeps_the_change_even_if_the_weight_changed_since_the_last_forward(convnet, image_input, quantized):
    """An optimizer step after the last forward revives pruned entries behind the hooks: the
    baked weights must be what the hooks would have enforced on the next forward."""
    handles = [surgery.prune(convnet, 0.5)]
    if quantized:
        handles.append(surgery.quantize(convnet, weights=GridSpec(bits=4, symmetric=True), progress=False))
    masks = handles[0].masks()
    with torch.no_grad():
        for name in masks:
            convnet.get_parameter(name).add_(0.01)  # no forward since
    expected = {name: guards.current_value(convnet.get_parameter(name)).clone() for name in masks}
    surgery.compose(*handles).bake()
    for name, mask in masks.items():
        weight = convnet.get_parameter(name).detach()
        assert not weight[~mask].any(), name
        assert torch.equal(weight, expected[name]), name


# --- checkpoint loading -----------------------------------------------------------------------------


@pytest.mark.parametrize("error", ERRORS)
@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_load_checkpoint(convnet, convnet_factory, image_input, tmp_path, suffix, error):
    other = convnet_factory(seed=3)
    path = save_checkpoint(other, tmp_path / f"other{suffix}")
    targets = [Target(nn.Module, "_load_from_state_dict", after=True)]
    total, _ = counted(targets, lambda: load_checkpoint(convnet_factory(seed=5), path))
    before, expected = state_of(convnet), collect(convnet, [image_input])
    assert total == len(list(convnet.modules()))
    for n in range(1, total + 1):
        with Tripwire(targets, n, error).armed(), pytest.raises(error, match="injected failure"):
            load_checkpoint(convnet, path)
        assert_unchanged(convnet, before, f"load failing at module {n} of {total}")
        assert_outputs(convnet, image_input, expected, f"load failing at module {n} of {total}")
    load_checkpoint(convnet, path)
    assert_outputs(convnet, image_input, collect(other, [image_input]), "the retry")


# --- a multi-step recipe: prune -> quantize -> rewrite ------------------------------------------


STEP_CALLS = [
    Target(Handle, "add", after=True),
    Target(guards, "attach", after=True),
    Target(nn.Module, "register_forward_pre_hook"),
    Target(nn.Module, "register_forward_hook"),
    Target(ActivationQuantizer, "freeze", after=True),
]


def quantize_batches(config, batches):
    return {"quantize": StepRun(config, calibration=batches)}


def three_steps():
    return load_config(
        {
            "recipe": "rollback",
            "model": {"source": "digits_cnn", "name": "digits_cnn"},
            "steps": ["prune", "quantize", "rewrite"],
            "prune": {"amount": 0.5},
            "quantize": {"activations": {"bits": 8}},
            "rewrite": {"name": "clamp", "kwargs": {"min": -1.0, "max": 1.0}, "select": ["conv1", "fc"]},
        }
    )


@pytest.mark.parametrize("error", ERRORS)
@pytest.mark.parametrize("position", ["first", "middle", "last"])
@pytest.mark.parametrize("step", ["prune", "quantize", "rewrite"])
def test_apply_steps(convnet, image_input, step, position, error):
    config = three_steps()
    calibration = [image_input]
    bounds: dict[str, tuple[int, int]] = {}
    wire = Tripwire(STEP_CALLS)

    def marking(kind: str, applier: Callable) -> Callable:
        def apply(*args):
            start = len(wire.calls) + 1
            handle = applier(*args)
            bounds[kind] = (start, len(wire.calls))
            return handle

        return apply

    marked = [mock.patch.object(STEPS.get(k), "apply", marking(k, STEPS.get(k).apply)) for k in config.steps]

    before, expected = state_of(convnet), collect(convnet, [image_input])
    with contextlib.ExitStack() as patches, wire.armed():
        for patch in marked:
            patches.enter_context(patch)
        handle = apply_steps(convnet, config, runs=quantize_batches(config, calibration))
    applied = collect(convnet, [image_input])
    handle.restore()
    first, last = bounds[step]
    assert last > first, bounds
    fail_at = {"first": first, "middle": (first + last) // 2, "last": last}[position]
    with Tripwire(STEP_CALLS, fail_at, error).armed() as failing, pytest.raises(error, match="injected failure"):
        apply_steps(convnet, config, runs=quantize_batches(config, calibration))
    where = f"{step} failing at call {fail_at} ({failing.calls[fail_at - 1][0]}), steps at {bounds}"
    assert_unchanged(convnet, before, where)
    assert_outputs(convnet, image_input, expected, where)
    retried = apply_steps(convnet, config, runs=quantize_batches(config, calibration))
    assert_outputs(convnet, image_input, applied, "the retry")
    retried.restore()
    assert_unchanged(convnet, before, "the retry, restored")


def test_apply_steps_rollback_keeps_going_past_an_undo_failure(convnet, image_input):
    """The rewrite step fails; undoing the quantize step then fails once: the prune step and
    the rest of quantize are still undone, and the caller sees the step failure (the real
    cause) with the undo failure as a note on it."""
    before = state_of(convnet)
    applied: list[int] = []  # hooks removed while applying (calibration's capture), before the failure

    def failing_rewrite(*args, **kwargs):
        applied.append(len(wire.calls))
        raise RuntimeError("step failed")

    with (
        mock.patch.object(rewrite_step, "rewrite_inputs", side_effect=failing_rewrite),
        Tripwire([Target(RemovableHandle, "remove")]).armed() as wire,
        pytest.raises(RuntimeError),
    ):
        apply_steps(copy.deepcopy(convnet), three_steps(), runs=quantize_batches(three_steps(), [image_input]))
    first_undo = applied[0] + 1  # the first hook removal of the rollback
    with (
        mock.patch.object(rewrite_step, "rewrite_inputs", side_effect=RuntimeError("step failed")),
        Tripwire([Target(RemovableHandle, "remove")], first_undo).armed() as wire,
    ):
        with pytest.raises(RuntimeError, match="step failed") as info:
            apply_steps(convnet, three_steps(), runs=quantize_batches(three_steps(), [image_input]))
    assert not isinstance(info.value, surgery.UndoError)
    assert len(info.value.__notes__) == 1 and "undoing the partial change also failed" in info.value.__notes__[0]
    stuck = wire.calls[first_undo - 1][1][0]
    stuck.remove()  # the one hook whose removal failed
    assert_unchanged(convnet, before, "after the rollback")


# --- intercept: a rule failing halfway through a build -------------------------------------------


def build() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 8), nn.ReLU()), nn.Linear(8, 2))


class Bomb:
    """Wraps rule actions: counts their calls, raises at call ``fail_at``, and keeps weak
    references to everything the build handed to a rule."""

    def __init__(self, fail_at: int | None = None, error: type[BaseException] = RuntimeError) -> None:
        self.fail_at, self.error, self.calls = fail_at, error, 0
        self.seen: list[weakref.ref] = []

    def __call__(self, action: Callable) -> Callable:
        def wrapped(value):
            self.calls += 1
            self.seen.append(weakref.ref(value))
            if self.calls == self.fail_at:
                raise self.error("injected failure")
            return action(value)

        return wrapped

    def rules(self) -> list[rules.Rule]:
        return [
            rules.swap(nn.ReLU, self(lambda old: nn.SiLU())),
            rules.wrap(nn.Linear, self(Passthrough)),
            rules.on_parameter("bias", self(lambda t: t.detach() * 0.5)),
        ]


def intercept_idle() -> bool:
    registry = intercept_module._registry
    return registry.count == 0 and registry.handles == [] and registry.stack() == [] and not registry.busy.get()


@pytest.mark.parametrize("error", ERRORS)
def test_intercept_rule_failing_halfway_through_a_build(error):
    hooks = global_hook_counts()
    counting = Bomb()
    with surgery.intercept(*counting.rules()) as log:
        build()
    total = counting.calls
    assert total == 8 and len(log) == 8  # 3 biases, 3 Linear wraps, 2 ReLU swaps
    expected_error = surgery.InterceptError if error is RuntimeError else KeyboardInterrupt
    for n in range(1, total + 1):
        bomb = Bomb(n, error)
        raised = None
        try:
            with surgery.intercept(*bomb.rules()):
                build()
        except BaseException as err:  # noqa: BLE001 - keep no traceback (it would hold the half-built model)
            raised = type(err)
        assert raised is expected_error, n
        if any(ref() is not None for ref in bomb.seen):
            gc.collect()  # only reference cycles left: collectable
        alive = [ref() for ref in bomb.seen if ref() is not None]
        assert not alive, f"failure at rule call {n}: the half-built model is still referenced: {alive[:2]}"
        assert global_hook_counts() == hooks and intercept_idle(), n
    plain = build()
    assert isinstance(plain[1], nn.ReLU) and isinstance(plain[0], nn.Linear)
    with surgery.intercept(*Bomb().rules()):
        model = build()
    assert isinstance(model[1], nn.SiLU) and isinstance(model[0], Passthrough)


@pytest.mark.parametrize("error", ERRORS)
def test_intercept_inner_block_failing_leaves_the_outer_block_working(error):
    hooks = global_hook_counts()
    outer = rules.swap(nn.Tanh, lambda old: nn.Identity())
    with surgery.intercept(outer) as log:
        with contextlib.suppress(surgery.InterceptError, KeyboardInterrupt):
            with surgery.intercept(*Bomb(2, error).rules()):
                build()
        assert intercept_module._registry.count == 1 and len(intercept_module._registry.stack()) == 1
        after = nn.Sequential(nn.Tanh(), nn.ReLU())
    assert isinstance(after[0], nn.Identity) and isinstance(after[1], nn.ReLU)
    assert [e.name for e in log] == ["0"]
    assert global_hook_counts() == hooks and intercept_idle()


# --- the run pipeline -------------------------------------------------------------------------------


RUN_CALLS = [
    Target(run_module, "_build", after=True),
    Target(run_module, "apply_steps", after=True),
    Target(run_module, "compare", after=True),
    Target(checks, "check_identity", after=True),
    Target(checks, "check_restore", after=True),
    Target(checks, "check_bake", after=True),
    Target(run_module, "save_checkpoint", after=True),
    Target(run_module, "save_tensors", after=True),
    Target(checks, "check_save_load", after=True),
    Target(checks, "check_drift", after=True),
    Target(run_module, "write_reports", after=True),
]


def pipeline_config(**output):
    return load_config(
        {
            "recipe": "rollback",
            "model": {"source": "digits_cnn", "name": "digits_cnn", "weights": None, "num_classes": 10},
            "data": {"kind": "synthetic", "batch_size": 2, "batches": 1, "channels": 1, "image_size": 8},
            "steps": ["prune", "quantize", "rewrite"],
            "prune": {"amount": 0.5},
            "quantize": {"activations": {"bits": 8}, "calibration_batches": 1},
            "rewrite": {"name": "clamp", "kwargs": {"min": -2.0, "max": 2.0}},
            "output": {"plots": False, **output},
        }
    )


def listing(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else b"<dir>" for p in sorted(folder.rglob("*"))}


def test_run_failing_at_every_stage_writes_nothing_and_reruns(tmp_path):
    config = pipeline_config()
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine\n")
    before, hooks = listing(out), global_hook_counts()
    total, _ = counted(RUN_CALLS, lambda: run_module.run(config, tmp_path / "count", echo=False))
    assert total >= len(RUN_CALLS)
    for error in ERRORS:
        for n in range(1, total + 1):
            with Tripwire(RUN_CALLS, n, error).armed() as wire, pytest.raises(error, match="injected failure"):
                run_module.run(config, out, echo=False)
            where = f"{error.__name__} after stage {n} of {total} ({wire.calls[n - 1][0]})"
            assert listing(out) == before, where
            assert global_hook_counts() == hooks and intercept_idle(), where
    result = run_module.run(config, out, echo=False)
    assert result.exit_code == 0
    assert sorted(listing(out)) == [
        "model.qparams.safetensors",
        "model.safetensors",
        "notes.txt",
        "report.json",
        "report.md",
    ]
