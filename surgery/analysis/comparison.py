"""``surgery.compare``: output drift between a reference and a candidate model."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from surgery.analysis.attribution import AttributionDrift, AttributionSpec, attribution_drift, attribution_spec
from surgery.analysis.layer_drift import layer_drift
from surgery.analysis.metrics import NonFinite, StreamingError
from surgery.core.errors import ConfigError
from surgery.core.inputs import Inputs, batches, check_batch_finite, evaluating, flatten_tensors, outputs


@dataclass(frozen=True)
class Drift:
    """How far a candidate's outputs are from a reference's over the same inputs.

    ``identical`` means every output is equal bit for bit (a NaN equals the same NaN).
    When either model's outputs hold NaN or Inf (counted in ``nonfinite``), ``cosine`` and
    ``sqnr_db`` are NaN and ``max_abs`` is NaN unless the outputs are identical: no bound
    can pass on them. ``sqnr_db`` is ``None`` when the outputs are identical (the ratio is
    infinite); ``top1_agreement`` is ``None`` when the outputs have no class dimension.
    """

    max_abs: float
    cosine: float
    sqnr_db: float | None
    top1_agreement: float | None
    layers: list | None = field(default=None, compare=False)  # LayerDrift rows with per_layer=True
    attribution: AttributionDrift | None = field(default=None, compare=False)  # with attribution=...
    nonfinite: NonFinite = field(default_factory=NonFinite)
    identical: bool = False

    @property
    def finite(self) -> bool:
        """True when no output value of either model was NaN or Inf."""
        return not (self.nonfinite.reference or self.nonfinite.candidate)

    def as_dict(self) -> dict[str, Any]:
        return {
            "max_abs": self.max_abs,
            "cosine": self.cosine,
            "sqnr_db": self.sqnr_db,
            "top1_agreement": self.top1_agreement,
            "nonfinite": dataclasses.asdict(self.nonfinite),
        }


def compare(
    reference: nn.Module,
    candidate: nn.Module,
    inputs: Inputs,
    *,
    per_layer: bool = False,
    attribution: AttributionSpec | dict | None = None,
) -> Drift:
    """Run both models on the same inputs and measure how far the candidate drifts.

    Args:
        reference: the model taken as ground truth.
        candidate: the modified model.
        inputs: one batch, or an iterable of batches, streamed. A batch is a tensor, a tuple
            of positional arguments or a dict of keyword arguments (``input_ids=...``): one batch is held at a time. A one-shot iterator
            is kept in memory only with ``per_layer`` (which needs a second pass).
        per_layer: also compare the output of every module whose qualified name exists in
            both models (forward hooks, streaming sums: one batch of activations held at a
            time); the rows are in ``Drift.layers`` (see :func:`surgery.analysis.layer_drift.layer_drift`).
        attribution: also compare what both models look at (an :class:`AttributionSpec` or a
            dict of its fields: method, layer, class, top-k fraction): per-input cosine and
            top-k overlap of their attribution maps in ``Drift.attribution``.

    Both models run in eval mode under ``torch.no_grad()``; their training flags are put back
    afterwards, so batch-norm statistics are never updated by a comparison.

    Example:
        >>> drift = surgery.compare(original, pruned, torch.randn(8, 3, 224, 224))
        >>> drift.cosine > 0.99
    """
    if (per_layer or attribution is not None) and iter(inputs) is inputs:  # a second pass: keep the batches
        inputs = list(inputs)
    spec = None if attribution is None else attribution_spec(attribution)  # checked before any work
    stats = _Accumulator()
    with evaluating(reference), evaluating(candidate), torch.no_grad():
        for index, batch in enumerate(batches(inputs, "compare.inputs")):
            check_batch_finite(batch, index, "compare.inputs")
            ref_raw = batch(reference)
            ref_outputs, cand_outputs = flatten_tensors(ref_raw), outputs(candidate, batch)
            if len(ref_outputs) != len(cand_outputs):
                raise ConfigError(
                    "compare.candidate",
                    f"{len(cand_outputs)} output tensor(s)",
                    f"must match the reference's {len(ref_outputs)} floating output tensor(s)",
                )
            primary = _primary_index(ref_raw, ref_outputs)
            for index, (ref, cand) in enumerate(zip(ref_outputs, cand_outputs)):
                stats.add(ref, cand, primary=index == primary)
    result = stats.result()
    if per_layer:
        result = dataclasses.replace(result, layers=layer_drift(reference, candidate, inputs))
    if spec is not None:
        result = dataclasses.replace(result, attribution=attribution_drift(reference, candidate, inputs, spec))
    return result


def _primary_index(output: Any, flat: list[Tensor]) -> int:
    """Which flattened output top-1 agreement reads: the ``logits`` of a ModelOutput or dict, else the first."""
    logits = output.get("logits") if isinstance(output, Mapping) else getattr(output, "logits", None)
    return next((i for i, tensor in enumerate(flat) if tensor is logits), 0)


class _Accumulator(StreamingError):
    """Whole-model drift: the streaming error plus top-1 agreement of the first output."""

    def __init__(self) -> None:
        super().__init__()
        self.agree = self.rows = 0

    def add(self, ref: Tensor, cand: Tensor, *, primary: bool = False) -> None:
        if ref.shape != cand.shape:
            raise ConfigError(
                "compare.candidate",
                f"output shape {tuple(cand.shape)}",
                f"must match the reference's output shape {tuple(ref.shape)} (shapes differ)",
            )
        super().add(ref, cand)
        if primary and ref.dim() >= 2:  # class scores: the first output's last dimension
            self.agree += int((ref.argmax(-1) == cand.argmax(-1)).sum())
            self.rows += ref.argmax(-1).numel()

    def result(self) -> Drift:
        top1 = self.agree / self.rows if self.rows and self.measurable else None
        return Drift(
            self.max_abs, self.cosine(), self.sqnr_db(), top1, nonfinite=self.nonfinite, identical=self.identical
        )
