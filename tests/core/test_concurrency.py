"""Concurrency: surgery, build-time interception and inspection in one thread leave other threads alone.

Worker threads meet at a ``threading.Barrier`` before every round so that their work really
overlaps, with a short interpreter switch interval so that they interleave finely. Models,
inputs and calibration batches are made in the main thread beforehand: torch's global random
generator is shared by all threads, so seeding it inside two threads at once would race.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import sys
import threading
from collections.abc import Callable, Iterator

import pytest
import torch
from support import Passthrough  # tests/support.py
from torch import Tensor, nn

import surgery
from surgery.analysis.inspection import ModuleCall, inspect_model
from surgery.core.errors import ConfigError
from surgery.ops.build import rules
from surgery.ops.numerics.grid import GridSpec
from surgery.ops.rewrite.rewriting import Normalize
from surgery.testing import (
    collect,
    global_hook_counts,
    module_hook_counts,
    snapshot,
    snapshot_differences,
    transformed_parameters,
)

ROUNDS = 40


def own_differences(before, after) -> list[str]:
    """Snapshot differences of one model, leaving out torch's global registries: other threads'
    handles hold global optimizer step hooks meanwhile (the end state is checked by conftest)."""
    return [d for d in snapshot_differences(before, after) if not d.startswith("global ")]


Worker = Callable[[threading.Barrier], None]


@pytest.fixture(autouse=True)
def fine_switching() -> Iterator[None]:
    """Switch between Python threads every 10 µs instead of every 5 ms while the test runs."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    yield
    sys.setswitchinterval(interval)


def run_in_threads(*workers: Worker, timeout: float = 120.0) -> None:
    """Run each worker in its own thread, all sharing one barrier; re-raise the first error.

    A failing worker breaks the barrier so that the others stop waiting for it; their
    ``BrokenBarrierError`` is only re-raised if nothing else went wrong.
    """
    barrier = threading.Barrier(len(workers), timeout=timeout)
    errors: list[BaseException] = []

    def run(worker: Worker) -> None:
        try:
            worker(barrier)
        except BaseException as err:  # noqa: BLE001 - collected, re-raised in the test's thread
            errors.append(err)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(worker,), daemon=True) for worker in workers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
    assert not any(thread.is_alive() for thread in threads), "a worker thread did not finish"
    real = [err for err in errors if not isinstance(err, threading.BrokenBarrierError)]
    if real or errors:
        raise (real or errors)[0]


def registration_hooks() -> int:
    counts = global_hook_counts()
    return sum(count for name, count in counts.items() if "registration" in name)


def same(a: list[Tensor], b: list[Tensor]) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b))


def guarded(model: nn.Module) -> list[str]:
    return transformed_parameters(model)


# --------------------------------------------------------------------------- runtime surgery


def surgery_round(model: nn.Module, inputs: list[Tensor], calibration: list[Tensor]) -> list[Tensor]:
    """Prune, quantize (calibrated, with a progress bar), rewrite, compose and restore on
    ``model``; then the same on a copy, baked. Returns the outputs after every stage."""
    outputs: list[Tensor] = []
    pruned = surgery.prune(model, 0.5)
    outputs += collect(model, inputs)
    quantized = surgery.quantize(
        model,
        weights=GridSpec(bits=4, symmetric=True, per_channel=True),
        activations=GridSpec(bits=6, observer="moving_average", averaging=0.5),
        calibration=calibration,
    )
    outputs += collect(model, inputs)
    rewritten = surgery.rewrite_inputs(model, Normalize(0.1, 2.0))
    outputs += collect(model, inputs)
    surgery.compose(pruned, quantized, rewritten).restore()
    outputs += collect(model, inputs)
    baked = copy.deepcopy(model)
    with surgery.compose(
        surgery.prune(baked, 0.3, method="ln_structured"),
        surgery.quantize(baked, weights=GridSpec(bits=3), calibration=calibration),
    ) as handle:
        outputs += collect(baked, inputs)
        handle.bake()
    assert not any(module_hook_counts(baked).values()) and guarded(baked) == []
    return outputs + collect(baked, inputs)


def surgery_worker(model: nn.Module, inputs: list[Tensor], calibration: list[Tensor], expected: list[Tensor]) -> Worker:
    """Round after round, the outputs equal those of the same round run alone, and restore
    leaves the model bit-identical."""
    before = snapshot(model)

    def work(barrier: threading.Barrier) -> None:
        for round_ in range(ROUNDS):
            barrier.wait()
            assert same(surgery_round(model, inputs, calibration), expected), f"round {round_}: other outputs"
            assert own_differences(before, snapshot(model)) == [], f"round {round_}: not restored"

    return work


