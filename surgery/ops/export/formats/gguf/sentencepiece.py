"""A Hugging Face tokenizer converted from a SentencePiece BPE model (Llama 2, Mistral, TinyLlama:
``▁`` for spaces, unknown characters as ``<0xXX>`` bytes) as llama.cpp's ``llama`` tokenizer.

llama.cpp merges two adjacent pieces whenever their concatenation is a token, the highest score
first (then the leftmost); the Hugging Face BPE merges the pairs its merges list, the lowest rank
first. They agree when every way of splitting a token into two tokens is a merge (as transformers'
converter writes them, from the SentencePiece model) and each token's merges are consecutive (a
token's score is then its first merge's rank, negated). Both are checked; a tokenizer that
misses either (a BPE trained with byte fallback, not converted) is refused in one line.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import NoReturn

from surgery.core.errors import ConfigError

log = logging.getLogger("surgery")
FIELD = "export.options.tokenizer"
SPACE = "\u2581"  # ▁, SentencePiece's space
REPLACE_SPACES = {"type": "Replace", "pattern": {"String": " "}, "content": SPACE}
PREPEND_SPACE = {"type": "Prepend", "prepend": SPACE}
BYTES = [f"<0x{b:02X}>" for b in range(256)]


@dataclass(frozen=True)
class SentencePiece:
    """What llama.cpp's ``llama`` tokenizer needs beside the tokens: each merged token's score
    (tokens no merge makes score 0) and whether a space goes before the text (``add_space_prefix``)."""

    scores: dict[str, float]
    space_prefix: bool


def is_sentencepiece(spec: dict) -> bool:
    """Whether ``spec`` (a tokenizer.json) is a BPE with byte fallback (SentencePiece's kind)."""
    model = spec.get("model") or {}
    return model.get("type") == "BPE" and bool(model.get("byte_fallback"))


def sentencepiece(spec: dict, added: set[str]) -> SentencePiece:
    """``spec``'s scores and space prefix, checked to tokenize in llama.cpp as it does in
    transformers (``added``: the added tokens' texts, which llama.cpp matches whole)."""
    model = spec["model"]
    options = {key: model.get(key) for key in ("dropout", "continuing_subword_prefix", "end_of_word_suffix")}
    if any(value is not None for value in options.values()) or model.get("ignore_merges"):
        _refuse(f"sets BPE options llama.cpp's SentencePiece tokenizer lacks ({options}, ignore_merges)")
    vocab = model["vocab"]
    missing = [token for token in BYTES if token not in vocab]
    if missing:
        _refuse(f"falls back to bytes without the byte tokens {missing[0]}... ({len(missing)} of 256 missing)")
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model.get("merges", [])]
    scores = _scores(merges)
    _check_every_split_merges(vocab, set(merges), set(BYTES) | added)
    return SentencePiece(scores, _space_prefix(spec))


def _scores(merges: list[tuple[str, str]]) -> dict[str, float]:
    scores: dict[str, float] = {}
    previous = None
    for rank, (left, right) in enumerate(merges):
        merged = left + right
        if merged in scores and merged != previous:
            _refuse(
                f"merges {left!r} + {right!r} into {merged!r} apart from its other merges; llama.cpp scores each "
                "token once"
            )
        scores.setdefault(merged, -float(rank))
        previous = merged
    return scores


def _check_every_split_merges(vocab: dict[str, int], merges: set[tuple[str, str]], whole: set[str]) -> None:
    for token in vocab:
        if token in whole:
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab and (left, right) not in merges:
                _refuse(
                    f"has no merge {left!r} + {right!r} though both and {token!r} are tokens (a BPE trained with "
                    "byte fallback, not converted from SentencePiece); llama.cpp merges any two pieces that make a token"
                )


def _space_prefix(spec: dict) -> bool:
    """Whether a ``▁`` goes before the text (and after each special token in it, as llama.cpp
    puts it there), from the normalizer or Metaspace pre-tokenizer transformers' converter writes."""
    normalizer, split = spec.get("normalizer"), spec.get("pre_tokenizer")
    steps = (normalizer or {}).get("normalizers", [normalizer] if normalizer else [])
    if split is None and steps in ([PREPEND_SPACE, REPLACE_SPACES], [REPLACE_SPACES]):
        return PREPEND_SPACE in steps
    metaspace = split or {}
    if normalizer is None and metaspace.get("type") == "Metaspace" and metaspace.get("replacement") == SPACE:
        scheme = metaspace.get("prepend_scheme")
        if not metaspace.get("split") and scheme in ("always", "first", "never"):
            if scheme != "never":
                log.warning(
                    "export: the tokenizer's Metaspace puts no %s before a text that starts with a space%s; "
                    "llama.cpp's SentencePiece tokenizer does (as SentencePiece itself does): such text gets one "
                    "more %s token there",
                    SPACE,
                    ", nor after a special token written in the text" if scheme == "first" else "",
                    SPACE,
                )
            return scheme != "never"
    _refuse(f"normalizes or splits text as llama.cpp's SentencePiece tokenizer does not ({normalizer}, {split})"[:300])


def _refuse(problem: str) -> NoReturn:
    raise ConfigError(FIELD, "tokenizer", f"{problem} (llama.cpp would split text into other tokens)")
