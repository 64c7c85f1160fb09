"""Import a user's object from a dotted path named in a config, with one-line errors."""

from __future__ import annotations

import importlib
from typing import Any

from surgery.core.errors import ConfigError


def import_object(path: object, field: str, *, default_module: str | None = None) -> Any:
    """Import ``package.module.name`` (a bare ``name`` is looked up in ``default_module``).

    Raises :class:`ConfigError` naming ``field`` — never a raw exception — when the path is
    not an absolute dotted path, its module fails to import (whatever it raises), or the name
    is missing.

    Example:
        >>> import_object("torch.nn.SiLU", "build[0].to")
        <class 'torch.nn.modules.activation.SiLU'>
    """
    if not isinstance(path, str) or not path.strip():
        raise ConfigError(field, path, "must be a dotted import path such as 'package.module.name'")
    parts = path.split(".")
    if not all(part.isidentifier() for part in parts):
        raise ConfigError(
            field,
            path,
            "must be an absolute dotted path of Python names such as "
            "'package.module.name' (relative paths and empty parts are not allowed)",
        )
    module_name = ".".join(parts[:-1]) or default_module
    if module_name is None:
        raise ConfigError(field, path, "must name its module too, e.g. 'package.module.name'")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # noqa: BLE001 - a user module may raise anything while importing
        first = (str(err).strip().splitlines() or [""])[0][:160]
        raise ConfigError(field, path, f"could not be imported ({type(err).__name__}: {first})") from None
    try:
        return getattr(module, parts[-1])
    except AttributeError:
        raise ConfigError(field, path, f"could not be imported (module {module_name!r} has no {parts[-1]!r})") from None


def import_module_named(name: object, field: str) -> Any:
    """Import the module ``package.module`` (a plugin that registers steps, methods, tasks...);
    a one-line :class:`ConfigError` naming ``field`` when it cannot be."""
    if not isinstance(name, str) or not all(part.isidentifier() for part in name.split(".")):
        raise ConfigError(field, name, "must be a dotted module name such as 'package.module'")
    try:
        return importlib.import_module(name)
    except Exception as err:  # noqa: BLE001 - a user module may raise anything while importing
        first = (str(err).strip().splitlines() or [""])[0][:160]
        raise ConfigError(field, name, f"could not be imported ({type(err).__name__}: {first})") from None
