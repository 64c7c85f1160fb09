"""Apply a recipe's steps to a model, in order, as one all-or-nothing handle, through the
registered :class:`~surgery.cli.steps.Step` of each name."""

from __future__ import annotations

import logging
from pathlib import Path

from torch import Tensor, nn

from surgery.cli.config import RunConfig
from surgery.cli.steps import Step, StepRun, step_named
from surgery.core.errors import ConfigError, ConfigTypeError
from surgery.core.handles import Handle, HandleGroup
from surgery.core.interrupts import raise_pending
from surgery.core.targets import selections_logged_at


def apply_steps(
    model: nn.Module,
    config: RunConfig,
    *,
    neutral: bool = False,
    checking: bool = False,
    runs: dict[str, StepRun] | None = None,
) -> HandleGroup:
    """Apply ``config.steps`` in order; if one fails, undo those already applied and re-raise.

    ``neutral=True`` applies each step in its neutral form, which must not change any output
    (prune amount 0, quantization off, identity rewrite): the ``identity`` check.
    ``checking=True`` leaves out steps that change nothing (sensitivity): the checks apply the
    steps again on copies. ``runs`` holds what each step is given (its calibration batches...).
    The verbs' selection lines are logged at DEBUG: the run's summary (and ``report.md``) says
    what each step matched and skipped, once; a Python caller of the verbs still sees them at INFO.
    """
    handles: list[Handle] = []
    steps: list[Step] = []
    try:
        with selections_logged_at(logging.DEBUG):  # the summary says each step's selection once
            _apply_each(model, config, handles, steps, neutral, checking, runs)
    except BaseException as err:
        _undo(handles, model, err)
        raise
    return AppliedSteps(handles, model, steps)


class AppliedSteps(HandleGroup):
    """The handles of a recipe's steps, each beside the :class:`Step` that made it: the runner
    asks the step (never the handle's class) what a fresh build needs, which files it writes,
    which activation parameters it saves."""

    def __init__(self, handles: list[Handle], model: nn.Module, steps: list[Step]) -> None:
        super().__init__(handles, model)
        self.steps = list(steps)

    def pairs(self) -> list[tuple[Step, Handle]]:
        return list(zip(self.steps, self.handles))


def _apply_each(
    model: nn.Module,
    config: RunConfig,
    handles: list[Handle],
    steps: list[Step],
    neutral: bool,
    checking: bool,
    runs: dict[str, StepRun] | None,
) -> None:
    """Apply each step of ``config.steps`` in order, appending its handle to ``handles``."""
    for name in config.steps:
        raise_pending()  # a safe point for an interrupt: between steps
        step = step_named(name)
        if checking and not step.changes_model:
            continue
        run = (runs or {}).get(name) or StepRun(config)
        settings = config.settings(name)
        if neutral:
            handle = step.checking.neutral(model, settings, run) or Handle(step.name, model)  # None: nothing
        else:
            handle = step(model, settings, run)
        if not isinstance(handle, Handle):  # nothing could undo it: the checks would pass on no work
            raise ConfigTypeError(
                f"steps.{name}", type(handle).__name__, "a step's apply() must return the handle of what it did"
            )
        handles.append(handle)
        steps.append(step)


def _undo(handles: list[Handle], model: nn.Module, error: BaseException) -> None:
    """Restore the steps applied so far, last first; one failing does not stop the others, and
    ``error`` stays the one raised (an undo failure is added to it as a note)."""
    if handles:
        HandleGroup(handles, model).rollback(error)


def reattach(model: nn.Module, config: RunConfig, qparams: dict[str, Tensor] | Path) -> Handle | None:
    """Re-attach what baking cannot fold into weights — activation quantization (from saved
    parameters, without calibration) and input rewriting — in step order; None if nothing."""
    handles: list[Handle] = []
    try:
        for name in config.steps:
            handle = step_named(name).checking.reattach(model, config.settings(name), qparams)
            if handle is not None:
                handles.append(handle)
    except BaseException as err:
        _undo(handles, model, err)
        raise
    return HandleGroup(handles, model) if handles else None


def saved_qparams(handle: AppliedSteps) -> dict[str, Tensor]:
    """Activation quantization parameters of the applied steps (empty without any); two steps
    quantizing one layer's activations are refused (one file holds one set a layer)."""
    found: dict[str, Tensor] = {}
    owners: dict[str, str] = {}
    for step, part in handle.pairs():
        for key, value in step.checking.activation_qparams(part).items():
            if key in found and key.endswith(".scale"):
                raise ConfigError(
                    "steps",
                    f"{owners[key]}, {part.kind}",
                    f"both quantize {key.removesuffix('.scale')}'s activations and one file of parameters holds "
                    "one set a layer; exclude that layer from one step (or make one dynamic)",
                )
            found[key], owners[key] = value, part.kind
    return found
