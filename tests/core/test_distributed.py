"""Calibration across two gloo processes launched by torchrun: each rank calibrates half the
batches and the statistics are summed, so both ranks compute the same weights, and those equal
one process's up to the order of summation."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from support import tiny_llama  # tests/support.py

import surgery
from surgery.core.errors import ConfigError

WORKER = Path(__file__).with_name("distributed_worker.py")
sys.path.insert(0, str(WORKER.parent))
from distributed_worker import batches, run  # noqa: E402


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> Path:
    """One torchrun of two ranks for every test here (distributed_worker.py): their files."""
    out = tmp_path_factory.mktemp("ranks")
    tiny_llama(layers=2).save_pretrained(out / "llama")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(WORKER)]
    result = subprocess.run([*command, str(out), str(out / "llama")], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return out


@pytest.mark.xdist_group("torchrun")
@pytest.mark.parametrize("where", ["in-memory", "offloaded"])
def test_two_processes_calibrate_halves_and_agree_with_one(two_ranks, where):
    for method in ("gptq", "sparsegpt", "wanda"):
        first, second = (load_file(two_ranks / where / f"rank-{r}-{method}.safetensors") for r in (0, 1))
        assert all(torch.equal(first[k], second[k]) for k in first), method  # every rank solved the same
        single = tiny_llama(layers=2)
        run(method, single).bake()
        for name, value in single.state_dict().items():
            found = first[name]
            # summation order moves the Hessians by float32 rounding: SparseGPT's updated weights
            # by ~1e-7, and a GPTQ entry could land on the next grid step; not one here does
            close = torch.isclose(found, value, rtol=1e-4, atol=1e-5).double().mean()
            assert close >= 0.999, (method, name, float(close))
            if method != "gptq":
                assert torch.equal(found == 0, value == 0), (method, name)  # the same entries pruned


def test_sharing_without_a_process_group_is_one_line():
    with pytest.raises(ConfigError, match="init_process_group"):
        with surgery.distributed_calibration():
            pass


@pytest.mark.xdist_group("torchrun")
def test_ranks_that_disagree_are_refused_on_every_rank_and_own_shards_are_used_whole(two_ranks):
    tmp_path = two_ranks / "disagree"
    refusals = [(tmp_path / f"refusals-{r}.txt").read_text().splitlines() for r in (0, 1)]
    assert refusals[0][:2] == refusals[1][:2], refusals  # every rank refuses, in the same words
    model, settings, empty = refusals[0]
    assert "rank 1" in empty and "0 batches" in empty and "0 batches" in refusals[1][2]  # nobody left waiting
    assert "rank 1" in model and "another model" in model
    assert "rank 1" in settings and "other settings" in settings
    first, second = (load_file(tmp_path / f"rank-{r}-shards.safetensors") for r in (0, 1))
    assert all(torch.equal(first[k], second[k]) for k in first)
    single = tiny_llama(layers=2)  # one process given both shards: all 10 batches count
    run("sparsegpt", single, batches(6, seed=2) + batches(4, seed=3)).bake()
    halves = tiny_llama(layers=2)  # what taking every second batch of each shard would give
    run("sparsegpt", halves, batches(6, seed=2)[0::2] + batches(4, seed=3)[1::2]).bake()
    for name, value in single.state_dict().items():
        assert torch.isclose(first[name], value, rtol=1e-4, atol=1e-5).double().mean() >= 0.999, name
    assert any(not torch.equal(first[k] == 0, v == 0) for k, v in halves.state_dict().items())
