"""Metrics: output drift accumulated in float64 (cosine, SQNR, max abs), bit equality, and
task metrics (top-1 accuracy, perplexity)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from surgery.core.errors import ConfigError
from surgery.core.inputs import as_call, evaluating


@dataclass(frozen=True)
class NonFinite:
    """How many output values were NaN or Inf, in the reference and in the candidate."""

    reference_nan: int = 0
    reference_inf: int = 0
    candidate_nan: int = 0
    candidate_inf: int = 0

    @property
    def reference(self) -> int:
        return self.reference_nan + self.reference_inf

    @property
    def candidate(self) -> int:
        return self.candidate_nan + self.candidate_inf

    def describe(self, side: str) -> str:
        """``"12 NaN and 0 Inf"`` for ``side`` = ``"reference"`` or ``"candidate"``."""
        return f"{getattr(self, side + '_nan')} NaN and {getattr(self, side + '_inf')} Inf"


def same_bits(a: Tensor, b: Tensor) -> bool:
    """Equal bit for bit: same dtype and shape, a NaN equals the same NaN, -0.0 differs from 0.0."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_meta or b.is_meta:  # no values: the same if both are meta
        return a.is_meta and b.is_meta
    return torch.equal(_bits(a), _bits(b))


def _bits(t: Tensor) -> Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


class StreamingError:
    """Float64 running sums of two output streams: max abs error, cosine and SQNR, with no
    stored outputs (shared by whole-model and per-layer comparison).

    NaN and Inf values are counted per stream; once any is seen the metrics are NaN (they
    cannot be measured), while :attr:`identical` still compares bits.
    """

    def __init__(self) -> None:
        self._max_abs = 0.0
        self.dot = self.ref_sq = self.cand_sq = self.noise_sq = 0.0
        self.counts = [0, 0, 0, 0]  # reference NaN, reference Inf, candidate NaN, candidate Inf
        self.identical = True

    def add(self, ref: Tensor, cand: Tensor) -> None:
        """Accumulate one pair of same-shaped tensors."""
        self.identical = self.identical and same_bits(ref.detach(), cand.detach())
        r, c = ref.detach().double().flatten(), cand.detach().double().flatten()
        finite_r, finite_c = bool(torch.isfinite(r).all()), bool(torch.isfinite(c).all())
        if not (finite_r and finite_c):
            for index, (values, ok) in enumerate(((r, finite_r), (c, finite_c))):
                if not ok:
                    self.counts[2 * index] += int(torch.isnan(values).sum())
                    self.counts[2 * index + 1] += int(torch.isinf(values).sum())
            return
        diff = r - c
        self._max_abs = max(self._max_abs, diff.abs().max().item() if diff.numel() else 0.0)
        self.dot += float(r @ c)
        self.ref_sq += float(r @ r)
        self.cand_sq += float(c @ c)
        self.noise_sq += float(diff @ diff)

    @property
    def nonfinite(self) -> NonFinite:
        return NonFinite(*self.counts)

    @property
    def measurable(self) -> bool:
        return not any(self.counts)

    @property
    def max_abs(self) -> float:
        if self.identical:
            return 0.0
        return self._max_abs if self.measurable else math.nan

    def cosine(self) -> float:
        if not self.measurable:
            return math.nan
        denominator = math.sqrt(self.ref_sq * self.cand_sq)
        return self.dot / denominator if denominator else float(self.ref_sq == self.cand_sq)

    def sqnr_db(self) -> float | None:
        """Signal-to-quantization-noise ratio in dB; None when the streams are identical."""
        if self.identical or self.noise_sq == 0 and self.measurable:
            return None
        if not self.measurable:
            return math.nan
        if self.ref_sq == 0:
            return -math.inf
        ratio = self.ref_sq / self.noise_sq
        return 10 * math.log10(ratio) if 0 < ratio < math.inf else (math.inf if ratio else -math.inf)


def logits_of(output: Any) -> Tensor:
    """The prediction tensor of an output: itself, ``.logits``, ``["logits"]``, or the first
    tensor of a tuple."""
    if isinstance(output, Tensor):
        return output
    if isinstance(getattr(output, "logits", None), Tensor):
        return output.logits
    if isinstance(output, Mapping) and isinstance(output.get("logits"), Tensor):
        return output["logits"]
    if isinstance(output, (tuple, list)) and output:
        return logits_of(output[0])
    raise TypeError(f"cannot find the logits in a {type(output).__name__} output")


def accuracy(model: nn.Module, batches: Iterable[tuple[Any, Tensor]]) -> float:
    """Top-1 accuracy in [0, 1] of ``model`` over (inputs, labels) batches.

    The model runs in eval mode under ``torch.no_grad()``; every module's training flag is put
    back afterwards.

    Raises:
        ValueError: ``batches`` holds no sample.

    Example:
        >>> accuracy(model, [(images, labels)])
        0.97
    """
    correct = total = 0
    with evaluating(model), torch.no_grad():
        for inputs, labels in batches:
            logits = logits_of(as_call(inputs, "data")(model))
            if labels.numel() and int(labels.max()) >= logits.shape[-1]:
                raise ConfigError(
                    "model.num_classes",
                    logits.shape[-1],
                    f"the data has labels up to "
                    f"{int(labels.max())}: the model must score at least {int(labels.max()) + 1} "
                    "classes",
                )
            correct += int((logits.argmax(-1) == labels).sum())
            total += labels.numel()
    if total == 0:
        raise ValueError("accuracy: batches holds no sample; pass at least one non-empty batch")
    return correct / total


def perplexity(model: nn.Module, batches: list[tuple[Tensor, Tensor]]) -> float:
    """exp(mean next-byte cross-entropy) over ``(inputs, targets)`` batches, in eval mode
    without gradients (training flags put back); NaN or Inf logits give ``inf``. The loss is
    summed in float32 whatever the model's dtype (a bfloat16 sum rounds to steps of 2 near 300)."""
    total, count = 0.0, 0
    with evaluating(model), torch.no_grad():
        for inputs, targets in batches:
            logits = model(inputs)
            logits = getattr(logits, "logits", logits)  # a Hugging Face causal LM's output
            if not torch.isfinite(logits).all():
                return math.inf
            flat = logits.reshape(-1, logits.shape[-1]).float()
            total += F.cross_entropy(flat, targets.reshape(-1), reduction="sum").item()
            count += targets.numel()
    if count == 0:
        raise ValueError("perplexity: batches holds no token; pass at least one non-empty batch")
    return math.exp(total / count)