def test_surgery_on_models_in_parallel_threads_matches_running_it_alone(
    convnet_factory, mlp_factory, image_input, mlp_input
):
    generator = torch.Generator().manual_seed(3)
    jobs = [
        (convnet_factory(0), [image_input], [torch.randn(4, 3, 12, 12, generator=generator) for _ in range(2)]),
        (convnet_factory(0), [image_input], [torch.randn(4, 3, 12, 12, generator=generator) for _ in range(2)]),
        (mlp_factory(1), [mlp_input], [torch.randn(8, 8, generator=generator) for _ in range(2)]),
    ]
    expected = [surgery_round(copy.deepcopy(model), inputs, calibration) for model, inputs, calibration in jobs]
    assert not same(expected[0], expected[1])  # same architecture and names, different calibration
    originals = [copy.deepcopy(model) for model, _, _ in jobs]

    run_in_threads(*(surgery_worker(*job, out) for job, out in zip(jobs, expected)))

    for (model, inputs, _), original in zip(jobs, originals):
        assert snapshot_differences(snapshot(original), snapshot(model)) == []
        assert same(collect(model, inputs), collect(original, inputs))
        assert not any(module_hook_counts(model).values()) and guarded(model) == []
    assert not any(global_hook_counts().values())


def test_a_failing_quantize_in_one_thread_rolls_back_only_its_own_model(
    convnet_factory, mlp_factory, image_input, mlp_input
):
    failing, busy = convnet_factory(0), mlp_factory(0)
    failing_before, busy_before = snapshot(failing), snapshot(busy)
    calibration = [torch.randn(4, 8, generator=torch.Generator().manual_seed(4))]
    expected = surgery_round(copy.deepcopy(busy), [mlp_input], calibration)
    poisoned = [torch.randn(2, 3, 12, 12), torch.full((2, 3, 12, 12), float("nan"))]

    def fail(barrier: threading.Barrier) -> None:
        for round_ in range(ROUNDS):
            barrier.wait()
            pruned = surgery.prune(failing, 0.5)
            try:
                if round_ == ROUNDS - 1:  # the last time, the error is left to reach the test
                    surgery.quantize(failing, activations=GridSpec(), calibration=poisoned)
                with pytest.raises(ConfigError, match="NaN"):
                    surgery.quantize(failing, activations=GridSpec(), calibration=poisoned)
            finally:
                pruned.restore()
            assert own_differences(failing_before, snapshot(failing)) == []

    with pytest.raises(ConfigError, match="batch 1.*NaN"):
        run_in_threads(fail, surgery_worker(busy, [mlp_input], calibration, expected))
    assert snapshot_differences(failing_before, snapshot(failing)) == []
    assert snapshot_differences(busy_before, snapshot(busy)) == []
    assert same(collect(failing, [image_input]), collect(convnet_factory(0), [image_input]))


# --------------------------------------------------------------------------- build-time interception


def build() -> nn.Module:
    """Many registrations of every kind: modules, parameters and buffers, nested."""
    return nn.Sequential(*(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.BatchNorm1d(4)) for _ in range(12)))


def kinds(model: nn.Module) -> list[str]:
    return [type(m).__name__ for m in model.modules()]


def test_intercept_in_one_thread_never_touches_models_built_in_another():
    plain_kinds = kinds(build())
    swap = rules.swap(nn.ReLU, lambda old: nn.SiLU())
    freeze = rules.on_parameter(nn.Linear, rules.freeze())

    def swapping(barrier: threading.Barrier) -> None:
        for _ in range(ROUNDS):
            barrier.wait()
            with surgery.intercept(swap, freeze) as log:
                model = build()
            assert kinds(model) == [k.replace("ReLU", "SiLU") for k in plain_kinds]
            assert not any(p.requires_grad for m in model.modules() if isinstance(m, nn.Linear) for p in m.parameters())
            assert len(log) == 12 + 24  # every swap and every frozen parameter, none from the other thread

    def building(barrier: threading.Barrier) -> None:
        for round_ in range(ROUNDS):
            barrier.wait()
            if round_ % 2:  # its own block, open at the same time as the other thread's
                with surgery.intercept(rules.wrap(nn.Linear, Passthrough)) as log:
                    model = build()
                assert kinds(model).count("Passthrough") == 12 and "SiLU" not in kinds(model)
                assert {event.kind for event in log} == {"wrap"} and len(log) == 12
            else:
                for _ in range(4):
                    model = build()
                    assert kinds(model) == plain_kinds
                    assert all(p.requires_grad for p in model.parameters())

    run_in_threads(swapping, building)
    assert registration_hooks() == 0


class Turns:
    """Lets threads act one at a time, in a given order of thread names."""

    def __init__(self, order: tuple[str, ...]) -> None:
        self.order, self.step = order, 0
        self.condition = threading.Condition()

    @contextlib.contextmanager
    def turn(self, who: str) -> Iterator[None]:
        with self.condition:
            if not self.condition.wait_for(lambda: self.order[self.step] == who, timeout=10):
                raise TimeoutError(f"{who} never got its turn at step {self.step} of {self.order}")
        try:
            yield
        finally:
            with self.condition:
                self.step += 1
                self.condition.notify_all()


