"""Apply a run's runtime steps (prune, quantize) to a model as one all-or-nothing handle."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from torch import Tensor, nn

from surgery.config import RunConfig
from surgery.handles import Handle, HandleGroup
from surgery.pruning import prune
from surgery.quantization import QuantizeHandle, quantize

Applier = Callable[[nn.Module, RunConfig, bool, list], Handle]


def _prune(model: nn.Module, config: RunConfig, neutral: bool, calibration: list) -> Handle:
    settings = config.prune
    return prune(model, 0.0 if neutral else settings.amount, **settings.kwargs())


def _quantize(model: nn.Module, config: RunConfig, neutral: bool, calibration: list) -> Handle:
    if neutral:  # quantization off
        return Handle("quantize", model)
    return quantize(model, calibration=calibration, **config.quantize.kwargs())


APPLIERS: dict[str, Applier] = {"prune": _prune, "quantize": _quantize}


def apply_steps(model: nn.Module, config: RunConfig, *, neutral: bool = False,
                calibration: list | None = None) -> HandleGroup:
    """Apply ``config.steps`` in order; if one fails, undo those already applied and re-raise.

    ``neutral=True`` applies the same steps with settings that must not change any output
    (prune amount 0, quantization off): the ``identity`` check. ``calibration`` batches feed
    activation quantization.
    """
    handles: list[Handle] = []
    try:
        for step in config.steps:
            handles.append(APPLIERS[step](model, config, neutral, calibration or []))
    except BaseException:
        for handle in reversed(handles):
            handle.restore()
        raise
    return HandleGroup(handles, model)


def find(handle: HandleGroup, kind: str) -> Handle | None:
    """The handle of one step kind inside a composed handle, if present."""
    return next((h for h in handle.handles if h.kind == kind), None)


def reattach(model: nn.Module, config: RunConfig, qparams: dict[str, Tensor] | Path) -> Handle | None:
    """Re-attach what baking cannot fold into weights (activation quantization) from saved
    parameters, without calibration; None when the steps have nothing of the kind."""
    settings = config.quantize
    if "quantize" not in config.steps or settings.activations is None:
        return None
    return quantize(model, weights=None, activations=settings.activations, select=settings.select,
                    exclude=settings.exclude or None, where=settings.where, qparams=qparams, progress=False)


def saved_qparams(handle: HandleGroup) -> dict[str, Tensor]:
    """Activation quantization parameters of a composed handle (empty without any)."""
    quantizing = find(handle, "quantize")
    return quantizing.qparams() if isinstance(quantizing, QuantizeHandle) else {}
