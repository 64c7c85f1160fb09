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


def spec_or_keywords(
    cls: type[Settings], spec: Any, keywords: Mapping[str, Any], field: str, also: tuple[str, ...] = ()
) -> Settings:
    """The one door from a verb's arguments to its frozen spec: ``spec`` itself (a ``cls``), or
    the spec the ``keywords`` make; a spec given with keywords that differ from ``cls``'s defaults
    too is refused in one line naming them (they would be ignored). A keyword that is no field of
    ``cls`` is refused in one line naming the allowed ones (``cls``'s fields, then the verb's own
    keywords ``also``).

    Example:
        >>> spec_or_keywords(PruneSpec, None, {"amount": 0.5, "scope": "global"}, "prune.spec")
    """
    check_keywords(cls, keywords, field.partition(".")[0], also)
    if spec is None:
        return cls(**keywords)
    if not isinstance(spec, cls):
        raise ConfigTypeError(field, spec, f"must be a {cls.__name__} (or pass the settings as keywords)")
    fields = cls.__dataclass_fields__  # type: ignore[attr-defined]
    differing = [name for name, value in keywords.items() if not _is_default(value, fields[name])]
    if differing:
        raise ConfigError(field, spec, f"is a {cls.__name__}: set {', '.join(differing)} in it, not also as keywords")
    return spec


def check_keywords(cls: type, keywords: Mapping[str, Any], verb: str, also: tuple[str, ...] = ()) -> None:
    """Refuse, in one line naming the allowed ones, a keyword of ``verb`` that is no field of ``cls``."""
    fields = list(cls.__dataclass_fields__)  # type: ignore[attr-defined]
    unknown = sorted(set(keywords) - set(fields))
    if unknown:
        raise ConfigTypeError(verb, unknown[0], f"unknown keyword; allowed: {', '.join([*fields, *also])}")


def _is_default(value: Any, field: Any) -> bool:
    """Whether ``value`` is the dataclass ``field``'s default (the same object, or equal to it)."""
    from dataclasses import MISSING

    default = field.default if field.default is not MISSING else field.default_factory()
    try:
        return value is default or bool(value == default)
    except (RuntimeError, ValueError, TypeError):  # values that do not compare to one truth (tensors)
        return False
