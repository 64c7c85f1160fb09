"""Inspection through global forward hooks: every call recorded, nothing else, nothing left."""

from __future__ import annotations

import json
import threading

import pytest
import torch
from torch import nn

from surgery.analysis.inspection import ModuleCall, calls_as_rows, format_table, inspect_model
from surgery.testing import global_hook_counts, module_hook_counts


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 6)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.fc(x))


class Nested(nn.Module):
    """A root Linear-free module holding a block, a shared head called twice, and a scale."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(6))
        self.block = Block()
        self.head = nn.Linear(6, 6, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.head(self.block(x)) * self.scale)


def _model() -> Nested:
    torch.manual_seed(0)
    return Nested()


def test_records_every_call_with_names_shapes_dtypes_and_params():
    calls = inspect_model(_model(), torch.randn(2, 8))
    assert [(c.name, c.type, c.depth) for c in calls] == [
        ("", "Nested", 0),
        ("block", "Block", 1),
        ("block.fc", "Linear", 2),
        ("block.act", "ReLU", 2),
        ("head", "Linear", 1),
        ("head", "Linear", 1),
    ]
    root, block, fc, act, head, _ = calls
    assert root.input_shapes == [(2, 8)] and root.output_shapes == [(2, 6)]
    assert fc.input_shapes == [(2, 8)] and fc.output_shapes == [(2, 6)]
    assert fc.input_dtypes == ["float32"] and act.output_dtypes == ["float32"]
    assert (root.params_own, root.params_total) == (6, 6 + 8 * 6 + 6 + 36)
    assert (block.params_own, block.params_total) == (0, 8 * 6 + 6)
    assert (fc.params_own, act.params_total, head.params_own) == (54, 0, 36)
    assert all(c.ms is not None and c.ms >= 0 for c in calls)
    assert root.ms >= block.ms


def test_dtypes_of_other_tensors_are_recorded():
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 2)).double()
    calls = inspect_model(model, torch.tensor([[1, 2, 3]]))
    emb, lin = calls[1], calls[2]
    assert emb.input_dtypes == ["int64"] and emb.output_dtypes == ["float64"]
    assert lin.output_shapes == [(1, 3, 2)]


def test_another_model_run_from_a_hook_is_not_recorded():
    model, other = _model(), nn.Sequential(nn.Linear(8, 8), nn.Tanh())

    def run_other(module, args, out) -> None:
        other(args[0])

    hook = model.block.register_forward_hook(run_other)
    try:
        calls = inspect_model(model, torch.randn(2, 8))
    finally:
        hook.remove()
    assert {c.name for c in calls} == {"", "block", "block.fc", "block.act", "head"}
    assert not any(c.type == "Tanh" for c in calls) and len(calls) == 6


def test_models_run_from_another_thread_are_not_recorded():
    model, other = _model(), nn.Sequential(nn.Linear(8, 8), nn.Tanh())
    started, release = threading.Event(), threading.Event()

    def in_thread() -> None:  # the inspected model and another one, both from another thread
        started.set()
        release.wait(5)
        model(torch.randn(1, 8))
        other(torch.randn(1, 8))

    def slow(module, args, out) -> None:  # while inspecting, let the worker run to completion
        if threading.current_thread() is not worker and not release.is_set():
            release.set()
            worker.join(5)

    worker = threading.Thread(target=in_thread)
    worker.start()
    started.wait(5)
    hook = model.head.register_forward_hook(slow)
    try:
        calls = inspect_model(model, torch.randn(2, 8))
    finally:
        hook.remove()
        worker.join(5)
    assert not worker.is_alive()
    assert len(calls) == 6 and all(c.input_shapes[0][0] == 2 for c in calls)


def test_global_registries_are_empty_after_also_when_the_model_raises():
    before = global_hook_counts()
    model = _model()
    with pytest.raises(RuntimeError):
        inspect_model(model, torch.randn(2, 5))  # wrong width for block.fc
    assert global_hook_counts() == before
    assert not any(module_hook_counts(model).values())
    inspect_model(model, torch.randn(2, 8))
    assert global_hook_counts() == before


def test_training_flags_are_restored():
    model = _model().train()
    inspect_model(model, [torch.randn(2, 8), (torch.randn(3, 8),)])
    assert all(m.training for m in model.modules())


def test_every_batch_is_recorded():
    calls = inspect_model(_model(), [torch.randn(2, 8), (torch.randn(3, 8),)])
    assert [c.batch for c in calls] == [0] * 6 + [1] * 6
    assert calls[6].input_shapes == [(3, 8)]


def test_table_lists_every_module_with_aligned_columns():
    calls = inspect_model(_model(), torch.randn(2, 8))
    table = format_table(calls)
    lines = table.splitlines()
    for name in ("(root)", "block", "block.fc", "block.act", "head"):
        assert any(line.split()[0] == name for line in lines[2:-2]), name
    assert lines[0].split()[:2] == ["Layer", "Type"] and "Output shape" in lines[0]
    column = lines[0].index("Type")
    assert all(line[column - 2 : column] == "  " for line in lines[2:-2])
    assert "[2, 8]" in table and "[2, 6]" in table and "54" in table
    assert lines[-1].startswith("6 calls, 96 parameters")


def test_rows_are_json_ready():
    rows = calls_as_rows(inspect_model(_model(), torch.randn(2, 8)))
    data = json.loads(json.dumps(rows))
    assert data[2]["name"] == "block.fc" and data[2]["input_shapes"] == [[2, 8]]
    assert data[2]["params_own"] == 54 and data[0]["params_total"] == 96
    assert set(data[0]) == {f for f in ModuleCall.__dataclass_fields__}
