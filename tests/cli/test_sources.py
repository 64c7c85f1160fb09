"""The command line on models nobody here wrote: timm, Hugging Face (from a config), any factory,
with image-folder and token data. The commands are the documentation's "Your model" page, as written."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import torch
from cli_runner import CliResult, app_main, run_cli  # tests/cli_runner.py
from support import image_folder, local_tokenizer  # tests/support.py

from surgery.cli.models import _optional
from surgery.core.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
# quantize_gptq_llama runs the shipped tiny Llama on its byte corpus; a random Llama of the tests
# (vocabulary 128) takes random token ids, and drifts more at W4 (0.978-0.988 measured)
RANDOM_TOKENS = ("data=tokens", "data.batches=2", "checks.drift.min_cosine=0.97")


def surgery(*args: str) -> CliResult:
    return run_cli(*args, cwd=REPO)


def report(folder: Path) -> dict:
    return json.loads((folder / "report.json").read_text())


def readme_command(fragment: str) -> list[str]:
    """The arguments of the documentation's "Your model" command containing ``fragment``."""
    text = (REPO / "docs" / "models.md").read_text()
    block = re.search(r"```bash\n(.*?)```", text[text.index("# Your model") :], flags=re.S).group(1)
    commands = [shlex.split(line, comments=True)[3:] for line in block.splitlines() if line.startswith("python -m")]
    return next(args for args in commands if any(fragment in arg for arg in args))


pytest.importorskip("timm")
pytest.importorskip("transformers")


def passed(result, folder) -> dict:
    assert result.returncode == 0, result.stderr[-2000:]
    data = report(folder)
    assert data["ok"] is True and all(check["passed"] for check in data["checks"])
    return data


def test_prune_vit_timm_runs_with_every_check_passing(tmp_path):
    data = passed(surgery(*readme_command("recipe=prune_vit_timm"), f"hydra.run.dir={tmp_path}"), tmp_path)
    assert data["model"] == "vit_tiny_patch16_224" and abs(data["sparsity"] - 0.5) < 1e-3


def test_any_timm_model_by_name(tmp_path):
    data = passed(surgery(*readme_command("model.name=convnext_atto"), f"hydra.run.dir={tmp_path}"), tmp_path)
    assert data["model"] == "convnext_atto"


def test_quantize_gpt2_hf_runs_on_token_batches_with_every_check_passing(tmp_path):
    data = passed(surgery(*readme_command("recipe=quantize_gpt2_hf"), f"hydra.run.dir={tmp_path}"), tmp_path)
    assert data["model"] == "gpt2" and data["drift"]["cosine"] > 0.99
    assert any(row["type"] == "Conv1D" for row in data["layers"])  # transformers' own layer class


def test_swap_activations_hf_swaps_transformers_gelu_while_bert_is_built(tmp_path):
    data = passed(surgery(*readme_command("recipe=swap_activations_hf"), f"hydra.run.dir={tmp_path}"), tmp_path)
    assert [event["old_type"] for event in data["build"]] == ["GELUActivation"] * 2
    assert {event["new_type"] for event in data["build"]} == {"GELU"}


def test_any_model_a_factory_builds(tmp_path):
    data = passed(surgery(*readme_command("model=factory"), f"hydra.run.dir={tmp_path}"), tmp_path)
    assert data["model"] == "torchvision.models.resnet18"


def test_image_folder_of_generated_pngs_reports_accuracy(tmp_path):
    image_folder(tmp_path / "images", ("cat", "dog"), 3, (40, 48), seed=0)
    out = tmp_path / "run"
    args = [
        f"data.root={tmp_path / 'images'}" if arg == "data.root=images" else arg
        for arg in readme_command("data=imagefolder")
    ]
    data = passed(surgery(*args, f"hydra.run.dir={out}"), out)
    accuracy = data["accuracy"]
    assert 0.0 <= accuracy["reference"] <= 1.0 and accuracy["reference"] in {k / 6 for k in range(7)}
    too_few = surgery(*args, "model.num_classes=1", f"hydra.run.dir={tmp_path / 'few'}")  # labels 0 and 1
    assert too_few.returncode == 2 and "model.num_classes=1: the data has labels up to 1" in too_few.stderr


