"""The optional runtimes of the deployment formats (the ``deploy`` extra), imported when used."""

from __future__ import annotations

import importlib
from types import ModuleType

from surgery.core.errors import ConfigError


def required(module: str, package: str) -> ModuleType:
    """Import ``module``, or say in one line which package the format needs."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ConfigError("export.format", package, f"needs {package}: pip install 'surgery[deploy]' ({err})") from None
