"""The rotate step's settings: ``rotate.learn`` from a recipe or the command line becomes the
verb's LearnSpec, and a bad one is one line naming its field."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from surgery.cli.config_loading import load_config
from surgery.core.errors import ConfigError
from surgery.ops.equivalence.learned_rotation import LearnSpec

CONF = Path(__file__).resolve().parents[3] / "conf"


def config(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        overrides = ["recipe=quantize_gptq_llama", "steps=[rotate,quantize]", *overrides]
        container = OmegaConf.to_container(compose("config", overrides, return_hydra_config=True), resolve=False)
    container["recipe"] = container.pop("hydra")["runtime"]["choices"]["recipe"]  # as tests/cli/test_config.py
    return load_config(container)


def test_learn_settings_reach_the_verb_as_a_learn_spec():
    assert config("+rotate={}").rotate.learn is None
    assert config("+rotate={learn: true}").rotate.learn == LearnSpec()
    learn = config("+rotate={learn: {steps: 3, lr: 0.5, activations: {bits: 8, dynamic: token}}}").rotate.learn
    assert (learn.steps, learn.lr, learn.activations.bits, learn.activations.dynamic) == (3, 0.5, 8, "token")
    assert learn.weights == LearnSpec().weights


@pytest.mark.parametrize(
    ("learn", "message"),
    [("{steps: 0}", "rotate.learn.steps=0"), ("{lr: -1}", "rotate.learn.lr=-1"), ("{step: 3}", "rotate.learn.step=3")],
)
def test_bad_learn_settings_name_their_field(learn, message):
    with pytest.raises(ConfigError, match=rf"^{message}: "):
        config(f"+rotate={{learn: {learn}}}")
