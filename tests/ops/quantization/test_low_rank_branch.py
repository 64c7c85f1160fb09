"""EoRA branches: the paper's projection on one layer, less output error on a quantized Llama,
removed exactly, refused by bake, saved as a PEFT LoRA adapter that PEFT loads to the same outputs."""

from __future__ import annotations

import pytest
import torch
from support import tiny_llama, token_batches  # tests/support.py

import surgery
from surgery import GridSpec
from surgery.core.errors import AlreadyModifiedError, ConfigError, OutputExistsError
from surgery.ops.quantization.low_rank_branch import eora_factors


def reference_eora(delta, moment, rank):
    """EoRA as its authors' code computes it: eigh of the inputs' second moment (negative
    eigenvalues raised to the least positive), ΔW·QΛ^½ truncated by SVD, S^½ on each side."""
    eigenvalues, vectors = torch.linalg.eigh(moment.double())
    eigenvalues[eigenvalues < 0] = eigenvalues[eigenvalues > 0].min()
    scaling = vectors @ torch.diag(eigenvalues.sqrt())
    u, s, v = torch.linalg.svd(delta.double() @ scaling, full_matrices=False)
    root = torch.diag(s[:rank].sqrt())
    return (root @ v[:rank] @ torch.linalg.inv(scaling)).float(), (u[:, :rank] @ root).float()


def test_the_branch_is_the_paper_s_eigenspace_projection_and_beats_plain_svd_on_the_inputs():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(512, 48, generator=generator) * torch.logspace(-1, 1, 48)
    moment = x.t() @ x / x.shape[0]
    delta = torch.randn(32, 48, generator=generator) * 0.05
    down, up = eora_factors(delta, moment, 8)
    their_down, their_up = reference_eora(delta, moment, 8)
    assert torch.allclose(up @ down, their_up @ their_down, atol=1e-6)
    u, s, v = torch.linalg.svd(delta, full_matrices=False)
    plain = (u[:, :8] * s[:8]) @ v[:8]
    seen = lambda approximation: ((delta - approximation) @ x.t()).pow(2).sum().item()
    assert seen(up @ down) < 0.8 * seen(plain)  # the error the inputs see, not the weights' own


def test_a_branch_brings_a_3_bit_llama_closer_and_restores_exactly():
    model = tiny_llama(layers=2, vocab=64, hidden=32)
    data = token_batches()
    with torch.no_grad():
        reference = [model(**batch).logits for batch in data]
    quantized = surgery.quantize(model, weights=GridSpec(bits=3, group_size=16), exclude="lm_head", progress=False)
    with torch.no_grad():
        rounded = [model(**batch).logits for batch in data]
    branch = surgery.low_rank_branch(quantized, rank=8, calibration=data, progress=False)
    with torch.no_grad():
        compensated = [model(**batch).logits for batch in data]
    error = lambda outputs: sum((o - r).pow(2).sum().item() for o, r in zip(outputs, reference, strict=True))
    assert error(compensated) < 0.5 * error(rounded)  # measured 0.10x (rank 2: 0.65x, 16: 0.005x)
    assert set(branch.branches) == {n.rpartition(".")[0] for n in quantized.weights}
    with pytest.raises(AlreadyModifiedError, match="low_rank_branch was applied after it"):
        quantized.restore()
    with pytest.raises(ConfigError, match=r"low_rank_branch.bake.*separate adapter.*handle.save"):
        branch.bake()
    branch.restore()
    with torch.no_grad():
        assert all(torch.equal(model(**b).logits, r) for b, r in zip(data, rounded, strict=True))
    quantized.restore()


def test_the_saved_adapter_loads_in_peft_and_gives_the_same_outputs(tmp_path):
    peft = pytest.importorskip("peft")
    model = tiny_llama(layers=2, vocab=64, hidden=32)
    data = token_batches()
    quantized = surgery.quantize(model, weights=GridSpec(bits=3, group_size=16), exclude="lm_head", progress=False)
    branch = surgery.low_rank_branch(quantized, rank=4, calibration=data, progress=False)
    with torch.no_grad():
        ours = [model(**batch).logits for batch in data]
    branch.save(tmp_path / "adapter")
    branch.restore()
    plain = quantized.bake()
    loaded = peft.PeftModel.from_pretrained(plain, tmp_path / "adapter").eval()
    with torch.no_grad():
        theirs = [loaded(**batch).logits for batch in data]
    assert all(torch.allclose(o, t, atol=1e-5) for o, t in zip(ours, theirs, strict=True))


@pytest.mark.parametrize(
    ("rank", "match"),
    [(0, r"low_rank_branch.rank.*at least 1"), (40, r"low_rank_branch.rank.*larger than model.layers.0.*at most 32")],
)
def test_a_rank_the_layers_cannot_hold_is_refused_in_one_line(rank, match):
    model = tiny_llama(layers=1, vocab=64, hidden=32)
    quantized = surgery.quantize(model, weights=GridSpec(bits=4), exclude="lm_head", progress=False)
    with pytest.raises(ConfigError, match=match):
        surgery.low_rank_branch(quantized, rank=rank, calibration=token_batches(), progress=False)
    quantized.restore()


def test_saving_over_an_adapter_or_a_file_is_refused_in_one_line(tmp_path):
    """Hostile pass, wave 4, item 10: saving onto a file raised FileExistsError, and a second save
    into one folder silently replaced the first adapter."""
    model = tiny_llama(layers=1, vocab=64, hidden=32)
    data = token_batches()
    quantized = surgery.quantize(model, weights=GridSpec(bits=3, group_size=16), exclude="lm_head", progress=False)
    branch = surgery.low_rank_branch(quantized, rank=2, calibration=data, progress=False)
    (tmp_path / "file").write_text("mine")
    with pytest.raises(ConfigError, match=r"^low_rank_branch\.save\.folder='.*file': is a file"):
        branch.save(tmp_path / "file")
    first = branch.save(tmp_path / "adapter")
    weights = (first / "adapter_model.safetensors").read_bytes()
    with pytest.raises(OutputExistsError, match="overwrite=True"):
        branch.save(first)
    assert (first / "adapter_model.safetensors").read_bytes() == weights
    assert branch.save(first, overwrite=True) == first
    assert sorted(p.name for p in first.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    branch.restore()
    quantized.restore()
