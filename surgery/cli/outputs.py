"""What the app reads from any model's batches and outputs: tensors, tuples, dicts, ModelOutputs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor
from torch.nn import functional as F

from surgery.analysis.metrics import logits_of


def classification_loss(output: Any, target: Tensor) -> Tensor:
    """Cross-entropy of an output's logits against ``target`` (per token for sequence logits)."""
    logits = logits_of(output)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def first_sample(batch: Any) -> Any:
    """The first sample of a batch (a tensor, or every tensor of a dict/tuple), batch axis kept."""
    if isinstance(batch, Tensor):
        return batch[:1]
    if isinstance(batch, Mapping):
        return {key: first_sample(value) for key, value in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(first_sample(value) for value in batch)
    return batch


def batch_of(sample: Any, size: int) -> Any:
    """A batch of ``size`` built from a one-sample batch: new Gaussian values for floating
    tensors (images), the sample repeated for the rest (token ids, masks)."""
    if isinstance(sample, Tensor):
        if sample.is_floating_point():
            return torch.randn(size, *sample.shape[1:], generator=torch.Generator().manual_seed(0))
        return sample[:1].repeat(size, *([1] * (sample.dim() - 1)))
    if isinstance(sample, Mapping):
        return {key: batch_of(value, size) for key, value in sample.items()}
    if isinstance(sample, (tuple, list)):
        return type(sample)(batch_of(value, size) for value in sample)
    return sample


def describe_batch(batch: Any) -> str:
    """Shapes of a batch, for messages: ``(1, 3, 224, 224)`` or ``input_ids (1, 32)``."""
    if isinstance(batch, Tensor):
        return str(tuple(batch.shape))
    if isinstance(batch, Mapping):
        return ", ".join(f"{key} {describe_batch(value)}" for key, value in batch.items())
    return type(batch).__name__
