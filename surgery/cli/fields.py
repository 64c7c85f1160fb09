"""Small validators shared by the command line's settings, and the reader of an amounts file (``prune.amounts=PATH``)."""

from __future__ import annotations

import os
from typing import Any

import yaml

from surgery.core.errors import ConfigError


def positive_int(name: str, value: int) -> None:
    if value < 1:
        raise ConfigError(name, value, "must be an integer >= 1")


def one_of(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(name, value, f"must be one of {', '.join(allowed)}")


class _PlainYaml(yaml.SafeLoader):
    """Safe YAML without anchors and aliases: an amounts file is a flat mapping, and nested aliases
    (a "billion laughs" file of 1 kB) would expand for minutes."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.events.AliasEvent) or getattr(self.peek_event(), "anchor", None):
            raise yaml.composer.ComposerError(
                None, None, "anchors and aliases are not allowed in an amounts file", self.peek_event().start_mark
            )
        return super().compose_node(parent, index)


AMOUNTS_BYTES = 10 * 2**20


def read_amounts_yaml(path: str, field: str) -> Any:
    """An amounts file (``{layer: amount}``) read as plain YAML: at most 10 MiB, no tags beyond
    the safe ones, no aliases."""
    try:
        if os.path.getsize(path) > AMOUNTS_BYTES:
            raise ConfigError(
                field, path, f"is larger than {AMOUNTS_BYTES // 2**20} MiB; an amounts file lists one amount per layer"
            )
        with open(path, encoding="utf-8") as handle:
            return yaml.load(handle, Loader=_PlainYaml)  # noqa: S506 - a SafeLoader subclass
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(field, path, f"cannot be read as an amounts YAML file ({type(err).__name__})") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or type(err).__name__
        raise ConfigError(
            field, path, f"is not a plain YAML amounts file{where} ({' '.join(str(problem).split())[:120]})"
        ) from None