SWAPS = {"A": (nn.SiLU, nn.GELU), "B": (nn.Tanh, nn.Sigmoid)}  # (outer rule, inner rule) of each thread


def nested_worker(who: str, turns: Turns, depths: dict[str, int], seen: list) -> Callable[[], None]:
    """Open an outer and an inner ``intercept`` block and close them, one action per turn;
    after each action record the number of global hooks and what a ReLU built now becomes."""
    outer_type, inner_type = SWAPS[who]
    blocks = [
        surgery.intercept(rules.swap(nn.ReLU, lambda old: outer_type())),
        surgery.intercept(rules.swap(nn.ReLU, lambda old: inner_type())),
    ]
    actions = [
        (blocks[0].__enter__, 1),
        (blocks[1].__enter__, 2),
        (lambda: blocks[1].__exit__(None, None, None), 1),
        (lambda: blocks[0].__exit__(None, None, None), 0),
    ]

    def work() -> None:
        for action, depth in actions:
            with turns.turn(who):
                action()
                depths[who] = depth
                probe = type(nn.Sequential(nn.ReLU())[0])
                seen.append((who, dict(depths), registration_hooks(), probe))

    return work


def interleavings() -> Iterator[tuple[str, ...]]:
    """Every order of A's four actions among B's four (70 of them)."""
    for positions in itertools.combinations(range(8), 4):
        yield tuple("A" if i in positions else "B" for i in range(8))


def test_nested_blocks_in_two_threads_exiting_in_any_interleaved_order_remove_the_hooks():
    for order in interleavings():
        turns, depths, seen = Turns(order), {"A": 0, "B": 0}, []
        workers = [nested_worker(who, turns, depths, seen) for who in "AB"]
        run_in_threads(*(lambda barrier, work=work: work() for work in workers), timeout=20)
        assert [who for who, *_ in seen] == list(order)
        for who, depth, hooks, probe in seen:
            assert hooks == (3 if any(depth.values()) else 0), (order, seen)  # one set, while any block is open
            assert probe is (nn.ReLU, *SWAPS[who])[depth[who]], (order, seen)  # only this thread's rules
        assert registration_hooks() == 0


# --------------------------------------------------------------------------- inspection


def call_rows(calls: list[ModuleCall]) -> list[tuple]:
    """Everything of a recorded call but its wall time."""
    return [(c.name, c.type, c.depth, c.batch, c.input_shapes, c.output_shapes, c.params_own) for c in calls]


def test_inspection_in_one_thread_records_only_its_model_while_another_runs_surgery(
    convnet_factory, mlp_factory, image_input, mlp_input
):
    inspected, other = convnet_factory(0), mlp_factory(0)
    expected_rows = call_rows(inspect_model(inspected, [image_input, image_input[:1]]))
    calibration = [torch.randn(4, 8, generator=torch.Generator().manual_seed(5))]
    expected_round = surgery_round(copy.deepcopy(other), [mlp_input], calibration)
    wide = torch.randn(5, 3, 12, 12, generator=torch.Generator().manual_seed(6))
    expected_wide = collect(inspected, [wide])

    def inspecting(barrier: threading.Barrier) -> None:
        for _ in range(ROUNDS):
            barrier.wait()
            assert call_rows(inspect_model(inspected, [image_input, image_input[:1]])) == expected_rows

    def running(barrier: threading.Barrier) -> None:
        for _ in range(ROUNDS):
            barrier.wait()
            assert same(surgery_round(other, [mlp_input], calibration), expected_round)
            assert same(collect(inspected, [wide]), expected_wide)  # the inspected model itself, batch of 5

    run_in_threads(inspecting, running)
    assert not any(global_hook_counts().values())
    assert not any(module_hook_counts(inspected).values()) and not any(module_hook_counts(other).values())


def test_threads_inspecting_at_once_each_record_only_their_own_calls(
    convnet_factory, mlp_factory, image_input, mlp_input
):
    shared = convnet_factory(0)  # inspected by two threads at once, with different batch sizes
    jobs = [(shared, image_input), (shared, image_input[:1]), (mlp_factory(0), mlp_input)]
    expected = [call_rows(inspect_model(model, x)) for model, x in jobs]

    def inspecting(model: nn.Module, x: Tensor, rows: list[tuple]) -> Worker:
        def work(barrier: threading.Barrier) -> None:
            for _ in range(ROUNDS):
                barrier.wait()
                assert call_rows(inspect_model(model, x)) == rows

        return work

    run_in_threads(*(inspecting(model, x, rows) for (model, x), rows in zip(jobs, expected)))
    assert not any(global_hook_counts().values())
