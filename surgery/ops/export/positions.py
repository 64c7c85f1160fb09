"""How far along the sequence a model's computation depends on position (a sliding window, an
attention chunk), so that a parity check whose inputs never reach that far does not vouch for it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor

from surgery.core.inputs import Call


def position_reach(model: Any) -> tuple[int, str] | None:
    """The longest position-dependent feature of a Hugging Face ``model`` that acts within its
    context, as (tokens, ``"config.sliding_window=160"``); ``None`` when it has none."""
    config = getattr(model, "config", None)
    limit = getattr(config, "max_position_embeddings", None)
    layers = getattr(config, "layer_types", None)
    found = []
    window = getattr(config, "sliding_window", None)
    if isinstance(window, int) and (layers is None or "sliding_attention" in layers):
        found.append((window, f"config.sliding_window={window}"))
    chunk = getattr(config, "attention_chunk_size", None)
    if isinstance(chunk, int):
        found.append((chunk, f"config.attention_chunk_size={chunk}"))
    acting = [each for each in found if not isinstance(limit, int) or each[0] < limit]
    return max(acting) if acting else None


def tokens_of(call: Call) -> int | None:
    """The sequence length of a call: the most tokens its ``attention_mask`` lets through in one
    sequence, else its ``inputs_embeds`` second axis, else its ``input_ids`` (or first tensor) last;
    ``None`` for a call with none of them."""
    kwargs = dict(call.kwargs)
    mask = kwargs.get("attention_mask")
    if isinstance(mask, Tensor) and mask.dim() == 2 and mask.numel():  # padding is no position the window reaches
        return int(mask.ne(0).sum(-1).max())
    if isinstance(kwargs.get("inputs_embeds"), Tensor) and kwargs["inputs_embeds"].dim() >= 2:
        return int(kwargs["inputs_embeds"].shape[1])
    first = kwargs.get("input_ids")
    if first is None:
        first = next((a for a in call.args if isinstance(a, Tensor)), None)
    return int(first.shape[-1]) if isinstance(first, Tensor) and first.dim() >= 1 else None


def unreached(model: Any, calls: Sequence[Call]) -> str:
    """Why a check on ``calls`` cannot vouch for ``model``: a position-dependent feature that acts
    only past the longest of them (empty when the calls reach it, or the model has none)."""
    reach = position_reach(model)
    if reach is None:
        return ""
    lengths = [n for n in (tokens_of(call) for call in calls) if n is not None]
    longest = max(lengths, default=0)
    if longest > reach[0]:
        return ""
    return (
        f"cannot vouch: the check's inputs are at most {longest} tokens and {reach[1]} acts only on longer "
        f"ones; give inputs of more than {reach[0]} tokens"
    )
