"""Checkpoints that ship quantized, read offloaded: each weight dequantized as it is read, equal
bit for bit to what transformers' own dequantization gives on a CPU (folders written here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from support import run_recipe, tiny_llama  # tests/support.py

import surgery
from surgery.core.errors import ConfigError

transformers = pytest.importorskip("transformers")

BLOCK = 128


def fp8_block_scaled(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's layout: float8_e4m3fn values and one float32 ``weight_scale_inv`` per 128x128 block."""
    rows, columns = weight.shape
    blocks = weight.float().reshape(rows // BLOCK, BLOCK, columns // BLOCK, BLOCK)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
    values = (blocks / scale[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    return values.reshape(rows, columns), scale


def fp8_llama_folder(folder: Path) -> None:
    """A two-layer Llama saved as an FP8 release is: every decoder Linear block-scaled, the rest bf16."""
    model = tiny_llama(layers=2, vocab=256, hidden=256).to(torch.bfloat16)  # 256: byte-level data
    model.save_pretrained(folder)
    tensors = load_file(folder / "model.safetensors")
    out = {}
    for name, tensor in tensors.items():
        if name.startswith("model.layers.") and name.endswith("_proj.weight"):
            out[name], out[f"{name}_scale_inv"] = fp8_block_scaled(tensor)
        else:
            out[name] = tensor
    save_file(out, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [BLOCK, BLOCK],
    }
    (folder / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def fp8_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("fp8_llama")
    fp8_llama_folder(folder)
    return folder


def test_an_fp8_release_reads_offloaded_equal_to_transformers_dequantization(fp8_folder):
    reference = transformers.AutoModelForCausalLM.from_pretrained(fp8_folder, device_map="cpu").eval()
    handle = surgery.offloaded(fp8_folder)
    assert handle.source_scheme == "fp8 (e4m3, blocks of 128x128)"
    ours = handle.materialise()
    theirs = dict(reference.named_parameters())
    assert theirs["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16  # dequantized by transformers
    for name, param in ours.named_parameters():
        assert torch.equal(param, theirs[name]), name
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    assert torch.equal(ours(ids).logits, reference(ids).logits)


def test_verbs_run_on_an_fp8_release_offloaded(fp8_folder, tmp_path):
    handle = surgery.offloaded(fp8_folder)
    done = surgery.quantize(handle, weights=surgery.GridSpec(bits=4, group_size=32), exclude="lm_head", work=tmp_path)
    in_memory = transformers.AutoModelForCausalLM.from_pretrained(fp8_folder, device_map="cpu").eval()
    expected = surgery.quantize(in_memory, weights=surgery.GridSpec(bits=4, group_size=32), exclude="lm_head")
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(done.model(ids).logits, expected.model(ids).logits)


def test_an_unknown_or_broken_quantized_source_is_refused_in_one_line(fp8_folder, tmp_path):
    folder = tmp_path / "other"
    folder.mkdir()
    for file in fp8_folder.iterdir():
        (folder / file.name).write_bytes(file.read_bytes())
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "hqq"}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ConfigError, match=r"^offloaded.source=.*config.json': is quantized with quant_method='hqq'"
    ) as e:
        surgery.offloaded(folder)
    assert "\n" not in str(e.value) and "fp8" in str(e.value)
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [BLOCK, BLOCK]}
    (folder / "config.json").write_text(json.dumps(config))
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight_scale_inv"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        ConfigError, match=r"^offloaded.source=.model.layers.1.mlp.up_proj.weight.: is stored fp8 without its"
    ):
        surgery.offloaded(folder)


def test_the_command_line_reads_an_fp8_release_offloaded_and_says_so(fp8_folder, tmp_path):
    args = ("recipe=quantize_gptq_llama", f"model.path={fp8_folder}", "model.offload=true", "quantize.method=rtn")
    report = run_recipe(
        tmp_path, *args, "quantize.weights.group_size=32", "data.batches=1", "checks.drift.min_cosine=0.9"
    )
    assert report["offloaded"]["source_scheme"] == "fp8 (e4m3, blocks of 128x128)"
    assert report["ok"] is True  # random weights at 4 bits: cosine 0.97
    ppl = report["perplexity"]  # a bfloat16 model's, summed in float32: quantizing moves it
    assert ppl["candidate"] != ppl["reference"]
