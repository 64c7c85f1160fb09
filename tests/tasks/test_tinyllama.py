"""The shipped byte-level Llama that really learned the tiny-LM corpus, and the methods the peers
ship measured on it, ranked as in their papers (AWQ, rotations, OWL; held-out perplexity)."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch

import surgery
from surgery import GridSpec
from surgery.analysis.metrics import perplexity
from surgery.tasks.tinyllama import FOLDER, SHAPE, build_llama, load_llama
from surgery.tasks.tinylm import token_batches

pytest.importorskip("transformers")
HEAD = "lm_head"


@pytest.fixture(scope="module")
def model():
    return load_llama()


@pytest.fixture(scope="module")
def held_out():
    return token_batches("test", 16, limit_batches=8)  # 128 of the 468 held-out windows


@pytest.fixture(scope="module")
def calibration():
    return [x for x, _ in token_batches("train", 8, limit_batches=4)]  # 32 windows of 128 bytes


def measured(model, held_out, *handles) -> float:
    found = perplexity(model, held_out)
    for handle in reversed(handles):
        handle.restore()
    return found


def test_the_shipped_llama_learned_its_corpus(model, held_out):
    assert (FOLDER / "config.json").is_file() and model.config.hidden_size == SHAPE["hidden_size"]
    dense = perplexity(model, held_out)
    # measured 4.59 over every held-out window (the untrained model: 264)
    assert dense < 5.0 and perplexity(build_llama(), held_out) > 50 * dense / 5


def test_awq_before_round_to_nearest_at_3_bits_loses_less(model, held_out, calibration):
    spec = GridSpec(bits=3, group_size=128)
    plain = measured(model, held_out, surgery.quantize(model, weights=spec, exclude=HEAD, progress=False))
    scaled = surgery.awq(model, weights=spec, calibration=calibration, progress=False)
    with_awq = measured(model, held_out, scaled, surgery.quantize(model, weights=spec, exclude=HEAD, progress=False))
    # measured over every window: 5.11 without, 4.87 with AWQ (dense 4.59)
    assert with_awq < plain - 0.1


def test_rotation_rescues_4_bit_activations(model, held_out, calibration):
    spec = dict(
        weights=GridSpec(bits=4, group_size=128, symmetric=True),
        activations=GridSpec(bits=4, symmetric=True),
        where="input",
        exclude=HEAD,
        calibration=calibration,
        progress=False,
    )
    plain = measured(model, held_out, surgery.quantize(model, **spec))
    rotated = surgery.rotate(model, calibration=calibration)
    with_rotation = measured(model, held_out, rotated, surgery.quantize(model, **spec))
    assert with_rotation < plain / 3  # measured over every window: 29.4 without, 5.68 with (dense 4.59)


def test_owl_allocation_beats_uniform_wanda_at_70_percent(model, held_out, calibration):
    kwargs = dict(method="wanda", calibration=calibration, exclude=HEAD, progress=False)
    uniform = measured(model, held_out, surgery.prune(model, 0.7, **kwargs))
    allocation = surgery.owl_amounts(model, calibration, 0.7, exclude=HEAD, progress=False)
    allocated = measured(model, held_out, surgery.prune(model, 0.7, amounts=allocation, **kwargs))
    assert allocated < uniform  # measured over every window: 10.75 uniform, 10.44 with OWL's allocation


def test_restores_leave_the_shipped_model_as_loaded(model):
    fresh = load_llama()
    assert all(torch.equal(p, dict(fresh.named_parameters())[n]) for n, p in model.named_parameters())


def test_the_training_script_writes_a_folder_transformers_loads(tmp_path, capsys):
    import transformers

    script = Path(__file__).resolve().parents[2] / "scripts" / "train_tinyllama.py"
    out = tmp_path / "llama"
    with mock.patch.object(sys, "argv", ["train_tinyllama.py", "--out", str(out), "--steps", "2"]):
        runpy.run_path(str(script), run_name="__main__")
    assert "held-out perplexity" in capsys.readouterr().out
    loaded = transformers.LlamaForCausalLM.from_pretrained(out, local_files_only=True)
    assert loaded.config.hidden_size == SHAPE["hidden_size"] and oct(out.stat().st_mode)[-3:] == "755"
