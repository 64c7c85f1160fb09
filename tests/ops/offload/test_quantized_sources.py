"""Checkpoints that ship quantized, read offloaded: each weight dequantized as it is read, equal
bit for bit to what transformers' own dequantization gives on a CPU (folders written here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from support import run_recipe, tiny_llama, tiny_moe  # tests/support.py

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


E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def mxfp4_packed(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GPT-OSS's layout of ``weight`` (experts, inputs, outputs): ``(experts, outputs, inputs / 32,
    16)`` bytes, two E2M1 nibbles each (the even input low), and one E8M0 exponent per 32 inputs."""
    rows = weight.transpose(1, 2).float()  # (experts, outputs, inputs)
    groups = rows.reshape(*rows.shape[:-1], -1, 32)
    exponent = torch.floor(torch.log2(groups.abs().amax(-1).clamp(min=2.0**-100))) - 2  # amax / 2^e in [4, 8)
    scaled = groups / torch.exp2(exponent).unsqueeze(-1)
    index = (scaled.abs().unsqueeze(-1) - E2M1).abs().argmin(-1) + 8 * (scaled < 0)
    nibbles = index.to(torch.uint8)
    packed = nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)
    return packed.contiguous(), (exponent + 127).to(torch.uint8)


def mxfp4_gpt_oss_folder(folder: Path) -> None:
    """A one-layer GPT-OSS saved as its release is: experts in MXFP4 blocks and scales, the rest bf16."""
    model = tiny_moe("gpt_oss", hidden=64).to(torch.bfloat16)
    model.config.architectures = ["GptOssForCausalLM"]
    model.save_pretrained(folder)
    tensors = load_file(folder / "model.safetensors")
    out = {}
    for name, tensor in tensors.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            out[f"{name}_blocks"], out[f"{name}_scales"] = mxfp4_packed(tensor)
        else:
            out[name] = tensor
    save_file(out, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (folder / "config.json").write_text(json.dumps(config))


def test_a_gpt_oss_mxfp4_release_reads_offloaded_equal_to_transformers_dequantization(tmp_path):
    mxfp4_gpt_oss_folder(tmp_path)
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, device_map="cpu").eval()
    handle = surgery.offloaded(tmp_path)
    assert handle.source_scheme.startswith("mxfp4")
    ours = handle.materialise()
    theirs = dict(reference.named_parameters())
    assert theirs["model.layers.0.mlp.experts.gate_up_proj"].dtype == torch.bfloat16  # dequantized by transformers
    assert set(dict(ours.named_parameters())) == set(theirs)
    for name, param in ours.named_parameters():
        assert torch.equal(param, theirs[name]), name
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    assert torch.equal(ours(ids).logits, reference(ids).logits)


CT_GRIDS = {
    "int4-pack-quantized": surgery.GridSpec(bits=4, group_size=32, symmetric=True, per_channel=True),
    "fp8-float-quantized": surgery.GridSpec(format="fp8_e4m3", per_channel=True),
    "nvfp4": surgery.GridSpec(format="nvfp4"),
}


@pytest.mark.parametrize("grid", list(CT_GRIDS))
def test_a_compressed_tensors_folder_reads_offloaded_equal_to_transformers_dequantization(tmp_path, grid):
    pytest.importorskip("compressed_tensors")
    model = tiny_llama(layers=2, vocab=128, hidden=64).to(torch.bfloat16)
    with surgery.quantize(model, weights=CT_GRIDS[grid], exclude="lm_head", progress=False) as handle:
        surgery.export(handle, tmp_path / "ct", format="compressed-tensors")
    dequantized = transformers.CompressedTensorsConfig(dequantize=True)
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ct", quantization_config=dequantized)
    source = surgery.offloaded(tmp_path / "ct")
    assert source.source_scheme.startswith("compressed-tensors (")
    ours, theirs = source.materialise(), dict(reference.eval().named_parameters())
    assert set(dict(ours.named_parameters())) == set(theirs)
    for name, param in ours.named_parameters():
        assert torch.equal(param, theirs[name]), name
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    assert torch.equal(ours(ids).logits, reference(ids).logits)