def test_image_folder_evaluation_takes_every_class_in_turn(tmp_path):
    from surgery.cli.config import DataConfig
    from surgery.tasks.image_folders import image_folder_batches

    root = image_folder(tmp_path / "images", ("a", "b", "c"), 4, (8, 8), seed=2)
    config = DataConfig(kind="imagefolder", root=str(root), image_size=8, batch_size=3, batches=2)
    evaluation = image_folder_batches(config, "test", 3, 2)
    assert [labels.tolist() for _, labels in evaluation] == [[0, 1, 2], [0, 1, 2]]  # not [0, 0, 0], [0, 1, 1]
    calibration = image_folder_batches(config, "train", 3)
    assert sum(len(labels) for _, labels in calibration) == 6  # the other six images


def test_hugging_face_image_classifier_on_an_image_folder_fine_tunes(tmp_path):
    image_folder(tmp_path / "images", ("a", "b"), 4, (32, 32), seed=1)
    out = tmp_path / "run"
    result = surgery(
        "recipe=prune_finetune_digits",
        "model=hf",
        "model.name=vit",
        "model.task=image_classification",
        "model.num_classes=2",
        "model.config={image_size: 32, patch_size: 8, hidden_size: 32, "
        "num_hidden_layers: 1, num_attention_heads: 2, intermediate_size: 64}",
        "data=imagefolder",
        f"data.root={tmp_path / 'images'}",
        "data.image_size=32",
        "data.batch_size=2",
        "data.batches=2",
        "finetune.epochs=1",
        f"hydra.run.dir={out}",
    )
    data = passed(result, out)
    assert data["finetune"]["steps"] >= 1 and "accuracy" in data


@pytest.mark.parametrize(
    "args,message",
    [
        (
            ["model=timm", "model.name=vit_tiny_patch16_22"],
            "model.name='vit_tiny_patch16_22': not a timm model (closest: vit_tiny_patch16_224",
        ),
        (["model=hf", "model.name=gtp2"], "model.name='gtp2': not a Hugging Face model type (closest: gpt2"),
        (
            ["model=hf", "model.name=gpt2", "model.task=translation"],
            "model.task='translation': must be one of causal_lm",
        ),
        (["model=factory"], "model._target_=None: model=factory needs the dotted path"),
        (
            ["model=factory", "model._target_=torchvision.models.resnet18", "model.kwargs={colour: 3}"],
            "model.kwargs={'colour': 3}: torchvision.models.resnet18 refused them",
        ),
        (["data=imagefolder"], "data.root"),
        (["data=imagefolder", "data.root=/nonexistent/images"], "data.root='/nonexistent/images': is not a folder"),
        (["model=hf", "model.path=/nonexistent"], "model.path='/nonexistent': is not a folder"),
        (
            ["model=hf", "model.name=gpt2", "model.config={n_layr: 1}", "data=tokens"],
            "model.config.n_layr=1: is not a setting of gpt2's config (closest: n_layer)",
        ),
        (
            ["model=hf", "model.name=gpt2", "model.task=image_classification"],
            "model.task='image_classification': gpt2 has no image_classification head",
        ),
        (["recipe=prune_vit_timm", "+model.kwargs.img_siz=64"], "vit_tiny_patch16_224 refused them"),
        (["model=factory", "model._target_=builtins.print"], "model._target_='builtins.print': returned a NoneType"),
        (["recipe=quantize_gpt2_hf", "data.seq_len=10000000000"], "data.seq_len=10000000000: one batch of"),
        (["recipe=quantize_gpt2_hf", "data.seq_len=1000"], "check data.seq_len (at most the model's positions)"),
    ],
)
def test_bad_model_and_data_settings_exit_2_with_one_line(tmp_path, args, message):
    result = surgery("recipe=prune_resnet50", *args, f"hydra.run.dir={tmp_path}")
    assert result.returncode == 2, result.stderr[-1500:]
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_a_missing_optional_package_names_the_extra_to_install():
    with pytest.raises(ConfigError, match=r"needs the no_such_package package: pip install 'surgery\[hf\]'"):
        _optional("no_such_package", "hf")


