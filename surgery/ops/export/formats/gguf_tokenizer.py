"""The vocabulary a GGUF file carries, so llama.cpp turns text into the model's token ids: a
byte-level model's 256 bytes (GPT-2's byte to character map, no merges), or a Hugging Face
tokenizer that llama.cpp's tokenizers can reproduce: byte-level BPE with GPT-2's split (llama.cpp's
``gpt2`` model, ``gpt-2`` pre-tokenizer), its tokens, merges, special tokens and chat template.
Any other tokenizer is refused in one line (llama.cpp would split text otherwise)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from surgery.core.errors import ConfigError

log = logging.getLogger("surgery")
FIELD = "export.options.tokenizer"
GPT2_SPLIT = {"type": "ByteLevel", "use_regex": True, "add_prefix_space": False}  # GPT-2's regex, then bytes
SPECIAL = ("bos", "eos", "unk", "pad")


@dataclass
class Vocabulary:
    """What the file's ``tokenizer.ggml.*`` keys hold: ``model``/``pre`` llama.cpp's names; for
    a tokenizer, its tokens by id, their kinds, its merges, special ids and chat template."""

    model: str
    pre: str | None = None
    tokens: list[str] = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)  # normal, control (special), user_defined (added)
    merges: list[str] = field(default_factory=list)
    special: dict[str, int] = field(default_factory=dict)
    add_bos: bool | None = None  # written for a tokenizer: whether llama.cpp puts its bos first
    chat_template: str | None = None


def vocabulary(tokenizer: Any, config: Any, bytes_to_unicode: Any) -> Vocabulary:
    """The vocabulary to write for ``config``'s model: ``tokenizer``'s (a Hugging Face fast
    tokenizer, or the folder it was saved in), checked; else a 256-token model's bytes; else none."""
    size = int(config.vocab_size)
    if tokenizer is None:
        if size == 256:
            characters = bytes_to_unicode()
            return Vocabulary("gpt2", "default", [characters[b] for b in range(256)], ["normal"] * 256, ["Ġ Ġ"])
        log.warning("export: format='gguf' writes no tokenizer for a %d-token vocabulary; it takes token ids", size)
        return Vocabulary("none")
    tokenizer = _loaded(tokenizer)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ConfigError(FIELD, type(tokenizer).__name__, "must be a Hugging Face fast tokenizer (or its folder)")
    spec = json.loads(backend.to_str())
    _check_bpe(spec)
    tokens = dict(spec["model"]["vocab"]) | {added["content"]: added["id"] for added in spec.get("added_tokens", [])}
    if len(tokens) > size or max(tokens.values()) >= size:
        raise ConfigError(FIELD, type(tokenizer).__name__, f"has {len(tokens)} tokens; the model embeds {size}")
    by_id = {index: token for token, index in tokens.items()}
    special = {added["id"] for added in spec.get("added_tokens", []) if added.get("special")}
    added = {added["id"] for added in spec.get("added_tokens", [])}
    names = [by_id.get(index, f"[PAD{index}]") for index in range(size)]  # unused rows, as llama.cpp's converter pads
    kinds = [
        "control" if i in special else "user_defined" if i in added else "normal" if i in by_id else "unused"
        for i in range(size)
    ]
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"].get("merges", [])]
    ids = {name: getattr(tokenizer, f"{name}_token_id", None) for name in SPECIAL}
    template = getattr(tokenizer, "chat_template", None)
    return Vocabulary(
        "gpt2",
        "gpt-2",
        names,
        kinds,
        merges,
        {name: int(index) for name, index in ids.items() if index is not None},
        bool(getattr(tokenizer, "add_bos_token", False)),
        template if isinstance(template, str) else None,
    )


def _loaded(tokenizer: Any) -> Any:
    if not isinstance(tokenizer, (str, Path)):
        return tokenizer
    from transformers import AutoTokenizer

    folder = Path(tokenizer)
    if not (folder / "tokenizer.json").is_file():
        raise ConfigError(FIELD, str(tokenizer), "must be a folder holding a Hugging Face tokenizer.json")
    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False)


def _check_bpe(spec: dict) -> None:
    """Refuse what llama.cpp's ``gpt2`` tokenizer with the ``gpt-2`` split would tokenize otherwise."""
    model, split = spec.get("model") or {}, spec.get("pre_tokenizer") or {}
    problem = (
        f"is a {model.get('type')} model; GGUF writes byte-level BPE"
        if model.get("type") != "BPE"
        else "normalizes text first, which llama.cpp's byte-level BPE does not"
        if spec.get("normalizer")
        else f"splits text with {split.get('type')} {_shown(split)}; GGUF writes GPT-2's byte-level split"
        if any(split.get(key) != value for key, value in GPT2_SPLIT.items())
        else "drops unknown bytes (byte_fallback or an unk token in a byte-level model)"
        if model.get("byte_fallback")
        else None
    )
    if problem:
        raise ConfigError(FIELD, "tokenizer", f"{problem} (llama.cpp would split text into other tokens)")


def _shown(split: dict) -> str:
    return json.dumps({key: split.get(key) for key in GPT2_SPLIT if key != "type"})


def write_vocabulary(writer: Any, vocabulary: Vocabulary, gguf: Any) -> None:
    """The ``tokenizer.ggml.*`` keys of ``vocabulary``."""
    writer.add_tokenizer_model(vocabulary.model)
    if vocabulary.model == "none":
        return
    kinds = {name: getattr(gguf.TokenType, name.upper()) for name in ("normal", "control", "user_defined", "unused")}
    writer.add_tokenizer_pre(vocabulary.pre)
    writer.add_token_list(vocabulary.tokens)
    writer.add_token_types([kinds[kind] for kind in vocabulary.kinds])
    writer.add_token_merges(vocabulary.merges or ["Ġ Ġ"])  # llama.cpp needs the key
    for name, index in vocabulary.special.items():
        getattr(writer, f"add_{name}_token_id")(index)
    if vocabulary.add_bos is not None:
        writer.add_add_bos_token(vocabulary.add_bos)
    if vocabulary.chat_template:
        writer.add_chat_template(vocabulary.chat_template)