def test_an_fp8_mixture_of_experts_release_reads_each_expert_dequantized_then_fused(tmp_path):
    """Qwen3-MoE FP8 ships one (weight, weight_scale_inv) pair per expert and projection:
    each is dequantized before transformers' conversion stacks the experts into fused tensors."""
    model = tiny_moe("qwen3_moe", hidden=256).to(torch.bfloat16)
    model.config.architectures = ["Qwen3MoeForCausalLM"]
    model.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    out = {}
    for name, tensor in tensors.items():
        if name.startswith("model.layers.") and name.endswith("_proj.weight") and tensor.shape[0] % BLOCK == 0:
            out[name], out[f"{name}_scale_inv"] = fp8_block_scaled(tensor)
        else:
            out[name] = tensor  # the router (4 rows) stays bf16, as in the releases
    assert "model.layers.0.mlp.experts.3.down_proj.weight_scale_inv" in out
    save_file(out, tmp_path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [BLOCK, BLOCK]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, device_map="cpu").eval()
    ours, theirs = surgery.offloaded(tmp_path).materialise(), dict(reference.named_parameters())
    assert theirs["model.layers.0.mlp.experts.gate_up_proj"].dim() == 3  # fused by the conversion
    for name, param in ours.named_parameters():
        assert torch.equal(param, theirs[name]), name
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    assert torch.equal(ours(ids).logits, reference(ids).logits)


def copy_of(folder: Path, to: Path) -> Path:
    to.mkdir()
    for file in folder.iterdir():
        (to / file.name).write_bytes(file.read_bytes())
    return to


@pytest.mark.parametrize(
    "spoil, message",
    [
        (
            lambda t: t.update({"model.layers.0.mlp.down_proj.weight_scale_inv": torch.ones(3, 5)}),
            r"^offloaded.source='model.layers.0.mlp.down_proj.weight': is \[256, 512\] in blocks of 128x128, which "
            r"take a \[2, 4\] weight_scale_inv; the files hold \[3, 5\]$",
        ),
        (
            lambda t: (
                t.update({"model.layers.0.mlp.up_proj.weight": torch.zeros(512, 256, dtype=torch.float8_e4m3fn)})
                or t.pop("model.layers.0.mlp.up_proj.weight_scale_inv")
            ),
            r"^offloaded.source='model.layers.0.mlp.up_proj.weight': is stored fp8 without its weight_scale_inv",
        ),
    ],
    ids=["scales-do-not-tile", "scale-missing"],
)
def test_a_broken_fp8_folder_is_refused_when_opened_in_one_line(fp8_folder, tmp_path, spoil, message):
    folder = copy_of(fp8_folder, tmp_path / "spoiled")
    tensors = load_file(folder / "model.safetensors")
    spoil(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=message) as raised:
        surgery.offloaded(folder)
    assert "\n" not in str(raised.value)


def test_mxfp4_blocks_without_their_scales_are_refused_in_one_line(tmp_path):
    mxfp4_gpt_oss_folder(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.0.mlp.experts.down_proj_scales"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=r"down_proj_blocks': is stored mxfp4 without its down_proj_scales$"):
        surgery.offloaded(tmp_path)


def test_fp8_blocks_a_dimension_does_not_divide_end_short_and_e8m0_scales_are_powers_of_two():
    """DeepSeek-V3's 576-row projections in blocks of 128 (the last block 64 rows), and MXFP8's
    uint8 exponents: each value times its own block's scale (transformers infers blocks from the
    grid, 576 / 5 rows, and would give rows 115-127 the second scale)."""
    from surgery.ops.offload.source_schemes import SOURCE_SCHEMES

    fp8 = SOURCE_SCHEMES.get("fp8")
    weight = torch.randn(192, 256, generator=torch.Generator().manual_seed(0)).to(torch.float8_e4m3fn)
    scale = torch.tensor([[0.5, 0.25], [2.0, 4.0]])
    found = fp8.dequantize({"w": weight, "s": scale}, torch.float32, {"weight_block_size": [128, 128]})
    assert torch.equal(found[:128, :128], weight[:128, :128].float() * 0.5)
    assert torch.equal(found[128:, 128:], weight[128:, 128:].float() * 4.0)  # the short last block: its own scale
    exponents = torch.tensor([[120, 127], [130, 0]], dtype=torch.uint8)
    found = fp8.dequantize({"w": weight, "s": exponents}, torch.float32, {"weight_block_size": [128, 128]})
    assert torch.equal(found[128:, :128], weight[128:, :128].float() * 8.0)  # 2^(130 - 127)
    assert torch.equal(found[:128, :128], weight[:128, :128].float() * 2.0**-7)