def test_token_batches_from_a_local_text_file_and_tokenizer(tmp_path):
    text = "surgery operates on models it does not own, and puts every change back exactly. " * 40
    (tmp_path / "corpus.txt").write_text(text)
    tokenizer = local_tokenizer(tmp_path / "tokenizer", text, 120)
    out = tmp_path / "run"
    data = passed(
        surgery(
            *readme_command("recipe=quantize_gpt2_hf"),
            f"data.text={tmp_path / 'corpus.txt'}",
            f"data.tokenizer={tokenizer}",
            f"hydra.run.dir={out}",
        ),
        out,
    )
    assert data["drift"]["cosine"] > 0.99
    tiny = surgery(
        "recipe=quantize_gpt2_hf",
        "model.config.vocab_size=16",
        f"data.text={tmp_path / 'corpus.txt'}",
        f"data.tokenizer={tokenizer}",
        f"hydra.run.dir={tmp_path / 'tiny'}",
    )
    assert tiny.returncode == 2 and "beyond the model's vocabulary of 16" in tiny.stderr, tiny.stderr[-1000:]


def test_a_local_pretrained_folder_keeps_its_own_config_and_labels(tmp_path):
    import transformers

    config = transformers.BertConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, vocab_size=100, num_labels=3
    )
    transformers.BertForSequenceClassification(config).save_pretrained(tmp_path / "bert", safe_serialization=True)
    out = tmp_path / "run"
    data = passed(
        surgery(
            "recipe=prune_resnet50",
            "model=hf",
            f"model.path={tmp_path / 'bert'}",
            "model.task=sequence_classification",
            "data=tokens",
            f"hydra.run.dir={out}",
        ),
        out,
    )
    assert data["model"] == str(tmp_path / "bert")  # not the recipe's resnet50
    from safetensors.torch import load_file

    assert load_file(str(out / "model.safetensors"))["classifier.weight"].shape == (3, 32)  # its 3 labels


def test_an_offloaded_llama_folder_is_quantized_block_by_block_and_streamed_as_the_run_in_memory(tmp_path):
    """``model.offload=true``: the same GPTQ recipe, the weights read block by block from the
    folder's shards; the streamed compressed-tensors export equals the in-memory run's, tensor
    for tensor, and the report gives the peak memory and the seconds per block."""
    from safetensors.torch import load_file
    from support import tiny_llama  # tests/support.py

    folder = tmp_path / "llama"
    tiny_llama(layers=3).save_pretrained(folder, max_shard_size="100KB")
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    common = ("recipe=quantize_gptq_llama", f"model.path={folder}", "export.format=compressed-tensors")
    common += ("quantize.weights.group_size=32", *RANDOM_TOKENS)  # the tiny Llama is 64 wide
    memory = surgery(*common, "~model.config", f"hydra.run.dir={tmp_path / 'memory'}")
    assert memory.returncode == 0, memory.stderr[-2000:]
    work = tmp_path / "blocks"
    offload = ("model.offload=true", f"model.offload_folder={work}", "data.activation_budget=0")  # all to disk
    run = surgery(*common, *offload, f"hydra.run.dir={tmp_path / 'off'}")
    assert run.returncode == 0, run.stderr[-2000:]
    found = report(tmp_path / "off")
    assert {c["name"]: c["passed"] for c in found["checks"]} == {"drift": True, "restore": True, "deploy": True}
    step = found["offloaded"]["steps"]["quantize"]
    assert step["blocks"] == 3 and step["seconds_per_block"] > 0 and step["spilled_bytes"] > 0
    assert found["offloaded"]["peak_memory_bytes"] >= found["offloaded"]["added_memory_bytes"] > 0
    assert "quantize: 3 blocks" in run.stdout and "offloaded: peak memory" in run.stdout and "spilled" in run.stdout
    assert (work / "quantize" / "manifest.json").is_file()  # kept: a run that dies starts again from it

    def tensors(export: Path) -> dict:
        return {k: v for shard in sorted(export.glob("*.safetensors")) for k, v in load_file(shard).items()}

    expected, streamed = tensors(tmp_path / "memory" / "export"), tensors(tmp_path / "off" / "export")
    assert expected.keys() == streamed.keys() and all(torch.equal(expected[k], streamed[k]) for k in expected)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before  # the source never changes


