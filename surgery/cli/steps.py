"""Apply a run's runtime steps (prune, quantize, rewrite, finetune) to a model as one all-or-nothing handle."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from torch import Tensor, nn

from surgery.cli.config import RunConfig
from surgery.cli.data import training_data
from surgery.cli.outputs import classification_loss
from surgery.core.handles import Handle, HandleGroup
from surgery.ops.criteria import as_criterion
from surgery.ops.finetuning import finetune
from surgery.ops.pruning import prune
from surgery.ops.quantization import QuantizeHandle, quantize
from surgery.ops.rewriting import rewrite_from_config, rewrite_inputs
from surgery.ops.shrinking import shrink

Applier = Callable[[nn.Module, RunConfig, bool, dict], Handle]


def _prune(model: nn.Module, config: RunConfig, neutral: bool, calibration: dict) -> Handle:
    settings = config.prune
    if neutral:  # amount 0 everywhere by magnitude, no pattern: nothing changes
        kwargs = settings.kwargs() | {"pattern": None, "method": "l1_unstructured", "amounts": None}
        kwargs.pop("blocks", None)
        return prune(model, 0.0, **kwargs)
    gradients = as_criterion(settings.method).needs_gradients
    return prune(
        model,
        settings.amount,
        calibration=calibration.get("prune"),
        loss=classification_loss if gradients else None,
        **settings.kwargs(),
    )


def _quantize(model: nn.Module, config: RunConfig, neutral: bool, calibration: dict) -> Handle:
    if neutral:  # quantization off
        return Handle("quantize", model)
    return quantize(model, calibration=calibration.get("quantize"), **config.quantize.kwargs())


def _rewrite(model: nn.Module, config: RunConfig, neutral: bool, calibration: dict) -> Handle:
    settings = config.rewrite
    fn = rewrite_from_config("identity") if neutral else rewrite_from_config(settings.name, **settings.kwargs)
    return rewrite_inputs(model, fn, select=settings.select, exclude=settings.exclude or None)


def _finetune(model: nn.Module, config: RunConfig, neutral: bool, calibration: dict) -> Handle:
    settings = config.finetune
    if neutral:  # no training
        return Handle("finetune", model)
    batches, evaluate = training_data(config.data, settings.batch_size)
    return finetune(
        model,
        batches,
        epochs=settings.epochs,
        lr=settings.lr,
        optimizer=settings.optimizer,
        weight_decay=settings.weight_decay,
        evaluate=evaluate,
        eval_every=settings.eval_every,
        seed=config.seed,
        loss=classification_loss,
    )


def _shrink(model: nn.Module, config: RunConfig, neutral: bool, calibration: dict) -> Handle:
    settings = config.shrink
    return shrink(
        model, 0.0 if neutral else settings.amount, example_inputs=calibration["shrink"][0], **settings.kwargs()
    )


APPLIERS: dict[str, Applier] = {
    "prune": _prune,
    "quantize": _quantize,
    "rewrite": _rewrite,
    "finetune": _finetune,
    "shrink": _shrink,
}


def apply_steps(
    model: nn.Module, config: RunConfig, *, neutral: bool = False, calibration: dict | None = None
) -> HandleGroup:
    """Apply ``config.steps`` in order; if one fails, undo those already applied and re-raise.

    ``neutral=True`` applies the same steps with settings that must not change any output
    (prune amount 0, quantization off, identity rewrite): the ``identity`` check. ``calibration`` holds
    each calibrated step's batches by step name (prune, quantize).
    """
    handles: list[Handle] = []
    try:
        for step in config.steps:
            handles.append(APPLIERS[step](model, config, neutral, calibration or {}))
    except BaseException as err:
        _undo(handles, model, err)
        raise
    return HandleGroup(handles, model)


def _undo(handles: list[Handle], model: nn.Module, error: BaseException) -> None:
    """Restore the steps applied so far, last first; one failing does not stop the others, and
    ``error`` stays the one raised (an undo failure is added to it as a note)."""
    if handles:
        HandleGroup(handles, model).rollback(error)


def find(handle: HandleGroup, kind: str) -> Handle | None:
    """The handle of one step kind inside a composed handle, if present."""
    return next((h for h in handle.handles if h.kind == kind), None)


def reattach(model: nn.Module, config: RunConfig, qparams: dict[str, Tensor] | Path) -> Handle | None:
    """Re-attach what baking cannot fold into weights — activation quantization (from saved
    parameters, without calibration) and input rewriting — in step order; None if nothing."""
    handles: list[Handle] = []
    try:
        for step in config.steps:
            if step == "quantize" and config.quantize.activations is not None:
                q = config.quantize
                handles.append(
                    quantize(
                        model,
                        weights=None,
                        activations=q.activation_spec(),
                        select=q.select,
                        exclude=q.exclude or None,
                        where=q.where,
                        qparams=qparams,
                        progress=False,
                    )
                )
            elif step == "rewrite":
                handles.append(_rewrite(model, config, False, {}))
    except BaseException as err:
        _undo(handles, model, err)
        raise
    return HandleGroup(handles, model) if handles else None


def saved_qparams(handle: HandleGroup) -> dict[str, Tensor]:
    """Activation quantization parameters of a composed handle (empty without any)."""
    quantizing = find(handle, "quantize")
    return quantizing.qparams() if isinstance(quantizing, QuantizeHandle) else {}
