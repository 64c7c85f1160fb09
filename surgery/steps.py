"""Apply a run's runtime steps (prune, ...) to a model as one all-or-nothing handle."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from surgery.config import RunConfig
from surgery.handles import Handle, HandleGroup
from surgery.pruning import prune


def _prune(model: nn.Module, config: RunConfig, neutral: bool) -> Handle:
    settings = config.prune
    return prune(model, 0.0 if neutral else settings.amount, **settings.kwargs())


APPLIERS: dict[str, Callable[[nn.Module, RunConfig, bool], Handle]] = {"prune": _prune}


def apply_steps(model: nn.Module, config: RunConfig, *, neutral: bool = False) -> HandleGroup:
    """Apply ``config.steps`` in order; if one fails, undo those already applied and re-raise.

    ``neutral=True`` applies the same steps with settings that must not change any output
    (prune amount 0, ...): the ``identity`` check.
    """
    handles: list[Handle] = []
    try:
        for step in config.steps:
            handles.append(APPLIERS[step](model, config, neutral))
    except BaseException:
        for handle in reversed(handles):
            handle.restore()
        raise
    return HandleGroup(handles, model)


def find(handle: HandleGroup, kind: str) -> Handle | None:
    """The handle of one step kind inside a composed handle, if present."""
    return next((h for h in handle.handles if h.kind == kind), None)
