"""Tokens: random ids below the model's vocabulary, or a local text file through a local
tokenizer, as ``{"input_ids": ...}`` batches (no labels: scored by output drift)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from surgery.core.errors import ConfigError
from surgery.core.hf_loading import load_tokenizer
from surgery.tasks.base import Task, register_task
from surgery.tasks.synthetic import check_fits_in_memory


class TokenBatches(Sequence):
    """``count`` dict batches ``{input_ids, attention_mask}`` of ``batch_size × seq_len``: seeded
    random ids below ``vocab_size``, or windows of a local text file through a local tokenizer."""

    def __init__(self, config: Any, seed: int, count: int) -> None:
        self.config, self.seed, self.count = config, seed, count
        self.ids = _tokenised(config) if config.text else None

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[dict[str, Tensor]]:
        config = self.config
        shape = (config.batch_size, config.seq_len)
        generator = torch.Generator().manual_seed(self.seed)
        for index in range(self.count):
            if self.ids is None:
                ids = torch.randint(0, config.vocab_size, shape, generator=generator)
            else:
                step = shape[0] * shape[1]
                start = (index * step + self.seed * 7919 * step) % max(len(self.ids) - step, 1)
                ids = self.ids[start : start + step].reshape(shape)
            yield {"input_ids": ids, "attention_mask": torch.ones(shape, dtype=torch.long)}

    def __getitem__(self, index: int) -> dict[str, Tensor]:  # type: ignore[override]
        return list(self)[index]


def token_dicts(config: Any, seed: int, count: int) -> TokenBatches:
    if config.vocab_size is None and config.text is None:
        raise ConfigError(
            "data.vocab_size",
            None,
            "data=tokens needs the vocabulary size (taken from the model's config.vocab_size when it has one)",
        )
    check_fits_in_memory((config.batch_size, config.seq_len), itemsize=8)
    return TokenBatches(config, seed, count)


def _tokenised(config: Any) -> Tensor:
    try:
        import transformers  # noqa: F401 - the tokenizer's loader
    except ImportError:
        raise ConfigError("data.tokenizer", config.tokenizer, "needs transformers: pip install 'surgery[hf]'") from None
    tokenizer = load_tokenizer(config.tokenizer, "data.tokenizer")
    try:
        text = Path(config.text).read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError("data.text", config.text, f"is not UTF-8 text (byte {err.start}: {err.reason})") from None
    except OSError as err:
        raise ConfigError("data.text", config.text, f"cannot be read: {' '.join(str(err).split())[:160]}") from None
    ids = torch.tensor(tokenizer(text)["input_ids"], dtype=torch.long)
    if config.vocab_size is not None and len(ids) and int(ids.max()) >= config.vocab_size:
        raise ConfigError(
            "data.tokenizer",
            config.tokenizer,
            f"gives token ids up to {int(ids.max())}, beyond the "
            f"model's vocabulary of {config.vocab_size}; use the model's own tokenizer",
        )
    if len(ids) < config.batch_size * config.seq_len:
        raise ConfigError(
            "data.text",
            config.text,
            f"holds {len(ids)} tokens, fewer than one batch ({config.batch_size} × {config.seq_len})",
        )
    return ids


register_task(Task("tokens", inputs=token_dicts))
