"""Build the model a run operates on, from a config, reproducibly."""

from __future__ import annotations

import contextlib
import difflib
import importlib
import os
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from safetensors import SafetensorError
from torch import nn

from surgery.cli.config import ModelConfig
from surgery.cli.outputs import describe_batch, first_sample
from surgery.core.checkpoints import load_checkpoint
from surgery.core.errors import NO_VALUE, ConfigError
from surgery.core.hf_loading import from_pretrained, read_config, refuse_custom_code
from surgery.core.importing import import_object
from surgery.core.inputs import as_call
from surgery.core.selection import describe
from surgery.ops.build.intercept import Event, RuleNeverFiredError, intercept
from surgery.ops.build.rules import Rule
from surgery.tasks import digits, mnist1d, tinylm

SHIPPED = "shipped"  # model.weights value: the checkpoint shipped with surgery (digits_cnn, mnist1d_cnn)
SHIPPED_DATA = {"digits_cnn": "digits", "mnist1d_cnn": "mnist1d", "tinylm": "tinylm"}  # the data each was trained on
SHIPPED_MODELS = {
    "digits_cnn": (digits.DigitsCNN, digits.CHECKPOINT),  # source -> (class, trained checkpoint)
    "mnist1d_cnn": (mnist1d.MNIST1DCNN, mnist1d.CHECKPOINT),
    "tinylm": (tinylm.TinyLM, tinylm.CHECKPOINT),
}


def torchvision_names() -> list[str]:
    """Names of torchvision's classification models."""
    import torchvision  # imported on use: a bad config is answered without paying for it

    return torchvision.models.list_models(module=torchvision.models)


def validate_model(config: ModelConfig) -> None:
    """Raise :class:`ConfigError` if ``config.name`` is not a model of ``config.source`` (with
    the closest names), or if the source's package is missing (naming the extra to install)."""
    if config.source in SHIPPED_MODELS or config.source == "factory":
        return
    if config.source == "hf" and config.path is not None:
        if not os.path.isdir(config.path):
            raise ConfigError(
                "model.path",
                config.path,
                "is not a folder (a local pretrained model: config.json and model.safetensors)",
            )
        return
    names, what, where = {
        "torchvision": (
            torchvision_names,
            "a torchvision classification model",
            "see torchvision.models.list_models(module=torchvision.models)",
        ),
        "timm": (_timm_names, "a timm model", "see timm.list_models()"),
        "hf": (_hf_names, "a Hugging Face model type", "see transformers.CONFIG_MAPPING (gpt2, bert, llama, vit...)"),
    }[config.source]
    known = names()
    if config.name not in known:
        close = difflib.get_close_matches(config.name, known, n=4, cutoff=0.5)
        raise ConfigError("model.name", config.name, f"not {what}", f"closest: {', '.join(close)}" if close else where)


def _optional(package: str, extra: str) -> Any:
    """Import an optional package, or a one-line error naming the extra that installs it."""
    try:
        return importlib.import_module(package)
    except ImportError:
        raise ConfigError(
            "model.source", package, f"needs the {package} package: pip install 'surgery[{extra}]'"
        ) from None


def _timm_names() -> list[str]:
    return _optional("timm", "timm").list_models()


def _hf_names() -> list[str]:
    return list(_optional("transformers", "hf").CONFIG_MAPPING.keys())


HF_HEADS = {
    "causal_lm": "AutoModelForCausalLM",
    "sequence_classification": "AutoModelForSequenceClassification",
    "image_classification": "AutoModelForImageClassification",
}


def _build_hf(config: ModelConfig) -> nn.Module:
    """A Hugging Face model built offline: from a config (random weights), or a local folder
    (its own config and labels; ``model.config`` entries override them)."""
    transformers = _optional("transformers", "hf")
    transformers.logging.set_verbosity_error()  # its load reports and warnings are not ours to print
    transformers.utils.logging.disable_progress_bar()
    head = getattr(transformers, HF_HEADS[config.task])
    settings = dict(config.config)
    own: dict[str, Any] = {}
    if config.path is None:
        _check_hf_keys(transformers, config.name, settings)
        if config.task != "causal_lm":
            settings.setdefault("num_labels", config.num_classes)
    else:
        refuse_custom_code(config.path, "model.path")
        own = read_config(config.path)
        if own.get("model_type") in transformers.CONFIG_MAPPING:
            _check_hf_keys(transformers, own["model_type"], settings)
    if config.task == "causal_lm":
        settings.setdefault("use_cache", False)  # no key/value cache between the checks' forwards
    try:
        dtype = getattr(torch, config.dtype)  # as transformers loads it: rotary tables stay float32
        if config.path is not None:
            return from_pretrained(head, config.path, "model.path", use_safetensors=True, dtype=dtype, **settings)
        return head.from_config(transformers.AutoConfig.for_model(config.name, **settings), dtype=dtype)
    except (ValueError, TypeError, KeyError, OSError, RuntimeError, SafetensorError) as err:
        first = " ".join(str(err).split()).split(". ")[0][:160]
        differing = [key for key, value in settings.items() if key in own and own[key] != value]
        if differing and isinstance(err, RuntimeError):
            key = differing[0]
            raise ConfigError(
                f"model.config.{key}",
                settings[key],
                f"differs from {own[key]!r} in "
                f"{config.path}/config.json, and the folder's weights have its sizes; drop the "
                "override (model.config=null drops all of it, a recipe's own included)",
            ) from None
        if isinstance(err, SafetensorError) or "safetensors" in first.lower() and isinstance(err, OSError):
            raise ConfigError(
                "model.path",
                config.path,
                f"holds a corrupted or truncated safetensors file ({type(err).__name__}: {first})",
            ) from None
        if "Unrecognized configuration class" in first:
            raise ConfigError(
                "model.task", config.task, f"{config.name} has no {config.task} head; allowed: {', '.join(HF_HEADS)}"
            ) from None
        raise ConfigError(
            "model.config" if config.path is None else "model.path",
            config.name if config.path is None else config.path,
            f"cannot build a {config.task} model: {type(err).__name__}: {first}",
        ) from None


