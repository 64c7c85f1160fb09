"""Per-layer drift: activations of two models compared layer by layer, through two captures."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from surgery.analysis.metrics import StreamingError
from surgery.core import compiled
from surgery.core.capture import Capture, Keep
from surgery.core.errors import ConfigError
from surgery.core.inputs import Call, Inputs, batches, evaluating


@dataclass(frozen=True)
class LayerDrift:
    """How far one layer's output in the candidate is from the same layer in the reference.

    ``index`` is the layer's position in the reference's execution order (first call), and
    ``depth`` its nesting level (``"layer1.0.conv1"`` has depth 3). ``cosine`` is ``None``
    when the layer could not be compared (shapes differ, or one model never called it; see
    ``detail``); ``sqnr_db`` is ``None`` when the outputs are identical or not comparable.
    """

    name: str
    type: str
    cosine: float | None
    sqnr_db: float | None
    max_abs: float | None
    index: int
    depth: int
    calls: int = 0
    detail: str = ""

    @property
    def comparable(self) -> bool:
        return self.cosine is not None

    @property
    def identical(self) -> bool:
        """True when every compared element was equal (up to ``-0.0 == 0.0``)."""
        return self.comparable and self.max_abs == 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "type": self.type,
            "cosine": self.cosine,
            "sqnr_db": self.sqnr_db,
            "max_abs": self.max_abs,
            "index": self.index,
            "depth": self.depth,
            "calls": self.calls,
            "detail": self.detail,
        }


class _LayerStats(StreamingError):
    """Streaming float64 sums for one layer, so no activation outlives its comparison."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.problem = ""

    def add(self, ref: Tensor, cand: Tensor) -> None:
        if ref.shape != cand.shape:
            self.problem = self.problem or f"shapes differ: {tuple(ref.shape)} vs {tuple(cand.shape)}"
            return
        super().add(ref, cand)
        self.calls += 1

    def result(self, name: str, type_name: str, index: int) -> LayerDrift:
        depth = name.count(".") + 1
        if self.problem:
            return LayerDrift(name, type_name, None, None, None, index, depth, self.calls, self.problem)
        return LayerDrift(name, type_name, self.cosine(), self.sqnr_db(), self.max_abs, index, depth, self.calls)


class _ReferenceOutputs(Keep):
    """The reference's outputs of one layer in the current batch (a capture reducer); each is
    released as soon as the candidate's matching call has been compared."""

    def take(self, call: int) -> Tensor | None:
        if call >= len(self.tensors):
            return None
        tensor, self.tensors[call] = self.tensors[call], None
        return tensor


class _CandidateOutputs:
    """The candidate's side of one layer (a capture reducer): call ``k`` is compared at once
    with the reference's call ``k`` and only the float64 sums in ``stats`` are kept."""

    def __init__(self, name: str, reference: Capture, stats: _LayerStats, order: dict[str, int]) -> None:
        self.name, self.reference, self.stats, self.order = name, reference, stats, order
        self.calls = 0

    def update(self, tensor: Tensor) -> None:
        call, self.calls = self.calls, self.calls + 1
        stored = self.reference.reducers["outputs"].get(self.name)
        ref = stored.take(call) if stored is not None else None
        if ref is not None:
            self.stats.add(ref, tensor)
        elif self.name in self.order:
            self.stats.problem = self.stats.problem or f"the candidate calls it more often ({call + 1} times)"

    def result(self) -> int:
        return self.calls


def shared_names(reference: nn.Module, candidate: nn.Module) -> list[str]:
    """Qualified names (root excluded) of the modules present in both models, reference order."""
    theirs = {name for name, _ in candidate.named_modules()}
    return [name for name, _ in reference.named_modules() if name and name in theirs]


def layer_drift(reference: nn.Module, candidate: nn.Module, inputs: Inputs) -> list[LayerDrift]:
    """Compare the output of every layer the two models share, over the same inputs.

    Two captures (:class:`~surgery.core.capture.Capture`) put forward hooks on every non-root
    module whose qualified name exists in both models;
    layers whose output holds no floating tensor are left out. For each batch the reference
    runs first and keeps only that batch's layer outputs; then, as the candidate runs, each
    layer's output is compared at once with the stored one (call ``k`` with call ``k`` for a
    module called several times) and only float64 sums are kept. Both models run in eval mode
    under ``torch.no_grad()``; training flags are restored and every hook is removed, also
    when a model raises.

    Args:
        reference: the model taken as ground truth.
        candidate: the modified model (same module names where layers correspond).
        inputs: one input tensor, or an iterable of batches.

    Returns:
        One :class:`LayerDrift` per compared layer, in the reference's execution order.

    Raises:
        ConfigError: if the models share no module name.

    Example:
        >>> rows = layer_drift(original, pruned, torch.randn(8, 3, 224, 224))
        >>> worst = min((r for r in rows if r.comparable), key=lambda r: r.cosine)
    """
    reference, candidate = compiled.prepare(reference), compiled.prepare(candidate)  # compiled: their models
    names = shared_names(reference, candidate)
    if not names:
        raise ConfigError(
            "per_layer",
            True,
            "the models share no module names, so no layer can be compared",
            f"reference has {type(reference).__name__}, candidate has {type(candidate).__name__}",
        )
    ref_modules, cand_modules = dict(reference.named_modules()), dict(candidate.named_modules())
    stats = {name: _LayerStats() for name in names}
    order: dict[str, int] = {}
    ref_seen = Capture(reference, {n: ref_modules[n] for n in names}, ("outputs",), _ReferenceOutputs)
    cand_seen = Capture(
        candidate,
        {n: cand_modules[n] for n in names},
        ("outputs",),
        lambda name, module: _CandidateOutputs(name, ref_seen, stats[name], order),
    )
    with ref_seen, cand_seen, evaluating(reference), evaluating(candidate), torch.no_grad():
        for batch in batches(inputs):
            _run_batch(ref_seen, cand_seen, reference, candidate, batch, stats, order)
    types = {name: type(module).__name__ for name, module in reference.named_modules()}
    return [stats[name].result(name, types[name], index) for name, index in order.items()]


def _run_batch(
    ref_seen: Capture,
    cand_seen: Capture,
    reference: nn.Module,
    candidate: nn.Module,
    batch: Call,
    stats: dict[str, _LayerStats],
    order: dict[str, int],
) -> None:
    """The reference runs (its capture alone active), then the candidate; the same model may be both."""
    ref_seen.clear(), cand_seen.clear()
    with ref_seen.paused(False), cand_seen.paused(True):
        batch(reference)
    for name in ref_seen.reducers["outputs"]:  # first calls, in execution order
        order.setdefault(name, len(order))
    with ref_seen.paused(True), cand_seen.paused(False):
        batch(candidate)
    for name, stored in ref_seen.reducers["outputs"].items():
        done = cand_seen.reducers["outputs"].get(name)
        if (done.calls if done else 0) < len(stored.tensors) and not stats[name].problem:
            stats[
                name
            ].problem = "the candidate does not call it as often as the reference (or its output is not floating)"
    ref_seen.clear(), cand_seen.clear()
