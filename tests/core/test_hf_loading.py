"""The one door to transformers' loaders: a folder asking to run its own code is refused before
transformers can offer to run it (even on a terminal, answered yes), and only model classes
are taken from ``architectures``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support import local_tokenizer, plant_code, tiny_llama, under_terminal  # tests/support.py

from surgery.core.errors import ConfigError
from surgery.core.hf_loading import model_class

transformers = pytest.importorskip("transformers")


def offloaded(folder: Path, tmp_path: Path) -> None:
    import surgery

    surgery.offloaded(folder)


def exported_with(tokenizer: Path, tmp_path: Path) -> None:
    import surgery

    tiny_llama().save_pretrained(tmp_path / "m")
    done = surgery.quantize(
        surgery.offloaded(tmp_path / "m"), weights=surgery.GridSpec(bits=4, group_size=32), progress=False
    )
    surgery.export(done, tmp_path / "out", format="compressed-tensors", tokenizer=tokenizer)


def planted(tmp_path: Path, kind: str) -> tuple[Path, Path]:
    """A model folder whose config, or a tokenizer folder whose tokenizer_config, asks for custom.py."""
    folder = tmp_path / kind
    if kind == "model":
        tiny_llama().save_pretrained(folder)
        return folder, plant_code(folder, "config.json", {"AutoConfig": "custom.Config"}, model_type="custom")
    local_tokenizer(folder, "surgery puts every change back exactly. " * 20, 40)
    auto_map = {"AutoTokenizer": ["custom.Tokenizer", None]}
    return folder, plant_code(folder, "tokenizer_config.json", auto_map, tokenizer_class="Custom")


@pytest.mark.parametrize("kind, work", [("model", offloaded), ("tokenizer", exported_with)])
def test_a_folder_asking_to_run_its_code_is_refused_before_transformers_can_ask(tmp_path, kind, work):
    folder, marker = planted(tmp_path, kind)
    output = under_terminal(
        lambda: work(folder, tmp_path), tmp_path, tmp_path / "hf"
    )  # "y" typed ahead  # "y" typed ahead to any prompt
    assert not marker.exists(), output[-2000:]
    assert "Do you wish to run the custom code" not in output
    assert "asks to run its own code ('auto_map' in" in output, output[-2000:]


@pytest.mark.parametrize("name", ["AutoModel", "pipeline", "TrainingArguments", "__class__", 3, None])
def test_only_a_model_class_is_taken_from_architectures(name):
    with pytest.raises(ConfigError, match="names no transformers model class") as err:
        model_class(transformers, name, "offloaded.source", "config.json")
    assert "\n" not in str(err.value)
    assert model_class(transformers, "LlamaForCausalLM", "f", "x") is transformers.LlamaForCausalLM


def test_an_offloaded_folder_naming_another_attribute_of_transformers_is_one_line(tmp_path):
    import surgery

    tiny_llama().save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "architectures": ["pipeline"]}))
    with pytest.raises(ConfigError, match=r"names no transformers model class \(architectures: 'pipeline'\)"):
        surgery.offloaded(tmp_path)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"architectures": {"a": 1}}, r"names no transformers model class"),
        ({"architectures": ["PreTrainedModel"]}, r"names no transformers model class"),
        ({"architectures": ["LlamaPreTrainedModel"]}, r"names no transformers model class"),
        ({"architectures": ["BertModel"]}, r"names BertModel, which is built from a BertConfig, but the config is a"),
        ({"text_config": {"auto_map": {"AutoConfig": "custom.Config"}}}, r"is not a model config LlamaForCausalLM"),
    ],
    ids=["dict", "base-class", "family-base-class", "other-family", "nested-auto-map"],
)
def test_an_offloaded_folder_whose_config_cannot_build_its_weights_is_one_line(tmp_path, edit, message):
    """A base class would build a model with no layers and ignore every weight; another family's
    class would fail deep inside transformers."""
    import surgery

    tiny_llama().save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **edit}))
    with pytest.raises(ConfigError, match=message) as err:
        surgery.offloaded(tmp_path)
    assert "\n" not in str(err.value)