def test_an_offloaded_llama_rotated_then_quantized_streams_the_same_tensors_as_in_memory(tmp_path):
    from safetensors.torch import load_file
    from support import tiny_llama  # tests/support.py

    folder = tmp_path / "llama"
    tiny_llama(layers=2).save_pretrained(folder)
    common = ("recipe=quantize_gptq_llama", f"model.path={folder}", "export.format=compressed-tensors")
    common += ("quantize.weights.group_size=32", "quantize.method=rtn", "steps=[rotate,quantize]", "+rotate={}")
    common += RANDOM_TOKENS
    memory = surgery(*common, "~model.config", f"hydra.run.dir={tmp_path / 'memory'}")
    offloaded = surgery(*common, "model.offload=true", f"hydra.run.dir={tmp_path / 'off'}")
    assert memory.returncode == 0 and offloaded.returncode == 0, offloaded.stderr[-2000:]
    assert "rotate: 2 blocks" in offloaded.stdout

    def tensors(export: Path) -> dict:
        return {k: v for shard in sorted(export.glob("*.safetensors")) for k, v in load_file(shard).items()}

    expected, streamed = tensors(tmp_path / "memory" / "export"), tensors(tmp_path / "off" / "export")
    assert expected.keys() == streamed.keys() and all(torch.equal(expected[k], streamed[k]) for k in expected)


@pytest.mark.parametrize("kind", ["model.offload", "export.options.tokenizer"])
def test_a_folder_asking_to_run_its_code_is_refused_on_a_terminal_answered_yes(tmp_path, kind):
    """``model.offload=true`` reads the folder's config, ``+export.options.tokenizer`` a tokenizer:
    either asking for its own code (auto_map) is one line before transformers can ask."""
    from support import plant_code, tiny_llama, under_terminal  # tests/support.py

    model, tokenizer = tmp_path / "llama", tmp_path / "tokenizer"
    tiny_llama().save_pretrained(model)
    local_tokenizer(tokenizer, "surgery puts every change back exactly. " * 20, 40)
    if kind == "model.offload":
        marker = plant_code(model, "config.json", {"AutoConfig": "custom.Config"}, model_type="custom")
    else:
        auto_map = {"AutoTokenizer": ["custom.Tokenizer", None]}
        marker = plant_code(tokenizer, "tokenizer_config.json", auto_map, tokenizer_class="Custom")
    args = (
        "recipe=quantize_gptq_llama",
        f"model.path={model}",
        "model.offload=true",
        "export.format=compressed-tensors",
    )
    args += (f"+export.options.tokenizer={tokenizer}", f"hydra.run.dir={tmp_path / 'run'}")
    output = under_terminal(lambda: app_main(args), REPO, tmp_path / "hf")
    assert not marker.exists(), output[-2000:]
    assert "Do you wish to run the custom code" not in output
    assert re.search(r"error: \S+='[^']*': asks to run its own code \('auto_map' in \w+\.json\)", output), output[
        -2000:
    ]


def test_an_offloaded_mixtral_folder_transformers_saved_is_quantized_and_its_export_reloads(tmp_path):
    """A Mixtral folder holds its experts per expert (``block_sparse_moe.experts.0.w1``), as
    ``save_pretrained`` writes them: the offloaded run reads them through transformers' conversion,
    quantizes each expert as a layer of its own, and streams fused tensors transformers loads."""
    import transformers
    from safetensors.torch import load_file
    from support import tiny_moe  # tests/support.py

    folder, out = tmp_path / "mixtral", tmp_path / "off"
    model = tiny_moe("mixtral", layers=2)
    model.save_pretrained(folder)
    common = ("recipe=quantize_gptq_llama", f"model.path={folder}", "model.offload=true", "export.format=safetensors")
    tokens = (*RANDOM_TOKENS[:2], "checks.drift.min_cosine=0.9")  # 4 bits on a random 32-wide model: 0.958
    run = surgery(*common, "quantize.weights.group_size=16", *tokens, f"hydra.run.dir={out}")
    passed(run, out)
    assert report(out)["offloaded"]["steps"]["quantize"]["blocks"] == 2
    exported = load_file(out / "export.safetensors")
    experts = exported["model.layers.1.mlp.experts.down_proj"]
    assert not torch.equal(experts, model.model.layers[1].mlp.experts.down_proj)
    assert all(len(row[:16].unique()) <= 16 for row in experts[3])  # each expert's rows on their own 4-bit grids
    reload = tmp_path / "reload"
    model.config.save_pretrained(reload)
    (reload / "model.safetensors").write_bytes((out / "export.safetensors").read_bytes())
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(reload)
    assert all(torch.equal(reloaded.state_dict()[name], value) for name, value in exported.items())
