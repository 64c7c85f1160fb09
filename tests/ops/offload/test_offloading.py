"""surgery.offloaded: a model built without its weights, read from disk group by group, runs
like the model in memory to the bit; what is not a model is said in one line."""

from __future__ import annotations

import json
import os
from pathlib import Path
from unittest import mock

import memory_probe as memory_probe_module  # tests/memory_probe.py
import pytest
import torch
import torchvision
from safetensors.torch import load_file, save_file
from support import tiny_llama, tiny_moe  # tests/support.py
from torch import nn

import surgery
from surgery.core._compat import global_hook_counts
from surgery.core.errors import ConfigError, ConfigTypeError
from surgery.ops.offload.offloading import WeightFiles
from surgery.testing import assert_no_hooks

W1 = "model.layers.1.block_sparse_moe.experts.0.w1.weight"
GATE = "model.layers.1.block_sparse_moe.gate.weight"


def llama_folder(folder: Path, shard: str | None = None, dtype: torch.dtype = torch.float32) -> nn.Module:
    """A random 3-layer Llama saved as Hugging Face saves it (sharded when ``shard`` is a size)."""
    model = tiny_llama(layers=3, vocab=100, dtype=dtype)
    model.save_pretrained(folder, **({"max_shard_size": shard} if shard else {}))
    return model


def logits(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens).logits


@pytest.mark.parametrize("shard", [None, "100KB"], ids=["one-file", "sharded"])
def test_a_hugging_face_folder_runs_offloaded_equal_to_the_model_in_memory(tmp_path, shard):
    reference = llama_folder(tmp_path, shard)
    if shard:
        assert (tmp_path / "model.safetensors.index.json").is_file()
    tokens = torch.randint(0, 100, (2, 8))
    handle = surgery.offloaded(tmp_path)
    model = handle.model
    assert all(p.is_meta for p in model.parameters())  # nothing read before a forward
    assert torch.equal(logits(model, tokens), logits(reference, tokens))
    assert all(p.is_meta for p in model.parameters())  # released after it
    assert handle.groups[:3] == ["model.layers.0", "model.layers.1", "model.layers.2"]
    plain = handle.materialise()
    assert_no_hooks(plain)
    assert not any(p.is_meta for p in plain.parameters())
    assert torch.equal(logits(plain, tokens), logits(reference, tokens))


def test_the_dtype_of_the_config_is_the_models_as_from_pretrained_builds_it(tmp_path):
    """Parameters in the config's dtype, the rotary frequencies kept in float32 as transformers
    computes them (before: cast to bfloat16 with the model, logits 0.006 off from_pretrained's)."""
    transformers = pytest.importorskip("transformers")
    llama_folder(tmp_path, dtype=torch.bfloat16)
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    model = surgery.offloaded(tmp_path).model
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.model.rotary_emb.inv_freq.dtype == reference.model.rotary_emb.inv_freq.dtype == torch.float32
    assert torch.get_default_dtype() == torch.float32  # put back after the build
    tokens = torch.randint(0, 100, (2, 8))
    assert torch.equal(logits(model, tokens), logits(reference, tokens))


def test_a_torchvision_model_with_batchnorm_statistics_runs_from_a_factory_and_its_file(tmp_path):
    torch.manual_seed(0)
    reference = torchvision.models.resnet18(num_classes=10).eval()
    for module in reference.modules():
        if isinstance(module, nn.BatchNorm2d):  # statistics a fresh model would not have
            module.running_mean.uniform_(-0.5, 0.5)
            module.running_var.uniform_(0.5, 2.0)
    save_file(reference.state_dict(), tmp_path / "resnet18.safetensors")
    handle = surgery.offloaded(
        tmp_path / "resnet18.safetensors", factory=lambda: torchvision.models.resnet18(num_classes=10)
    )
    images = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        assert torch.equal(handle.model(images), reference(images))
    handle.restore()
    assert_no_hooks(handle.model)


def test_a_timm_vision_transformer_runs_offloaded_block_by_block(tmp_path):
    timm = pytest.importorskip("timm")

    def build():
        return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, num_classes=5)

    torch.manual_seed(0)
    reference = build().eval()
    save_file(reference.state_dict(), tmp_path / "vit.safetensors")
    handle = surgery.offloaded(tmp_path, factory=build)
    assert handle.groups[0] == "blocks.0" and len([g for g in handle.groups if g.startswith("blocks.")]) == 12
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(handle.model(images), reference(images))


def test_weights_are_released_when_the_forward_raises(tmp_path):
    llama_folder(tmp_path)
    model = surgery.offloaded(tmp_path).model
    with pytest.raises(IndexError):
        model(torch.tensor([[5, 500]]))  # a token id beyond the vocabulary
    assert all(p.is_meta for p in model.parameters())


@pytest.mark.xdist_group("memory")
def test_a_forward_holds_one_block_of_weights_not_the_model(tmp_path, memory_probe):
    """24 blocks of 8 MB: reading them all would add 1x the weights, one at a time ~0.04x."""
    path = str(tmp_path / "wide.safetensors")
    memory_probe_module.write(path)
    assert memory_probe.peak("offloaded", path) <= 0.15


