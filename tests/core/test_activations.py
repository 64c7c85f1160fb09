"""Block activations beyond the budget go to disk: the result is the same bit for bit, the
memory held stays under the budget, and the files are gone afterwards."""

from __future__ import annotations

from pathlib import Path
from unittest import mock

import pytest
import torch
from support import tiny_llama  # tests/support.py
from torch import nn

import surgery
from surgery import GridSpec
from surgery.core.activations import BlockCalls, Ledger, SpilledCall, activation_budget
from surgery.core.errors import ConfigError

GPTQ = GridSpec(bits=4, group_size=32)
TOKENS = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(2))


def batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, 128, (2, 16), generator=generator) for _ in range(4)]


def logits(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS).logits


def gptq_logits(budget: int | None, folder: Path) -> tuple[torch.Tensor, surgery.QuantizeHandle, Ledger]:
    model = tiny_llama(layers=3, vocab=128)
    with activation_budget(budget, folder=folder) as ledger:
        handle = surgery.quantize(model, weights=GPTQ, method="gptq", calibration=batches(), progress=False)
    return logits(model), handle, ledger


# one batch's block input: hidden states (2 x 16 x 64 float32) and the rotary tables (2 x 1 x 16 x 16 ...)
ONE_BATCH = 2 * 16 * 64 * 4


@pytest.mark.parametrize("budget", [0, 3 * ONE_BATCH])
def test_spilled_activations_give_the_same_gptq_bit_for_bit(tmp_path, budget):
    kept, _, _ = gptq_logits(None, tmp_path)
    spilled, handle, ledger = gptq_logits(budget, tmp_path)
    assert torch.equal(kept, spilled)
    assert handle.sequential.spilled_bytes > 0 and ledger.spilled == handle.sequential.spilled_bytes
    assert ledger.peak_held <= budget  # never more in memory than the budget
    assert list(tmp_path.iterdir()) == []  # every spilled file removed once the pass ended


def test_without_a_budget_nothing_is_spilled_for_small_calibration(tmp_path):
    _, handle, _ = gptq_logits(None, tmp_path)
    assert handle.sequential.spilled_bytes == 0 and handle.sequential.peak_cached_bytes > 0


def test_offloaded_gptq_with_every_batch_on_disk_equals_in_memory(tmp_path):
    model = tiny_llama(layers=3, vocab=128)
    model.save_pretrained(tmp_path / "model")
    surgery.quantize(
        model, weights=GPTQ, method="gptq", calibration=batches(), exclude="lm_head", progress=False
    ).bake()
    spill = tmp_path / "spill"
    spill.mkdir()
    source = surgery.offloaded(tmp_path / "model")
    with activation_budget(0, folder=spill):
        handle = surgery.quantize(
            source, weights=GPTQ, method="gptq", calibration=batches(), exclude="lm_head", progress=False
        )
    assert torch.equal(logits(source.model), logits(model))
    assert handle.spilled_bytes > 0
    assert list(spill.iterdir()) == []


def test_a_spilled_call_reads_back_the_same_tensors_shared_ones_once(tmp_path):
    hidden, mask = torch.randn(2, 4, 8), torch.ones(2, 4, dtype=torch.bool)
    with activation_budget(0, folder=tmp_path) as ledger:
        calls = BlockCalls(ledger)
        calls.add((hidden,), {"mask": mask, "again": mask, "scale": 0.5, "pair": (hidden, None)})
        (entry,) = calls.calls()
        assert isinstance(entry, SpilledCall) and entry.nbytes == hidden.numel() * 4 + mask.numel()
        (args, kwargs) = next(iter(calls))
        assert torch.equal(args[0], hidden) and kwargs["mask"] is kwargs["again"]
        assert torch.equal(kwargs["mask"], mask) and torch.equal(kwargs["pair"][0], hidden)
        assert kwargs["scale"] == 0.5 and kwargs["pair"][1] is None
    assert list(tmp_path.iterdir()) == []  # the block is over: its files are gone, though `calls` lives on
    assert ledger.held == 0


def test_the_ledger_gets_its_bytes_back_when_a_cache_is_gone():
    ledger = Ledger(limit=1000)
    calls = BlockCalls(ledger)
    calls.add((torch.zeros(100),), {})  # 400 bytes
    assert ledger.held == 400
    del calls
    assert ledger.held == 0


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_bytes": -1}, "activation_budget.max_bytes"),
        ({"max_bytes": 1.5}, "activation_budget.max_bytes"),
        ({"max_bytes": 0, "folder": "/no/such/folder"}, "activation_budget.folder"),
    ],
)
def test_bad_budgets_are_one_line_errors(kwargs, field):
    with pytest.raises(ConfigError) as caught, activation_budget(**kwargs):
        pass
    assert caught.value.field == field and "\n" not in str(caught.value)


def test_a_full_disk_while_spilling_leaves_the_model_as_it_was(tmp_path):
    model = tiny_llama(layers=3, vocab=128)
    before = logits(model)
    full = OSError(28, "No space left on device")
    with (
        activation_budget(0, folder=tmp_path),
        mock.patch("surgery.core.activations.torch.save", side_effect=full),
        pytest.raises(ConfigError) as caught,
    ):
        surgery.quantize(model, weights=GPTQ, method="gptq", calibration=batches(), progress=False)
    assert caught.value.field == "activation_budget.folder" and "No space left" in str(caught.value)
    assert torch.equal(logits(model), before)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.xdist_group("memory")
def test_spilling_bounds_the_peak_whatever_the_calibration_size(memory_probe):
    """GPTQ on 4 narrow blocks fed 96 MB of activations a block. Held in memory, a block's inputs
    and its outputs are both there at once (measured 2.2x the inputs); spilled, one batch at a
    time is (measured 0.24x, most of it the process's own first-call allocations)."""
    assert memory_probe.peak("activations", "memory") > 1.5
    assert memory_probe.peak("activations", "disk") < 0.5


def test_named_tuples_and_ordered_dicts_come_back_as_they_went(tmp_path):
    from collections import OrderedDict, namedtuple

    Pair = namedtuple("Pair", "cos sin")
    pair = Pair(torch.randn(2, 3), torch.randn(2, 3))
    with activation_budget(0, folder=tmp_path) as ledger:
        calls = BlockCalls(ledger)
        calls.add((torch.randn(2, 4),), OrderedDict(position=pair))
        assert calls.spilled_bytes == (8 + 12) * 4  # the named tuple's tensors went to disk too
        _, kwargs = next(iter(calls))
    assert type(kwargs["position"]) is Pair and torch.equal(kwargs["position"].sin, pair.sin)


def test_a_spill_folder_that_cannot_be_written_names_it_and_the_size_it_needed(tmp_path):
    model = tiny_llama(layers=3, vocab=128)
    before = logits(model)
    refused = PermissionError(13, "Permission denied", str(tmp_path))
    with (
        activation_budget(0, folder=tmp_path),
        mock.patch("surgery.core.activations.tempfile.mkdtemp", side_effect=refused),
        pytest.raises(ConfigError) as caught,
    ):
        surgery.quantize(model, weights=GPTQ, method="gptq", calibration=batches(), progress=False)
    message = str(caught.value)
    assert (
        message.startswith(f"activation_budget.folder={str(tmp_path)!r}: could not hold ") and "Permission" in message
    )
    assert " 0 MB" not in message and ("bytes" in message or "kB" in message or "MB" in message)
    assert torch.equal(logits(model), before)
