"""Handles that own every side effect of a surgery verb and undo or bake it."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from torch import nn
from torch.utils.hooks import RemovableHandle

from surgery.errors import UndoError

State = Literal["attached", "restored", "baked"]


@dataclass(frozen=True)
class _Step:
    description: str
    undo: Callable[[], None]
    bake: Callable[[], None] | None


class Handle:
    """The record of one surgery verb applied to one model.

    Every hook and every tensor change the verb made is a step with an undo action (used by
    :meth:`restore`) and a bake action (used by :meth:`bake`: hooks are removed, saved
    originals are dropped, the change stays in the weights). Steps run last-in-first-out; a
    failing step does not stop the others, and all failures are raised together at the end.
    Both methods are idempotent. As a context manager the handle restores on exit unless it
    was baked.

    Example:
        >>> with surgery.prune(model, 0.5) as handle:
        ...     evaluate(model)          # pruned
        >>> evaluate(model)              # exactly as before
    """

    def __init__(self, kind: str, model: nn.Module) -> None:
        self.kind = kind
        self._model = weakref.ref(model)
        self._steps: list[_Step] = []
        self._state: State = "attached"

    @property
    def state(self) -> State:
        """``"attached"``, ``"restored"`` or ``"baked"``."""
        return self._state

    @property
    def model(self) -> nn.Module | None:
        """The model this handle modifies, or ``None`` once it has been garbage-collected."""
        return self._model()

    def add(self, description: str, undo: Callable[[], None], bake: Callable[[], None] | None = None) -> None:
        """Record a change already made: ``undo`` reverses it, ``bake`` (optional) finalises it."""
        self._steps.append(_Step(description, undo, bake))

    def add_hook(self, description: str, hook: RemovableHandle) -> None:
        """Own a hook: it is removed both on restore and on bake."""
        self.add(description, hook.remove, hook.remove)

    def restore(self) -> None:
        """Undo every change exactly and remove every hook. Harmless to call twice."""
        if self._state != "attached":
            return
        self.check_undo()
        self._state = "restored"
        self._run([step.undo for step in reversed(self._steps)])

    def bake(self) -> nn.Module | None:
        """Keep the change in the weights, remove every hook, and return the now plain model.

        Raises:
            RuntimeError: if the handle was already restored.
        """
        if self._state == "restored":
            raise RuntimeError(f"cannot bake {self.kind}: it was already restored")
        if self._state == "attached":
            self._state = "baked"
            self._run([step.bake for step in reversed(self._steps) if step.bake is not None])
        return self.model

    def check_undo(self) -> None:
        """Raise before anything is undone if undoing now would be out of order (subclasses)."""

    def _run(self, actions: list[Callable[[], None]]) -> None:
        failures: list[BaseException] = []
        for action in actions:
            try:
                action()
            except Exception as err:  # keep undoing the rest; report everything at the end
                failures.append(err)
        self._steps.clear()
        if failures:
            raise UndoError(failures)

    def __enter__(self) -> Handle:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.restore()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.kind} {self._state}, {len(self._steps)} steps>"


class HandleGroup(Handle):
    """Several handles undone (and baked) as one, last applied first.

    Example:
        >>> with surgery.compose(surgery.prune(model, 0.5), surgery.quantize(model)):
        ...     evaluate(model)
    """

    def __init__(self, handles: list[Handle], model: nn.Module | None = None) -> None:
        model = model if model is not None else (handles[0].model if handles else None)
        if model is None:
            raise ValueError("compose() needs at least one handle whose model still exists")
        super().__init__("+".join(h.kind for h in handles) or "nothing", model)
        self.handles = list(handles)
        for handle in self.handles:
            self.add(repr(handle), handle.restore, handle.bake)


def compose(*handles: Handle) -> HandleGroup:
    """Group handles so that they restore and bake together, in reverse order of application."""
    return HandleGroup(list(handles))
