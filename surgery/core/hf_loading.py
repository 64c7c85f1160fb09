"""The one door to transformers' loaders for local Hugging Face folders (a model, a config, a
tokenizer): a folder that asks to run its own code (``auto_map``) is refused before
transformers is called, which would otherwise offer to run it at a prompt on a terminal; every
load passes ``trust_remote_code=False``; a class named in a data file (``architectures``) is
taken only when it is a model class transformers ships."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

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


def refuse_custom_code(folder: str | Path | None, field: str) -> None:
    """Raise if a config file of ``folder`` has an ``auto_map`` (classes defined by the folder's
    own Python files); a missing or unreadable file is left to the loader to report."""
    if folder is None or not Path(folder).is_dir():
        return
    for name in CONFIG_FILES:
        if "auto_map" in read_config(folder, name):
            raise ConfigError(
                field,
                str(folder),
                f"asks to run its own code ('auto_map' in {name}); surgery never runs code "
                "from a model or data folder: use a folder of a class transformers ships",
            )


def from_pretrained(loader: Any, folder: str | Path, field: str, **options: Any) -> Any:
    """``loader.from_pretrained(folder)`` (a transformers class: ``AutoConfig``,
    ``AutoTokenizer``, a model class) from local files only, never running the folder's code."""
    refuse_custom_code(folder, field)
    return loader.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False, **options)


def model_class(transformers: Any, name: object, field: str, where: str | Path, config: Any = None) -> type:
    """The transformers model class ``name`` (read from ``architectures`` in ``where``): only a
    concrete subclass of ``PreTrainedModel`` that transformers ships (never another attribute of
    it, nor a base class that would build a model with no layers), made for ``config``'s kind."""
    found = getattr(transformers, name, None) if isinstance(name, str) and name.isidentifier() else None
    concrete = isinstance(found, type) and issubclass(found, transformers.PreTrainedModel)
    if not concrete or found.__name__.endswith("PreTrainedModel"):
        raise ConfigError(
            field,
            str(where),
            f"names no transformers model class (architectures: {name!r}); "
            "allowed: a PreTrainedModel class transformers ships, such as 'LlamaForCausalLM'",
        )
    made_for = getattr(found, "config_class", None)
    if config is not None and isinstance(made_for, type) and not isinstance(config, made_for):
        raise ConfigError(
            field,
            str(where),
            f"names {name}, which is built from a {made_for.__name__}, but the config is a {type(config).__name__}",
        )
    return found