def _check_hf_keys(transformers: Any, name: str, settings: dict[str, Any]) -> None:
    """Every ``model.config`` key must be a setting of the model type's config (a typo would
    otherwise be kept as an unused attribute, silently building the default model)."""
    defaults = transformers.CONFIG_MAPPING[name]()
    known = [key for key in vars(defaults) if not key.startswith("_")] + list(getattr(defaults, "attribute_map", {}))
    for key in settings:
        if not hasattr(defaults, key):
            close = difflib.get_close_matches(key, known, n=3, cutoff=0.6)
            raise ConfigError(
                f"model.config.{key}",
                settings[key],
                f"is not a setting of {name}'s config",
                f"closest: {', '.join(close)}" if close else f"see transformers.{type(defaults).__name__}",
            )


def _build_timm(config: ModelConfig) -> nn.Module:
    timm = _optional("timm", "timm")
    try:
        return timm.create_model(config.name, pretrained=False, num_classes=config.num_classes, **config.kwargs)
    except TypeError as err:  # an argument the model's constructor does not take
        raise ConfigError("model.kwargs", dict(config.kwargs), f"{config.name} refused them: {err}") from None


def _build_factory(config: ModelConfig) -> nn.Module:
    """``model._target_(**model.kwargs)``; kwargs may hold their own ``_target_`` objects
    (Hydra ``instantiate``, ``_partial_: true`` for a class or function to pass along)."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    target = import_object(config._target_, "model._target_")
    if not callable(target):
        raise ConfigError("model._target_", config._target_, "is not callable")
    try:
        kwargs = instantiate(dict(config.kwargs), _convert_="all")
    except InstantiationException as err:
        raise ConfigError("model.kwargs", NO_VALUE, " ".join(str(err).split())[:200]) from None
    try:
        model = target(**kwargs)
    except TypeError as err:
        raise ConfigError("model.kwargs", dict(config.kwargs), f"{config._target_} refused them: {err}") from None
    except Exception as err:  # the factory's own failure, whatever its type
        first = " ".join(str(err).split())[:160]
        raise ConfigError("model._target_", config._target_, f"raised {type(err).__name__}: {first}") from None
    if not isinstance(model, nn.Module):
        raise ConfigError("model._target_", config._target_, f"returned a {type(model).__name__}, not an nn.Module")
    return model


def _build_torchvision(config: ModelConfig) -> nn.Module:
    import torchvision

    return torchvision.models.get_model(config.name, weights=None, num_classes=config.num_classes)


BUILDERS = {"torchvision": _build_torchvision, "timm": _build_timm, "hf": _build_hf, "factory": _build_factory}


class ModelBuilder:
    """Builds fresh, identical models on each call: seeded, in eval mode, with build rules.

    Random initialisation is seeded with ``seed`` without disturbing the caller's RNG state.
    ``rules`` are applied with :func:`surgery.ops.build.intercept` while the constructor runs; the
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
        if config.source != "hf":  # a Hugging Face model is built in its dtype (_build_hf)
            model = model.to(getattr(torch, config.dtype))
        return model.to(config.device).eval()

    def _build(self) -> tuple[nn.Module, list[Event]]:
        """Construct under the build rules; a rule that matched nothing is a ConfigError naming it."""
        try:
            with intercept(*self.rules, strict=True) if self.rules else contextlib.nullcontext([]) as log:
                model = self._construct()
        except RuleNeverFiredError as err:
            index = next(i for i, rule in enumerate(self.rules) if rule is err.rule)
            raise ConfigError(
                f"build[{index}].match",
                describe(err.rule.match),
                f"matched nothing while building {self.config.name}: the rule never fired",
                "print the model to see its classes and attribute names",
            ) from None
        return model, list(log)

    def _construct(self) -> nn.Module:
        config = self.config
        try:
            if config.source in SHIPPED_MODELS:
                return SHIPPED_MODELS[config.source][0](num_classes=config.num_classes)
            return BUILDERS[config.source](config)
        except (RuntimeError, MemoryError, OverflowError) as err:  # e.g. model.num_classes=10**10
            first = " ".join(str(err).split())[:200]
            raise ConfigError(
                "model.name",
                config.name,
                f"cannot be built with these settings (model.num_classes="
                f"{config.num_classes}): {type(err).__name__}: {first}",
            ) from None


def check_runs(model: nn.Module, inputs: Iterable[torch.Tensor], name: str) -> None:
    """Raise :class:`ConfigError` if ``model`` cannot run on one sample of the run's data.

    A model that expects another image size or channel count fails here, with the shape and
    the model's own message, before any surgery or output.
    """
    sample = first_sample(next(iter(inputs)))
    try:
        with torch.no_grad():
            as_call(sample, "data")(model)
    except Exception as err:  # the model's own error, whatever its type
        first = str(err).strip().splitlines()[0][:160] if str(err).strip() else ""
        hint = (
            f"use data={SHIPPED_DATA[name]}"
            if name in SHIPPED_DATA
            else "check data.seq_len (at most the model's positions) and data.vocab_size (at most its vocabulary)"
            if isinstance(sample, dict)
            else "set data.image_size and data.channels to what the model expects"
        )
        raise ConfigError(
            "data",
            f"shape {describe_batch(sample)}",
            f"{name} fails on inputs of this shape ({type(err).__name__}: {first}); {hint}",
        ) from None
