"""Build the model a run operates on, from a config, reproducibly."""

from __future__ import annotations

import difflib
from collections.abc import Callable

import torch
import torchvision
from torch import nn

from surgery.checkpoints import load_checkpoint
from surgery.config import ModelConfig
from surgery.errors import ConfigError


def torchvision_names() -> list[str]:
    """Names of torchvision's classification models."""
    return torchvision.models.list_models(module=torchvision.models)


def validate_model(config: ModelConfig) -> None:
    """Raise :class:`ConfigError` if ``config.name`` is not a model of ``config.source``."""
    names = torchvision_names()
    if config.name not in names:
        close = difflib.get_close_matches(config.name, names, n=4, cutoff=0.5)
        hint = f"closest: {', '.join(close)}" if close else "see torchvision.models.list_models(module=torchvision.models)"
        raise ConfigError("model.name", config.name, "not a torchvision classification model", hint)


def model_factory(config: ModelConfig, seed: int) -> Callable[[], nn.Module]:
    """A function building a fresh, identical model on each call (eval mode, same seed).

    Random initialisation is seeded with ``seed`` without disturbing the caller's RNG state;
    ``config.weights`` (a checkpoint path) is loaded with ``weights_only=True`` when set.
    """
    validate_model(config)

    def build() -> nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = torchvision.models.get_model(config.name, weights=None, num_classes=config.num_classes)
        if config.weights:
            load_checkpoint(model, config.weights, field="model.weights")
        return model.eval()

    return build