def edit_shard(folder: Path, edit) -> None:
    path = folder / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def drop_one_shard(folder: Path) -> None:
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    (folder / sorted(set(index["weight_map"].values()))[-1]).unlink()


def weight_map_a_list(folder: Path) -> None:
    path = folder / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    path.write_text(json.dumps({**index, "weight_map": sorted(index["weight_map"].values())}))


def shard_a_fifo(folder: Path) -> None:
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shard = folder / sorted(set(index["weight_map"].values()))[-1]
    shard.unlink()
    os.mkfifo(shard)


@pytest.mark.parametrize(
    "spoil, shard, message",
    [
        (
            drop_one_shard,
            "100KB",
            r"model-00\d+-of-00\d+\.safetensors.*is listed in model.safetensors.index.json but missing",
        ),
        (
            lambda f: edit_shard(f, lambda t: t.update({"model.norm.weight": t["model.norm.weight"][:32]})),
            None,
            r"model\.norm\.weight.*is \[32\] torch.float32 in model.safetensors, but the model built from the config "
            r"has \[64\] torch.float32",
        ),
        (
            lambda f: edit_shard(f, lambda t: t.update({"lm_head.weight": t["lm_head.weight"].half()})),
            None,
            r"lm_head\.weight.*is \[100, 64\] torch.float16 .* has \[100, 64\] torch.float32",
        ),
        (
            lambda f: edit_shard(f, lambda t: t.pop("model.layers.1.mlp.up_proj.weight")),
            None,
            r"model\.layers\.1\.mlp\.up_proj\.weight.*is a parameter of the model but in none of model.safetensors",
        ),
        (lambda f: (f / "config.json").unlink(), None, r"is not a model: no config.json"),
        (lambda f: (f / "model.safetensors").write_bytes(b"not a tensor file"), None, r"is not a safetensors file"),
        (lambda f: (f / "config.json").write_text("{]"), None, r"config.json.*is not a model config"),
        (weight_map_a_list, "100KB", r"index.json': is not a safetensors index \(its weight_map must map"),
        (shard_a_fifo, "100KB", r"safetensors': is listed in model.safetensors.index.json but is not a regular file"),
    ],
    ids=[
        "missing-shard",
        "shape",
        "dtype",
        "missing-tensor",
        "no-config",
        "not-safetensors",
        "bad-config",
        "weight-map-list",
        "fifo-shard",
    ],
)
def test_what_is_not_the_model_is_one_line_and_changes_nothing(tmp_path, spoil, shard, message):
    llama_folder(tmp_path, shard)
    spoil(tmp_path)
    before_hooks = global_hook_counts()
    before = {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()}
    with pytest.raises(ConfigError, match=message) as err:
        surgery.offloaded(tmp_path)
    assert "\n" not in str(err.value) and "offloaded.source" in str(err.value)
    assert {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()} == before  # the source never changes
    assert global_hook_counts() == before_hooks  # the build's hooks are gone


@pytest.mark.parametrize(
    "source, factory, error, message",
    [
        ("does/not/exist", None, ConfigError, "does not exist"),
        (".", None, ConfigError, "is not a model: no config.json"),
        ("FILE", None, ConfigError, "pass factory="),
        ("FILE", "resnet18", ConfigTypeError, "offloaded.factory.*must be a callable"),
        ("FILE", lambda: "a string", ConfigTypeError, "must build an nn.Module"),
    ],
)
def test_a_source_or_factory_that_is_no_model_is_named(tmp_path, source, factory, error, message):
    file = tmp_path / "w.safetensors"
    save_file({"weight": torch.zeros(2)}, file)
    source = {"FILE": file, ".": tmp_path}.get(source, source)
    with pytest.raises(error, match=message) as err:
        surgery.offloaded(source, factory=factory)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "verb",
    [
        lambda m: surgery.quantize(
            m, weights=surgery.GridSpec(bits=4), method="gptq", calibration=[torch.randint(0, 100, (1, 8))]
        ),
        lambda m: surgery.prune(m, 0.5),
    ],
    ids=["gptq", "prune"],
)
def test_a_verb_given_the_offloaded_model_not_its_handle_says_how_to_go_on(tmp_path, verb):
    llama_folder(tmp_path)
    handle = surgery.offloaded(tmp_path)
    with pytest.raises(
        ConfigError, match=r"is offloaded to model\.safetensors .*the handle itself.*handle\.materialise\(\)"
    ) as err:
        verb(handle.model)
    assert "\n" not in str(err.value)
    assert all(p.is_meta for p in handle.model.parameters())


