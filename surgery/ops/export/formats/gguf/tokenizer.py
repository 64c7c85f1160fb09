"""The vocabulary a GGUF file carries, so llama.cpp turns text into the model's token ids: a
byte-level model's 256 bytes (GPT-2's byte to character map, no merges), or a Hugging Face
tokenizer that llama.cpp's tokenizers can reproduce: byte-level BPE (llama.cpp's ``gpt2`` model)
split as GPT-2, Llama 3 or Qwen2 split text (its ``gpt-2``, ``llama-bpe`` and ``qwen2``
pre-tokenizers), or SentencePiece BPE (its ``llama`` model, :mod:`.gguf_sentencepiece`): its
tokens, merges or scores, special tokens and chat template. Any other tokenizer is refused in one
line (llama.cpp would split text otherwise)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from surgery.core.errors import ConfigError
from surgery.core.hf_loading import load_tokenizer
from surgery.ops.export.formats.gguf.sentencepiece import is_sentencepiece, sentencepiece

log = logging.getLogger("surgery")
FIELD = "export.options.tokenizer"
GPT2_SPLIT = {"type": "ByteLevel", "use_regex": True, "add_prefix_space": False}  # GPT-2's regex, then bytes
SPECIAL = ("bos", "eos", "unk", "pad")


@dataclass(frozen=True)
class PreTokenizer:
    """A llama.cpp pre-tokenizer (``tokenizer.ggml.pre``) and what its tokenizer does beside the
    split: whether a word in the vocabulary skips the merges (``ignore_merges``, as the Hugging
    Face model's own flag must say) and the normalizer llama.cpp's converter lets through."""

    name: str
    ignore_merges: bool = False
    normalizer: dict | None = None


GPT2 = PreTokenizer("gpt-2")
# each Hugging Face tokenizer.json's Split regex (then byte-level) -> the llama.cpp pre-tokenizer
# whose regex splits text as it does (llama-vocab.cpp keeps the originals beside its adaptations)
SPLITS = {
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+": (
        PreTokenizer("llama-bpe", ignore_merges=True)  # Llama 3
    ),
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+": (
        PreTokenizer("qwen2", normalizer={"type": "NFC"})  # Qwen2, Qwen2.5, Qwen3
    ),
}


@dataclass
class Vocabulary:
    """What the file's ``tokenizer.ggml.*`` keys hold: ``model``/``pre`` llama.cpp's names; for
    a tokenizer, its tokens by id, their kinds, its merges, special ids and chat template."""

    model: str
    pre: str | None = None
    tokens: list[str] = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)  # normal, control (special), user_defined (added), byte, unknown
    merges: list[str] = field(default_factory=list)
    scores: list[float] | None = None  # a SentencePiece model's (llama.cpp merges by them)
    space_prefix: bool | None = None  # a SentencePiece model's: whether a space goes before the text
    special: dict[str, int] = field(default_factory=dict)
    add_bos: bool | None = None  # written for a tokenizer: whether llama.cpp puts its bos first
    add_eos: bool | None = None  # ... and its eos last
    chat_template: str | list[dict[str, str]] | None = None  # one, or named ones (gguf-py writes "default" as the one)


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
    added_tokens = spec.get("added_tokens", [])
    _check_added(added_tokens, is_sentencepiece(spec))
    piece = sentencepiece(spec, {a["content"] for a in added_tokens}) if is_sentencepiece(spec) else None
    pre = _pre_tokenizer(spec) if piece is None else None
    tokens = dict(spec["model"]["vocab"]) | {added["content"]: added["id"] for added in added_tokens}
    by_id = _by_id(tokens, size, type(tokenizer).__name__)
    ids = {name: getattr(tokenizer, f"{name}_token_id", None) for name in SPECIAL}
    names = [by_id.get(index, f"[PAD{index}]") for index in range(size)]  # unused rows, as llama.cpp's converter pads
    kinds = _kinds(names, by_id, added_tokens, ids["unk"], sentencepiece=piece is not None)
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"].get("merges", [])]
    template = _chat_template(getattr(tokenizer, "chat_template", None))
    bos, eos = _added_around(tokenizer, ids["bos"], ids["eos"])
    return Vocabulary(
        "gpt2" if piece is None else "llama",
        "default" if piece else pre.name,
        names,
        kinds,
        merges=merges if piece is None else [],
        scores=[piece.scores.get(name, 0.0) for name in names] if piece else None,
        space_prefix=piece.space_prefix if piece else None,
        special={name: int(index) for name, index in ids.items() if index is not None},
        add_bos=bos,
        add_eos=eos,
        chat_template=template,
    )


def _by_id(tokens: dict[str, int], size: int, name: str) -> dict[int, str]:
    """Each id's token; an id past the model's embeddings, or one id given two tokens (one of them
    would be lost), refused naming the token."""
    by_id: dict[int, str] = {}
    for token, index in sorted(tokens.items(), key=lambda item: item[1]):
        if index >= size:
            raise ConfigError(
                FIELD,
                name,
                f"has the token {token!r} at id {index}; the model embeds {size} tokens (ids 0 to {size - 1})",
            )
        if index in by_id:
            raise ConfigError(
                FIELD, name, f"gives id {index} to both {by_id[index]!r} and {token!r}; GGUF holds one token an id"
            )
        by_id[index] = token
    return by_id


def _chat_template(template: Any) -> str | list[dict[str, str]] | None:
    """The chat template as gguf-py writes it: one string, or named ones (transformers reads a list
    of ``{name, template}`` as a dict), ``default`` among them the one llama.cpp uses."""
    if isinstance(template, dict):
        if "default" not in template:
            log.warning(
                "export: the tokenizer's chat templates (%s) have none named 'default'; llama.cpp uses none by default",
                ", ".join(template),
            )
        return [{"name": name, "template": text} for name, text in template.items() if isinstance(text, str)]
    if template is not None and not isinstance(template, str):
        log.warning(
            "export: the tokenizer's chat template is a %s, not text; the GGUF carries none", type(template).__name__
        )
    return template if isinstance(template, str) else None


def _check_added(added_tokens: list[dict], sentencepiece: bool) -> None:
    """Refuse added tokens llama.cpp would match otherwise: ones that take the spaces beside them
    (``lstrip``/``rstrip``) or match whole words only (``single_word``), and a SentencePiece
    model's non-special ones (llama.cpp puts a ``▁`` after them; transformers does not)."""
    for added in added_tokens:
        content = added.get("content")
        flags = [flag for flag in ("lstrip", "rstrip", "single_word") if added.get(flag)]
        if flags:
            raise ConfigError(
                FIELD,
                "tokenizer",
                f"adds {content!r} with {'/'.join(flags)}, which llama.cpp's tokenizer does not apply "
                "(llama.cpp would split text into other tokens)",
            )
        if sentencepiece and not added.get("special"):
            raise ConfigError(
                FIELD,
                "tokenizer",
                f"adds {content!r} as a token that is not special, which llama.cpp's SentencePiece tokenizer "
                "follows with a space transformers does not put there (llama.cpp would split text into other tokens)",
            )


def _kinds(
    names: list[str], by_id: dict[int, str], added_tokens: list[dict], unknown: int | None, *, sentencepiece: bool
) -> list[str]:
    """Each row's llama.cpp token type: a SentencePiece model's unk (``unknown``) unknown, special
    tokens control, other added ones user-defined, its byte tokens byte (whether or not it names an
    unk token), rows no token uses unused."""
    special = {added["id"] for added in added_tokens if added.get("special")}
    added = {added["id"] for added in added_tokens}
    unknown = unknown if sentencepiece else None
    return [
        "unknown"
        if i == unknown
        else "control"
        if i in special
        else "user_defined"
        if i in added
        else "byte"
        if sentencepiece and len(name) == 6 and name.startswith("<0x") and name.endswith(">")
        else "normal"
        if i in by_id
        else "unused"
        for i, name in enumerate(names)
    ]


def _added_around(tokenizer: Any, bos: int | None, eos: int | None) -> tuple[bool, bool]:
    """Whether ``tokenizer`` puts its bos first and its eos last when it encodes a text, as its
    post-processor (a template, or a flag) does it: what llama.cpp's ``add_bos``/``add_eos`` say."""
    ids = tokenizer("a")["input_ids"]
    return bos is not None and ids[:1] == [bos], eos is not None and ids[-1:] == [eos]


def _loaded(tokenizer: Any) -> Any:
    if not isinstance(tokenizer, (str, Path)):
        return tokenizer
    folder = Path(tokenizer)
    if folder.is_dir() and not (folder / "tokenizer.json").is_file():
        raise ConfigError(FIELD, str(tokenizer), "must be a folder holding a Hugging Face tokenizer.json")
    return load_tokenizer(folder, FIELD)


def _pre_tokenizer(spec: dict) -> PreTokenizer:
    """The llama.cpp pre-tokenizer that splits text as ``spec`` (a tokenizer.json) does; what
    llama.cpp's byte-level BPE would tokenize otherwise is refused in one line."""
    model, split = spec.get("model") or {}, spec.get("pre_tokenizer") or {}
    pre = _split_of(split)
    normalizer = spec.get("normalizer")
    problem = (
        f"is a {model.get('type')} model; GGUF writes byte-level BPE"
        if model.get("type") != "BPE"
        else f"splits text with {split.get('type')} {_shown(split)}; GGUF writes GPT-2's, Llama 3's or Qwen2's "
        "byte-level split"
        if pre is None
        else f"normalizes text first ({json.dumps(normalizer)[:120]}), which llama.cpp's {pre.name} tokenizer does not"
        if normalizer and normalizer != pre.normalizer
        else f"{'keeps' if pre.ignore_merges else 'skips'} merges for words in its vocabulary (ignore_merges="
        f"{bool(model.get('ignore_merges'))}), which llama.cpp's {pre.name} tokenizer does not"
        if bool(model.get("ignore_merges")) != pre.ignore_merges
        else None
    )
    if problem:
        raise ConfigError(FIELD, "tokenizer", f"{problem} (llama.cpp would split text into other tokens)")
    if normalizer:
        log.warning(
            "export: llama.cpp's %s tokenizer does not apply the tokenizer's %s normalization: text not already "
            "normalized (decomposed accents) gives other tokens there, as with llama.cpp's own converter",
            pre.name,
            normalizer.get("type"),
        )
    return pre


def _split_of(split: dict) -> PreTokenizer | None:
    if all(split.get(key) == value for key, value in GPT2_SPLIT.items()):
        return GPT2
    parts = split.get("pretokenizers") or []
    if split.get("type") != "Sequence" or len(parts) != 2:
        return None
    regex, byte_level = parts
    isolated = regex.get("type") == "Split" and regex.get("behavior") == "Isolated" and not regex.get("invert")
    plain_bytes = byte_level == byte_level | {"type": "ByteLevel", "use_regex": False, "add_prefix_space": False}
    return SPLITS.get((regex.get("pattern") or {}).get("Regex")) if isolated and plain_bytes else None


def _shown(part: dict) -> str:
    shown = json.dumps({key: value for key, value in part.items() if key != "type"})
    return shown if len(shown) <= 160 else shown[:157] + "..."


def write_vocabulary(writer: Any, vocabulary: Vocabulary, gguf: Any) -> None:
    """The ``tokenizer.ggml.*`` keys of ``vocabulary``."""
    writer.add_tokenizer_model(vocabulary.model)
    if vocabulary.model == "none":
        return
    kinds = {name: getattr(gguf.TokenType, name.upper()) for name in set(vocabulary.kinds)}
    writer.add_tokenizer_pre(vocabulary.pre)
    writer.add_token_list(vocabulary.tokens)
    writer.add_token_types([kinds[kind] for kind in vocabulary.kinds])
    if vocabulary.scores is not None:  # a SentencePiece model merges by score
        writer.add_token_scores(vocabulary.scores)
        writer.add_add_space_prefix(vocabulary.space_prefix)
    else:
        writer.add_token_merges(vocabulary.merges or ["Ġ Ġ"])  # llama.cpp needs the key
    for name, index in vocabulary.special.items():
        getattr(writer, f"add_{name}_token_id")(index)
    if vocabulary.add_bos is not None:
        writer.add_add_bos_token(vocabulary.add_bos)
        writer.add_add_eos_token(vocabulary.add_eos)
    if vocabulary.chat_template:
        writer.add_chat_template(vocabulary.chat_template)
