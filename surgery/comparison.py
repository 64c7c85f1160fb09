"""``surgery.compare``: output drift between a reference and a candidate model."""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Union

import torch
from torch import Tensor, nn

from surgery.errors import ConfigError

Batch = Union[Tensor, Sequence[Any]]
Inputs = Union[Tensor, Iterable[Batch]]


@dataclass(frozen=True)
class Drift:
    """How far a candidate's outputs are from a reference's over the same inputs.

    ``sqnr_db`` is ``None`` when the outputs are identical (the ratio is infinite);
    ``top1_agreement`` is ``None`` when the outputs have no class dimension.
    """

    max_abs: float
    cosine: float
    sqnr_db: float | None
    top1_agreement: float | None
    layers: list | None = field(default=None, compare=False)  # LayerDrift rows with per_layer=True

    @property
    def identical(self) -> bool:
        """True when every output element is equal bit for bit (up to ``-0.0 == 0.0``)."""
        return self.max_abs == 0.0

    def as_dict(self) -> dict[str, float | None]:
        return {"max_abs": self.max_abs, "cosine": self.cosine, "sqnr_db": self.sqnr_db,
                "top1_agreement": self.top1_agreement}


def compare(reference: nn.Module, candidate: nn.Module, inputs: Inputs, *, per_layer: bool = False) -> Drift:
    """Run both models on the same inputs and measure how far the candidate drifts.

    Args:
        reference: the model taken as ground truth.
        candidate: the modified model.
        inputs: one input tensor, or an iterable of batches (a tensor each, or a tuple of
            positional arguments).
        per_layer: also compare the output of every module whose qualified name exists in
            both models (forward hooks, streaming sums: one batch of activations held at a
            time); the rows are in ``Drift.layers`` (see :func:`surgery.layer_drift.layer_drift`).

    Both models run in eval mode under ``torch.no_grad()``; their training flags are put back
    afterwards, so batch-norm statistics are never updated by a comparison.

    Example:
        >>> drift = surgery.compare(original, pruned, torch.randn(8, 3, 224, 224))
        >>> drift.cosine > 0.99
    """
    inputs = list(batches(inputs))
    check_finite(inputs, "compare.inputs")
    stats = _Accumulator()
    with evaluating(reference), evaluating(candidate), torch.no_grad():
        for batch in batches(inputs):
            pairs = zip(outputs(reference, batch), outputs(candidate, batch), strict=True)
            for index, (ref, cand) in enumerate(pairs):
                stats.add(ref, cand, primary=index == 0)
    result = stats.result()
    if per_layer:
        from surgery.layer_drift import layer_drift

        result = dataclasses.replace(result, layers=layer_drift(reference, candidate, inputs))
    return result


def batches(inputs: Inputs) -> Iterator[tuple]:
    """Yield each batch of ``inputs`` as a tuple of positional arguments."""
    if isinstance(inputs, Tensor):
        yield (inputs,)
        return
    for batch in inputs:
        yield tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)


def check_finite(inputs: list[tuple], field: str, error: type[ConfigError] = ConfigError) -> None:
    """Raise ``error`` naming the first batch whose floating tensors hold NaN or Inf."""
    for index, batch in enumerate(inputs):
        for tensor in flatten_tensors(list(batch)):
            if not torch.isfinite(tensor).all():
                raise error(field, f"batch {index}", "contains NaN or Inf; give finite inputs")


def outputs(model: nn.Module, args: tuple) -> list[Tensor]:
    """Call ``model(*args)`` and return its floating-point output tensors, flattened."""
    return flatten_tensors(model(*args))


def flatten_tensors(value: Any, *, floating_only: bool = True) -> list[Tensor]:
    """Tensors of a model output (tensor, tuple, list, dict or ``to_tuple()`` object): the
    floating ones, or all with ``floating_only=False``."""
    if isinstance(value, Tensor):
        keep = not floating_only or value.is_floating_point() or value.is_complex()
        return [value] if keep else []
    if hasattr(value, "to_tuple"):
        value = value.to_tuple()
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in flatten_tensors(item, floating_only=floating_only)]
    return []


@contextlib.contextmanager
def evaluating(model: nn.Module) -> Iterator[nn.Module]:
    """Put ``model`` in eval mode for the block, then restore every module's training flag."""
    flags = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield model
    finally:
        for module, flag in flags:
            module.training = flag


class StreamingError:
    """Float64 running sums of two output streams: max abs error, cosine and SQNR, with no
    stored outputs (shared by whole-model and per-layer comparison)."""

    def __init__(self) -> None:
        self.max_abs = 0.0
        self.dot = self.ref_sq = self.cand_sq = self.noise_sq = 0.0

    def add(self, ref: Tensor, cand: Tensor) -> None:
        """Accumulate one pair of same-shaped tensors."""
        r, c = ref.detach().double().flatten(), cand.detach().double().flatten()
        diff = r - c
        self.max_abs = max(self.max_abs, diff.abs().max().item() if diff.numel() else 0.0)
        self.dot += float(r @ c)
        self.ref_sq += float(r @ r)
        self.cand_sq += float(c @ c)
        self.noise_sq += float(diff @ diff)

    def cosine(self) -> float:
        denominator = math.sqrt(self.ref_sq * self.cand_sq)
        return self.dot / denominator if denominator else float(self.ref_sq == self.cand_sq)

    def sqnr_db(self) -> float | None:
        """Signal-to-quantization-noise ratio in dB; None when the streams are identical."""
        if self.noise_sq == 0:
            return None
        if self.ref_sq == 0:
            return -math.inf
        return 10 * math.log10(self.ref_sq / self.noise_sq)


class _Accumulator(StreamingError):
    """Whole-model drift: the streaming error plus top-1 agreement of the first output."""

    def __init__(self) -> None:
        super().__init__()
        self.agree = self.rows = 0

    def add(self, ref: Tensor, cand: Tensor, *, primary: bool = False) -> None:
        if ref.shape != cand.shape:
            raise ConfigError("compare.candidate", f"output shape {tuple(cand.shape)}",
                              f"must match the reference's output shape {tuple(ref.shape)} (shapes differ)")
        super().add(ref, cand)
        if primary and ref.dim() >= 2:  # class scores: the first output's last dimension
            self.agree += int((ref.argmax(-1) == cand.argmax(-1)).sum())
            self.rows += ref.argmax(-1).numel()

    def result(self) -> Drift:
        top1 = self.agree / self.rows if self.rows else None
        return Drift(self.max_abs, self.cosine(), self.sqnr_db(), top1)
