"""Build the model a run operates on, from a config, reproducibly."""

from __future__ import annotations

import contextlib
import difflib
from collections.abc import Iterable, Sequence

import torch
from torch import nn

from surgery.core.checkpoints import load_checkpoint
from surgery.cli.config import ModelConfig
from surgery.cli import digits, mnist1d, tinylm
from surgery.core.errors import ConfigError
from surgery.ops.intercept import Event, RuleNeverFiredError, intercept
from surgery.core.selection import describe
from surgery.ops.rules import Rule


SHIPPED = "shipped"  # model.weights value: the checkpoint shipped with surgery (digits_cnn, mnist1d_cnn)
SHIPPED_DATA = {"digits_cnn": "digits", "mnist1d_cnn": "mnist1d", "tinylm": "tinylm"}  # the data each was trained on
SHIPPED_MODELS = {"digits_cnn": (digits.DigitsCNN, digits.CHECKPOINT),  # source -> (class, trained checkpoint)
                  "mnist1d_cnn": (mnist1d.MNIST1DCNN, mnist1d.CHECKPOINT),
                  "tinylm": (tinylm.TinyLM, tinylm.CHECKPOINT)}


def torchvision_names() -> list[str]:
    """Names of torchvision's classification models."""
    import torchvision  # imported on use: a bad config is answered without paying for it

    return torchvision.models.list_models(module=torchvision.models)


def validate_model(config: ModelConfig) -> None:
    """Raise :class:`ConfigError` if ``config.name`` is not a model of ``config.source``."""
    if config.source in SHIPPED_MODELS:
        return
    names = torchvision_names()
    if config.name not in names:
        close = difflib.get_close_matches(config.name, names, n=4, cutoff=0.5)
        hint = f"closest: {', '.join(close)}" if close else "see torchvision.models.list_models(module=torchvision.models)"
        raise ConfigError("model.name", config.name, "not a torchvision classification model", hint)


class ModelBuilder:
    """Builds fresh, identical models on each call: seeded, in eval mode, with build rules.

    Random initialisation is seeded with ``seed`` without disturbing the caller's RNG state.
    ``rules`` are applied with :func:`surgery.ops.intercept` while the constructor runs; the
    events of the last build are in :attr:`events`. ``config.weights`` (a checkpoint path) is
    loaded with ``weights_only=True`` after construction.
    """

    def __init__(self, config: ModelConfig, seed: int, rules: Sequence[Rule] = ()) -> None:
        validate_model(config)
        self.config = config
        self.seed = seed
        self.rules = list(rules)
        self.events: list[Event] = []

    def architecture(self) -> nn.Module:
        """The model's class at its configured shape, without weights or build rules (what
        :func:`surgery.rebuild` builds on the meta device)."""
        return self._construct()

    def with_rules(self, rules: Sequence[Rule]) -> ModelBuilder:
        """The same model and seed with other build rules."""
        return ModelBuilder(self.config, self.seed, rules)

    def __call__(self) -> nn.Module:
        config = self.config
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            model, self.events = self._build()
        if config.weights:
            shipped = config.weights == SHIPPED and config.source in SHIPPED_MODELS
            path = SHIPPED_MODELS[config.source][1] if shipped else config.weights
            load_checkpoint(model, path, field="model.weights")
        return model.eval()

    def _build(self) -> tuple[nn.Module, list[Event]]:
        """Construct under the build rules; a rule that matched nothing is a ConfigError naming it."""
        try:
            with intercept(*self.rules, strict=True) if self.rules else contextlib.nullcontext([]) as log:
                model = self._construct()
        except RuleNeverFiredError as err:
            index = next(i for i, rule in enumerate(self.rules) if rule is err.rule)
            raise ConfigError(f"build[{index}].match", describe(err.rule.match), f"matched nothing while building "
                              f"{self.config.name}: the rule never fired", "print the model to see its classes "
                              "and attribute names") from None
        return model, list(log)

    def _construct(self) -> nn.Module:
        config = self.config
        try:
            if config.source in SHIPPED_MODELS:
                return SHIPPED_MODELS[config.source][0](num_classes=config.num_classes)
            import torchvision

            return torchvision.models.get_model(config.name, weights=None, num_classes=config.num_classes)
        except (RuntimeError, MemoryError, OverflowError) as err:  # e.g. model.num_classes=10**10
            first = " ".join(str(err).split())[:200]
            raise ConfigError("model.name", config.name, f"cannot be built with these settings (model.num_classes="
                              f"{config.num_classes}): {type(err).__name__}: {first}") from None


def check_runs(model: nn.Module, inputs: Iterable[torch.Tensor], name: str) -> None:
    """Raise :class:`ConfigError` if ``model`` cannot run on one sample of the run's data.

    A model that expects another image size or channel count fails here, with the shape and
    the model's own message, before any surgery or output.
    """
    sample = next(iter(inputs))[:1]
    try:
        with torch.no_grad():
            model(sample)
    except Exception as err:  # the model's own error, whatever its type
        first = str(err).strip().splitlines()[0][:160] if str(err).strip() else ""
        hint = f"use data={SHIPPED_DATA[name]}" if name in SHIPPED_DATA else \
            "set data.image_size and data.channels to what the model expects"
        raise ConfigError("data", f"shape {tuple(sample.shape)}", f"{name} fails on inputs of this shape "
                          f"({type(err).__name__}: {first}); {hint}") from None