@pytest.mark.parametrize("change", ["replaced", "rewritten"])
def test_a_shard_changed_while_offloaded_is_refused_naming_it_never_read_at_stale_offsets(tmp_path, change):
    """Another model's file put in its place, or the file written again with a longer header:
    the offsets read at open no longer hold its tensors."""
    llama_folder(tmp_path / "model")
    source = surgery.offloaded(tmp_path / "model")
    tokens = torch.randint(0, 100, (1, 8))
    logits(source.model, tokens)
    path = tmp_path / "model" / "model.safetensors"
    tensors = {k: v * 2 for k, v in load_file(path).items()}
    if change == "replaced":
        save_file(tensors, tmp_path / "other.safetensors", metadata={"format": "pt"})
        os.replace(tmp_path / "other.safetensors", path)
    else:
        save_file(tensors, tmp_path / "other.safetensors", metadata={"format": "pt", "note": "x" * 500})
        with path.open("r+b") as file:  # the same inode, other bytes
            file.write((tmp_path / "other.safetensors").read_bytes())
            file.truncate()
    with pytest.raises(ConfigError, match=r"model\.safetensors': changed while the offloaded model reads it") as err:
        logits(source.model, tokens)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("weight_map", [[1, 2], None, {"a": 3}, {"a": "../other/model.safetensors"}, {"a": "/abs.st"}])
def test_an_index_whose_weight_map_is_not_plain_file_names_is_one_line(tmp_path, weight_map):
    tiny_llama().save_pretrained(tmp_path / "model", max_shard_size="100KB")
    index = tmp_path / "model" / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    with pytest.raises(ConfigError, match=r"model.safetensors.index.json': (is not a safetensors index|lists )") as err:
        surgery.offloaded(tmp_path / "model")
    assert "\n" not in str(err.value)


def moe_folder(folder: Path, family: str) -> nn.Module:
    """A random 2-layer mixture-of-experts model saved as transformers saves it (experts per expert)."""
    model = tiny_moe(family, layers=2)
    model.save_pretrained(folder)
    return model


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "olmoe", "phimoe", "gpt_oss"])
def test_a_moe_folder_saved_by_transformers_runs_offloaded_equal_to_the_model_in_memory(tmp_path, family):
    model = moe_folder(tmp_path, family)
    source = surgery.offloaded(tmp_path)
    tokens = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    assert torch.equal(logits(source.model, tokens), logits(model, tokens))
    assert all(p.is_meta for p in source.model.parameters())
    state = source.model.state_dict(keep_vars=True)
    assert all(torch.equal(source.value_of(state[name]), value) for name, value in model.state_dict().items())


def test_a_block_brought_in_reads_only_its_own_experts(tmp_path):
    moe_folder(tmp_path, "mixtral")
    source = surgery.offloaded(tmp_path)
    with mock.patch.object(WeightFiles, "load", autospec=True, side_effect=WeightFiles.load) as load:
        with source.resident(source.model.model.layers[1]) as weights:
            assert weights["model.layers.1.mlp.experts.gate_up_proj"].shape == (4, 96, 32)
    read = {call.args[1] for call in load.call_args_list}
    assert "model.layers.1.block_sparse_moe.experts.3.w3.weight" in read
    assert all(name.startswith("model.layers.1.") for name in read)  # nothing of layer 0's experts


@pytest.mark.parametrize(
    "spoil, message",
    [
        (
            lambda t: t.update({"model.layers.1.block_sparse_moe.gat.weight": t.pop(GATE)}),
            r"offloaded.source='model\.layers\.1\.mlp\.gate\.weight': is a parameter of the model but in none of "
            r"model.safetensors in .*; model\.layers\.1\.block_sparse_moe\.gat\.weight in the files is no tensor",
        ),
        (
            lambda t: t.update({"model.layers.1.block_sparse_moe.experts.0.w9.weight": t.pop(W1)}),
            r"'model\.layers\.1\.mlp\.experts\.gate_up_proj': cannot be made from .*experts\.0\.w3\.weight .*; "
            r"model\.layers\.1\.block_sparse_moe\.experts\.0\.w9\.weight in the files is no tensor",
        ),
        (
            lambda t: t.update({W1: t[W1][:, :16].contiguous()}),
            r"'model\.layers\.1\.mlp\.experts\.gate_up_proj'.*cannot be made from "
            r"model\.layers\.1\.block_sparse_moe\.experts\.0\.w1\.weight",
        ),
        (
            lambda t: t.update(
                {"model.layers.0.mlp.gate.weight": t["model.layers.0.block_sparse_moe.gate.weight"].clone()}
            ),
            r"offloaded.source='model\.layers\.0\.mlp\.gate\.weight': is model\.layers\.0\.mlp\.gate\.weight of "
            r"the model as transformers renames it, and so is model\.layers\.0\.block_sparse_moe\.gate\.weight",
        ),
    ],
    ids=["unmapped-router", "unmapped-expert", "unstackable-experts", "two-names-for-one"],
)
def test_a_moe_folder_whose_names_transformers_cannot_map_is_one_line(tmp_path, spoil, message):
    moe_folder(tmp_path, "mixtral")
    edit_shard(tmp_path, spoil)
    with pytest.raises(ConfigError, match=message) as err:
        surgery.offloaded(tmp_path)
    assert "\n" not in str(err.value)
