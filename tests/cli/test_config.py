"""Every shipped YAML composes and converts; bad values raise ConfigError naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from surgery.cli.config import RunConfig
from surgery.cli.config_loading import load_config
from surgery.core.errors import ConfigError

CONF = Path(__file__).resolve().parents[2] / "conf"
RECIPES = sorted(p.stem for p in (CONF.parent / "recipes").glob("*.yaml"))


def composed(*overrides: str) -> dict:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=list(overrides), return_hydra_config=True)
        container = OmegaConf.to_container(cfg, resolve=False)
        container["recipe"] = container.pop("hydra")["runtime"]["choices"]["recipe"]
        return container


def test_recipe_folder_is_the_recipe_group():
    assert (CONF / "recipe").resolve() == (CONF.parent / "recipes").resolve()
    assert "prune_resnet50" in RECIPES


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_shipped_recipe_composes_and_converts(recipe):
    config = load_config(composed(f"recipe={recipe}"))
    assert isinstance(config, RunConfig) and config.recipe == recipe
    assert config.steps or config.build or config.inspect or config.sensitivity


def test_prune_resnet50_defaults():
    config = load_config(composed("recipe=prune_resnet50"))
    assert (config.prune.amount, config.prune.method, config.prune.scope) == (0.5, "l1_unstructured", "layer")
    assert config.model.name == "resnet50" and config.data.kind == "synthetic"


def test_command_line_overrides_beat_the_recipe():
    config = load_config(composed("recipe=prune_resnet50", "model.name=vgg11", "prune.amount=0.25"))
    assert config.model.name == "vgg11" and config.prune.amount == 0.25


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("prune.amount=2", "prune.amount"),
        ("prune.method=magic", "prune.method"),
        ("prune.scope=everything", "prune.scope"),
        ("data.image_size=0", "data.image_size"),
        ("output.checkpoint=onnx", "output.checkpoint"),
        ("checks.enabled=[identity,vibes]", "checks.enabled"),
        ("steps=[]", "steps"),
        ("steps=[melt]", "steps"),
    ],
)
def test_bad_values_raise_config_error_naming_the_field(override, field):
    with pytest.raises(ConfigError) as caught:
        load_config(composed("recipe=prune_resnet50", override))
    assert str(caught.value).startswith(field)


def test_type_errors_are_config_errors_with_the_key():
    with pytest.raises(ConfigError, match="seed"):
        load_config(composed("recipe=prune_resnet50", "seed=abc"))


def test_a_config_without_sensitivity_runs_none():
    """The schema types ``sensitivity``; a config that does not set it must not get a default one
    (every run would then prune every layer at four amounts)."""
    config = load_config({"steps": ["prune"], "prune": {"amount": 0.5}})
    assert config.sensitivity is None
    assert load_config({"steps": ["sensitivity"], "sensitivity": {"amounts": [0.5]}}).sensitivity.amounts == [0.5]
    with pytest.raises(ConfigError, match=r"not in steps; add it: steps=\[sensitivity\]"):
        load_config({"steps": ["prune"], "prune": {}, "sensitivity": {"amounts": [0.5]}})


def test_export_options_without_a_format_are_refused():
    with pytest.raises(ConfigError, match=r"^export.options=\{'tokenizer': 'tok'\}: apply to an export; set export"):
        load_config({"export": {"options": {"tokenizer": "tok"}}})


def test_model_name_picks_which_shipped_folder_model_path_shipped_loads():
    from surgery.tasks.tinyllama import FOLDER as LLAMA
    from surgery.tasks.tinymoe import FOLDER as MOE
    from surgery.tasks.tinyqwen3 import FOLDER as QWEN3

    moe = load_config(composed("recipe=prune_experts_moe"))
    assert (moe.model.path, moe.model.name) == (str(MOE), "tinymoe")
    llama = load_config(composed("recipe=quantize_gptq_llama"))  # model.name=llama: the tiny Llama, as before
    assert (llama.model.path, llama.model.name) == (str(LLAMA), "tinyllama")
    qwen3 = load_config(composed("recipe=quantize_gptq_llama", "model.name=tinyqwen3"))
    assert (qwen3.model.path, qwen3.model.name) == (str(QWEN3), "tinyqwen3")


def test_the_imatrix_mse_observer_reaches_the_spec_and_asks_for_calibration():
    config = load_config(
        composed("recipe=quantize_gptq_llama", "quantize.method=rtn", "quantize.weights.observer=imatrix_mse")
    )
    assert config.quantize.weights.observer == "imatrix_mse" and config.quantize.weights.weighted
    assert config.quantize.calibrated  # rtn then takes its inputs' energy from a calibration pass
