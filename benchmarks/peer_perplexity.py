"""Held-out perplexity of a model a peer left compressed, computed inside the peer's own environment
(imported by ``llmcompressor_quality.py`` and ``autoround_quality.py``, which run there without surgery)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def held_out_perplexity(model: torch.nn.Module, data: dict) -> float:
    """exp of the mean next-byte cross-entropy over ``data["inputs"]`` / ``data["targets"]``."""
    total, count = 0.0, 0
    with torch.no_grad():
        for inputs, targets in zip(data["inputs"], data["targets"]):
            logits = model(inputs).logits
            total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum").item()
            count += targets.numel()
    return math.exp(total / count)
