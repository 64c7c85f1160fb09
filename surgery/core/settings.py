"""Frozen settings classes built from what a caller or a config file gives."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

from surgery.core.errors import ConfigError, ConfigTypeError

Settings = TypeVar("Settings")


def whole_count(field: str, value: Any, what: str, *, at_least: int = 1, at_most: int, example: int) -> int:
    """``value`` as a whole number of ``what`` (steps, epochs, grid points) from ``at_least`` to
    ``at_most``: the most its method can use, so that a typo of ``10**9`` is refused in one line,
    not run for hours."""
    if isinstance(value, bool) or not isinstance(value, int) or not at_least <= value <= at_most:
        raise ConfigError(
            field, value, f"must be a whole number of {what} from {at_least} to {at_most:,} (e.g. {example})"
        )
    return value


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
