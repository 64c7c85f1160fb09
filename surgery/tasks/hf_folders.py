"""Local Hugging Face folders named on the command line (a model, a tokenizer): refused when they
ask to run their own code, which transformers would otherwise offer to run at a prompt."""

from __future__ import annotations

import json
from pathlib import Path

from surgery.core.errors import ConfigError

CONFIG_FILES = ("config.json", "tokenizer_config.json", "preprocessor_config.json", "processor_config.json")


def read_config(folder: str | Path, name: str = "config.json") -> dict:
    """A JSON config file of a local folder as a dict (empty when missing or unreadable: the
    loader reports that itself)."""
    try:
        found = json.loads((Path(folder) / name).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def refuse_custom_code(folder: str | None, field: str) -> None:
    """Raise if a config file of ``folder`` has an ``auto_map`` (classes defined by the folder's
    own Python files); a missing or unreadable file is left to the loader to report."""
    if folder is None or not Path(folder).is_dir():
        return
    for name in CONFIG_FILES:
        if "auto_map" in read_config(folder, name):
            raise ConfigError(
                field,
                folder,
                f"asks to run its own code ('auto_map' in {name}); surgery never runs code "
                "from a model or data folder: use a folder of a class transformers ships",
            )
