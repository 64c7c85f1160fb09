"""Per-layer drift: activations of two models compared layer by layer with forward hooks."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from surgery.analysis.comparison import StreamingError
from surgery.core.inputs import Call, Inputs, batches, evaluating
from surgery.core.errors import ConfigError


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
        return {"name": self.name, "type": self.type, "cosine": self.cosine, "sqnr_db": self.sqnr_db,
                "max_abs": self.max_abs, "index": self.index, "depth": self.depth, "calls": self.calls,
                "detail": self.detail}


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


class _Store:
    """The reference's outputs of the current batch only: ``{name: [call 0, call 1, ...]}``.

    Each entry is released as soon as the candidate's matching call has been compared, and
    whatever is left is dropped before the next batch.
    """

    def __init__(self) -> None:
        self.outputs: dict[str, list[Tensor | None]] = {}
        self.size = 0  # tensors currently held

    def put(self, name: str, tensor: Tensor) -> None:
        self.outputs.setdefault(name, []).append(tensor)
        self.size += 1

    def take(self, name: str, call: int) -> Tensor | None:
        calls = self.outputs.get(name, [])
        if call >= len(calls) or calls[call] is None:
            return None
        tensor, calls[call] = calls[call], None
        self.size -= 1
        return tensor

    def clear(self) -> None:
        self.outputs.clear()
        self.size = 0


def first_floating(value: Any) -> Tensor | None:
    """The output itself if it is a floating tensor, else the first one in a tuple or list."""
    if isinstance(value, Tensor):
        return value if value.is_floating_point() else None
    if isinstance(value, (tuple, list)):
        return next((t for t in value if isinstance(t, Tensor) and t.is_floating_point()), None)
    return None


class _Recorder:
    """The hooks' shared state: which model is running, per-batch call counters, the sums."""

    def __init__(self, names: list[str]) -> None:
        self.phase = "idle"  # "reference" or "candidate": a hook fires only in its own phase
        self.store = _Store()
        self.order: dict[str, int] = {}
        self.ref_calls: dict[str, int] = {}
        self.cand_calls: dict[str, int] = {}
        self.stats = {name: _LayerStats() for name in names}

    def start_batch(self) -> None:
        self.store.clear()
        self.ref_calls.clear()
        self.cand_calls.clear()

    def reference_hook(self, name: str):
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            tensor = first_floating(output)
            if self.phase != "reference" or tensor is None:
                return
            self.order.setdefault(name, len(self.order))
            self.ref_calls[name] = self.ref_calls.get(name, 0) + 1
            self.store.put(name, tensor.detach().clone())  # later in-place ops must not touch it
        return hook

    def candidate_hook(self, name: str):
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            if self.phase != "candidate":
                return
            call = self.cand_calls.get(name, 0)
            self.cand_calls[name] = call + 1
            ref, cand = self.store.take(name, call), first_floating(output)
            stats = self.stats[name]
            if ref is None and cand is not None and name in self.order:
                stats.problem = stats.problem or f"the candidate calls it more often ({call + 1} times)"
            elif ref is not None and cand is None:
                stats.problem = stats.problem or "the candidate's output is not a floating tensor"
            elif ref is not None:
                stats.add(ref, cand)
        return hook

    def finish_batch(self) -> None:
        for name, count in self.ref_calls.items():
            if self.cand_calls.get(name, 0) < count and not self.stats[name].problem:
                self.stats[name].problem = "the candidate does not call it as often as the reference"
        self.store.clear()


def shared_names(reference: nn.Module, candidate: nn.Module) -> list[str]:
    """Qualified names (root excluded) of the modules present in both models, reference order."""
    theirs = {name for name, _ in candidate.named_modules()}
    return [name for name, _ in reference.named_modules() if name and name in theirs]


def _install(model: nn.Module, names: list[str], make_hook) -> Iterator[RemovableHandle]:
    modules = dict(model.named_modules())
    for name in names:
        yield modules[name].register_forward_hook(make_hook(name))


def layer_drift(reference: nn.Module, candidate: nn.Module, inputs: Inputs) -> list[LayerDrift]:
    """Compare the output of every layer the two models share, over the same inputs.

    Forward hooks go on every non-root module whose qualified name exists in both models;
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
    names = shared_names(reference, candidate)
    if not names:
        raise ConfigError("per_layer", True, "the models share no module names, so no layer can be compared",
                          f"reference has {type(reference).__name__}, candidate has {type(candidate).__name__}")
    recorder = _Recorder(names)
    handles: list[RemovableHandle] = []
    try:
        handles.extend(_install(reference, names, recorder.reference_hook))
        handles.extend(_install(candidate, names, recorder.candidate_hook))
        with evaluating(reference), evaluating(candidate), torch.no_grad():
            for batch in batches(inputs):
                _run_batch(recorder, reference, candidate, batch)
    finally:
        recorder.phase = "idle"
        recorder.store.clear()
        for handle in reversed(handles):
            handle.remove()
    types = {name: type(module).__name__ for name, module in reference.named_modules()}
    return [recorder.stats[name].result(name, types[name], index) for name, index in recorder.order.items()]


def _run_batch(recorder: _Recorder, reference: nn.Module, candidate: nn.Module, batch: Call) -> None:
    recorder.start_batch()
    recorder.phase = "reference"
    batch(reference)
    recorder.phase = "candidate"
    batch(candidate)
    recorder.phase = "idle"
    recorder.finish_batch()
