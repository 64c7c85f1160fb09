"""A composed recipe (YAML, with overrides) validated into a :class:`RunConfig`: built-in steps' sections typed by their settings, plugin steps' by theirs, every error one line naming the key."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, InterpolationResolutionError, OmegaConfBaseException

from surgery.cli.config import BUILT_IN_STEPS, AttributionConfig, ObjectiveConfig, RunConfig
from surgery.cli.steps import STEPS
from surgery.core.errors import NO_VALUE, ConfigError
from surgery.core.importing import import_module_named

INT64 = (-(1 << 63), (1 << 63) - 1)


def load_config(cfg: DictConfig | dict) -> RunConfig:
    """Validate a composed YAML config against :class:`RunConfig` and return the dataclass.

    Interpolations (``${...}``) are resolved first; every integer must fit in 64 bits.

    Raises:
        ConfigError: naming the first offending field, its value and what is allowed.
    """
    try:
        if isinstance(cfg, DictConfig):
            cfg = OmegaConf.to_container(cfg, resolve=True)
        _check_integers(cfg, "")
        cfg = {"sensitivity": None, "objective": None, **cfg}  # typed by the schema; absent = not used
        plugin_steps = {name: _load_settings(name, section) for name, section in _plugin_sections(cfg).items()}
        cfg["step_settings"] = {name: {} for name in plugin_steps}  # present while RunConfig validates
        schema = OmegaConf.structured(
            RunConfig(
                steps=["sensitivity"],
                objective=ObjectiveConfig(maximize="sparsity"),
                attribution=AttributionConfig() if isinstance(cfg.get("attribution"), dict) else None,
                **{name: _schema_of(STEPS.get(name).settings, cfg.get(name), name) for name in BUILT_IN_STEPS},
            )
        )
        _writable(schema)
        config = OmegaConf.to_object(OmegaConf.merge(schema, cfg))
        config.step_settings = plugin_steps
        return config
    except OmegaConfBaseException as err:
        cause = err.__cause__ if isinstance(err.__cause__, ConfigError) else None
        if cause is not None:
            raise cause from None
        key = getattr(err, "full_key", None) or "config"
        message = " ".join(str(err).splitlines()[0].split()) if str(err) else type(err).__name__
        if isinstance(err, ConfigKeyError):
            raise ConfigError(key, NO_VALUE, f"not a setting here ({message})") from None
        if isinstance(err, InterpolationResolutionError):
            raise ConfigError(key, NO_VALUE, f"cannot be resolved: {message}") from None
        raise ConfigError(key, _value_of(err), message) from None


def _plugin_sections(cfg: dict[str, Any]) -> dict[str, Any]:
    """Import ``cfg["plugins"]`` and take out the sections of the steps they registered."""
    plugins = cfg.get("plugins") or []
    if not isinstance(plugins, list):
        raise ConfigError("plugins", plugins, "must be a list of module names, e.g. [mypackage.steps]")
    for index, module in enumerate(plugins):
        import_module_named(module, f"plugins[{index}]")
    names = [name for name in STEPS.names() if name not in BUILT_IN_STEPS]
    return {name: cfg.pop(name) for name in names if cfg.get(name) is not None}


def _load_settings(step: str, section: Any) -> Any:
    """A plugin step's ``section``, validated by its settings class."""
    settings = STEPS.get(step).settings
    if not isinstance(section, dict):
        raise ConfigError(step, section, f"must be a mapping of {settings.__name__}'s fields")
    schema = OmegaConf.structured(_schema_of(settings, section, step))
    _writable(schema)
    try:
        return OmegaConf.to_object(OmegaConf.merge(schema, section))
    except OmegaConfBaseException as err:
        if isinstance(err.__cause__, ConfigError):
            raise err.__cause__ from None
        key = f"{step}.{getattr(err, 'full_key', '') or ''}".rstrip(".")
        raise ConfigError(key, NO_VALUE, " ".join(str(err).splitlines()[0].split())) from None


def _schema_of(settings: type, section: Any, prefix: str) -> Any:
    """An instance of ``settings`` at its defaults to merge ``section`` into; a nested
    dataclass field that defaults to None but is given in ``section`` starts at its class's
    defaults, so the merge fills a writable node (a frozen dataclass's node is read-only).
    A nested spec with a ``build(values, field)`` validates its values first, so its errors
    name the field as the config spells it (``quantize.weights.bits``)."""
    hints, defaults = typing.get_type_hints(settings), settings()
    nested = {}
    for item in dataclasses.fields(settings):
        value = section.get(item.name) if isinstance(section, dict) else None
        kind = next((t for t in typing.get_args(hints[item.name]) if dataclasses.is_dataclass(t)), None)
        if kind is None or not isinstance(value, dict):
            continue
        current = getattr(defaults, item.name)
        if callable(getattr(kind, "build", None)):
            base = {} if current is None else {f.name: getattr(current, f.name) for f in dataclasses.fields(kind)}
            kind.build(base | value, f"{prefix}.{item.name}")
        if current is None:
            nested[item.name] = _schema_of(kind, value, f"{prefix}.{item.name}")
    return dataclasses.replace(defaults, **nested) if nested else defaults


def _writable(config: Any) -> None:
    """Clear the read-only flag a frozen dataclass sets on its structured config (and its
    nested ones), so a recipe's values can be merged in; the dataclass stays frozen."""
    OmegaConf.set_readonly(config, None)
    for key in config if isinstance(config, DictConfig) else range(len(config)):
        child = config[key]  # a None or missing node reads as None or raises; neither needs the flag
        if isinstance(child, (DictConfig, ListConfig)):
            _writable(child)


def _check_integers(value: Any, key: str) -> None:
    """Refuse integers outside 64 bits (seeds, counts, amounts typed as huge integers) by name."""
    if isinstance(value, int) and not isinstance(value, bool) and not INT64[0] <= value <= INT64[1]:
        raise ConfigError(
            key,
            f"a {len(str(abs(value)))}-digit integer",
            f"is out of range: numbers must fit in 64 bits ([{INT64[0]}, {INT64[1]}])",
        )
    if isinstance(value, dict):
        for name, item in value.items():
            _check_integers(item, f"{key}.{name}" if key else str(name))
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _check_integers(item, f"{key}.{index}")


def _value_of(err: OmegaConfBaseException) -> object:
    value = getattr(err, "value", None)
    return value if isinstance(value, (int, float, str, bool, type(None))) else str(value)
