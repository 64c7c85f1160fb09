"""The one door to transformers' loaders for local Hugging Face folders (a model, a config, a
tokenizer): a folder that asks to run its own code (``auto_map``) is refused before
transformers is called, which would otherwise offer to run it at a prompt on a terminal; every
load passes ``trust_remote_code=False``; a class named in a data file (``architectures``) is
taken only when it is a model class transformers ships."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from surgery.core.errors import ConfigError, first_line

CONFIG_FILES = ("config.json", "tokenizer_config.json", "preprocessor_config.json", "processor_config.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json")


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


def load_tokenizer(folder: str | Path, field: str) -> Any:
    """The tokenizer saved in the local ``folder``, every way it can be broken said in one line
    naming ``field`` and the file: not a folder, a JSON file that is not UTF-8, not JSON or not an
    object, a ``tokenizer.json`` without its model or with malformed added tokens, a folder asking
    to run its own code (``auto_map``, whatever its value), or anything else transformers raises."""
    path = check_tokenizer_folder(folder, field)
    from transformers import AutoTokenizer

    try:
        return from_pretrained(AutoTokenizer, path, field)
    except Exception as err:  # noqa: BLE001 - whatever a broken tokenizer folder raises
        raise ConfigError(field, str(folder), f"cannot be loaded as a tokenizer ({first_line(err, 200)})") from None


def check_tokenizer_folder(folder: str | Path, field: str) -> Path:
    """What :func:`load_tokenizer` refuses before transformers is called (a run checks it before its
    work): ``folder`` not a local folder, a broken JSON file in it, an ``auto_map``."""
    path = Path(folder)
    if not path.is_dir():  # transformers would take the name for a hub repository
        raise ConfigError(field, str(folder), "must be a local tokenizer folder")
    for name in (*TOKENIZER_FILES, "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja"):
        if (path / name).is_file():
            if name in TOKENIZER_FILES:
                _check_tokenizer_file(path / name, field)
        elif os.path.lexists(path / name):  # a FIFO would block the reader for ever; a folder, a dangling link
            raise ConfigError(field, str(path / name), "is not a regular file")
    refuse_custom_code(path, field)
    return path


def _check_tokenizer_file(file: Path, field: str) -> None:
    """Refuse a tokenizer's JSON file that is not UTF-8, not JSON, not an object, or (``tokenizer.json``)
    has no model or malformed added tokens."""
    try:
        found = json.loads(file.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as err:
        raise ConfigError(field, str(file), f"is not UTF-8 text (byte {err.start}: {err.reason})") from None
    except ValueError as err:
        raise ConfigError(field, str(file), f"is not JSON ({first_line(err, 120)}); is it cut short?") from None
    if not isinstance(found, dict):
        raise ConfigError(field, str(file), f"must hold a JSON object, not a {type(found).__name__}")
    if file.name != "tokenizer.json":
        return
    model = found.get("model")
    if not isinstance(model, dict) or not isinstance(model.get("type", "BPE"), str):
        raise ConfigError(field, str(file), "has no 'model' object (the tokenizer's vocabulary and its kind)")
    vocab = model.get("vocab")
    if isinstance(vocab, dict):  # one id given two tokens: transformers keeps one, silently
        by_id: dict[Any, str] = {}
        for token, index in vocab.items():
            if index in by_id:
                raise ConfigError(field, str(file), f"gives id {index} to both {by_id[index]!r} and {token!r}")
            by_id[index] = token
    added = found.get("added_tokens", [])
    if not isinstance(added, list):
        raise ConfigError(field, str(file), f"has added_tokens of type {type(added).__name__}; it must be a list")
    bad = next((a for a in added if not _well_formed_added(a)), None)
    if bad is not None:
        raise ConfigError(
            field,
            str(file),
            f"has a malformed added token {str(bad)[:80]!r}: each needs an integer id >= 0 and a string content",
        )


def _well_formed_added(token: object) -> bool:
    return (
        isinstance(token, dict)
        and isinstance(token.get("id"), int)
        and not isinstance(token.get("id"), bool)
        and token["id"] >= 0
        and isinstance(token.get("content"), str)
    )
