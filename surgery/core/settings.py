"""Frozen settings classes built from what a caller or a config file gives."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

from surgery.core.errors import ConfigError, ConfigTypeError

Settings = TypeVar("Settings")


def settings_from(cls: type[Settings], value: Any, field: str) -> Settings:
    """``value`` as a ``cls`` (a frozen dataclass): itself, or built from a mapping of its
    fields; an unknown key is one line naming ``field`` and the allowed settings."""
    if isinstance(value, cls):
        return value
    if isinstance(value, Mapping):
        allowed = list(cls.__dataclass_fields__)  # type: ignore[attr-defined]
        unknown = sorted(set(value) - set(allowed))
        if unknown:
            raise ConfigError(field, unknown[0], f"unknown setting; allowed: {', '.join(allowed)}")
        return cls(**value)
    raise ConfigTypeError(field, value, f"must be a {cls.__name__} or a dict of its fields")
