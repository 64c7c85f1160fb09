"""Handles that own every side effect of a surgery verb and undo or bake it."""

from __future__ import annotations

import contextlib
import itertools
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal

from torch import nn
from torch.utils.hooks import RemovableHandle
from torch.utils.weak import WeakIdKeyDictionary

from surgery.core import guards
from surgery.core._compat import hook_dicts
from surgery.core.errors import AlreadyModifiedError, ConfigError, ConfigTypeError, ParameterReplacedError, UndoError
from surgery.core.targets import Coverage, coverage_of

State = Literal["attached", "restored", "baked"]
Revert = Callable[[], None]

_scopes = threading.local()  # this thread's open restored_on_error() blocks: the handles made in each
_later = WeakIdKeyDictionary()  # model -> handles that must be undone before any earlier one (finetune)
_ATTACHED = "_surgery_attached"  # the module attribute listing the handles attached to it (see _AttachedHandles)
_COPIED = "_surgery_copied"  # a copy's record of its original's surgery, once handles are attached to the copy
_created = itertools.count()


class _CopiedSurgery(list):
    """What a copy (or an unpickled model) holds of the surgery its original had: each handle's kind
    and what it kept outside the weights, as (kind, items). The hooks came along with the copy; no
    handle owns them, so :func:`copied_outside` lets export refuse or list them by name."""

    def __reduce__(self) -> tuple:
        return (_CopiedSurgery, (list(self),))


class _AttachedHandles(list):
    """The handles attached to one module, kept in the module's own ``__dict__``: surgery stays findable
    (:func:`attached_to`) and restorable for as long as the model lives, whether or not the caller kept
    the handle, and dies with the model (a cycle the garbage collector takes). A copy or a pickle of
    the model holds no handle, only a :class:`_CopiedSurgery` record of them (its hooks are copies)."""

    def _record(self) -> _CopiedSurgery:
        return _CopiedSurgery((h.kind, tuple(h.outside_weights())) for h in self if h.state == "attached")

    def __deepcopy__(self, memo: dict) -> _CopiedSurgery:
        return self._record()

    def __copy__(self) -> _CopiedSurgery:
        return self._record()

    def __reduce__(self) -> tuple:
        return self._record().__reduce__()


def _keep_on(module: nn.Module, handle: Handle) -> None:
    kept = module.__dict__.get(_ATTACHED)
    if isinstance(kept, _CopiedSurgery):  # a copy's record stays beside the handles attached to the copy
        module.__dict__[_COPIED] = kept
    if not isinstance(kept, _AttachedHandles):
        kept = module.__dict__[_ATTACHED] = _AttachedHandles()
    kept.append(handle)


def copied_outside(model: nn.Module) -> list[str]:
    """What surgery copied along with ``model`` (``copy.deepcopy``, pickle) keeps outside the weights:
    hooks that no handle owns, named as their handles named them, with the kind."""
    records = (module.__dict__.get(key) for module in model.modules() for key in (_ATTACHED, _COPIED))
    return [
        f"{item} (copied with the model from one under {kind}; no handle owns it)"
        for record in records
        if isinstance(record, _CopiedSurgery)
        for kind, items in record
        for item in items
    ]


def _drop_from(module: nn.Module | None, handle: Handle) -> None:
    kept = module.__dict__.get(_ATTACHED) if module is not None else None
    if isinstance(kept, _AttachedHandles):
        kept[:] = [each for each in kept if each is not handle]
        if not kept:
            del module.__dict__[_ATTACHED]


@dataclass(frozen=True)
class _Step:
    description: str
    undo: Callable[[], None]
    bake: Callable[[], None] | None
    check: Callable[[], None] | None = None  # raises before anything is undone or baked, if it cannot be now


class Handle:
    """The record of one surgery verb applied to one model.

    Every hook and every tensor change the verb made is a step with an undo action (used by
    :meth:`restore`) and a bake action (used by :meth:`bake`: hooks are removed, the change
    stays in the weights, saved originals are dropped). Steps run last-in-first-out.

    ``restore()`` keeps going when a step fails — also on ``KeyboardInterrupt`` — and then
    raises :class:`~surgery.core.errors.UndoError` with every failure (or re-raises the interrupt);
    a failed step is reported once, not retried. ``bake()`` is all-or-nothing: if a step
    fails, the steps already baked are put back (hook dicts and tensor guards as they were),
    the handle stays attached — hooked and correct, still restorable — and the error is
    re-raised. Both methods are idempotent. As a context manager the handle restores on exit
    unless it was baked.

    Example:
        >>> with surgery.prune(model, 0.5) as handle:
        ...     evaluate(model)          # pruned
        >>> evaluate(model)              # exactly as before
    """

    def __init__(self, kind: str, model: nn.Module) -> None:
        self.kind = kind
        self._model = weakref.ref(model)
        self._steps: list[_Step] = []
        self._hooks: list[RemovableHandle] = []
        self._records: list = []
        self._state: State = "attached"
        self._order = next(_created)
        if self.undo_first:
            _later.setdefault(model, weakref.WeakSet()).add(self)
        if type(self)._tracked:
            _keep_on(model, self)
            for scope in getattr(_scopes, "stack", []):
                scope.append(self)

    _baking = False  # a composed group's member whose steps are baked while the group finishes
    _tracked = True  # recorded by an open restored_on_error() block (a group's members are, instead)
    undo_first = False  # True: every handle applied before this one refuses restore() while it is attached

    @property
    def state(self) -> State:
        """``"attached"``, ``"restored"`` or ``"baked"``."""
        return self._state

    @property
    def model(self) -> nn.Module | None:
        """The model this handle modifies, or ``None`` once it has been garbage-collected."""
        return self._model()

    def add(
        self,
        description: str,
        undo: Callable[[], None],
        bake: Callable[[], None] | None = None,
        *,
        check: Callable[[], None] | None = None,
        first: bool = False,
    ) -> None:
        """Record a change already made: ``undo`` reverses it, ``bake`` (optional) finalises it,
        ``check`` (optional) raises before any step is undone or baked when this one cannot be now;
        ``first``: a change made before every step recorded so far (undone and baked after them all)."""
        self._steps.insert(0 if first else len(self._steps), _Step(description, undo, bake, check))

    def add_record(self, record) -> None:
        """Record an undo object (``description``, ``restore()``, ``keep()``), such as a
        :class:`~surgery.core.transforms.AttachedTransform`, before the change it undoes."""
        self.add(record.description, record.restore, record.keep)
        self._records.append(record)

    @property
    def records(self) -> list:
        """The undo records of the changes still attached (empty once restored or baked)."""
        return list(self._records)

    def add_hook(self, description: str, hook: RemovableHandle) -> None:
        """Own a hook: it is removed both on restore and on bake (at once if recording fails)."""
        try:
            self._hooks.append(hook)
            self.add(description, lambda: hook.remove(), lambda: hook.remove())
        except BaseException:
            hook.remove()
            raise

    def restore(self) -> None:
        """Undo every change exactly and remove every hook. Harmless to call twice.

        Raises:
            AlreadyModifiedError: before anything changes, if undoing now would be out of order.
            UndoError: after every other step ran, if some steps failed.
        """
        if self._state != "attached":
            return
        self._check_nothing_later()
        self.check_undo()
        self._state = "restored"
        failures = _run_all([step.undo for step in reversed(self._steps)])
        self._forget()
        _raise(failures)

    @property
    def coverage(self) -> Coverage | None:
        """How much of the model the verb changed (:class:`~surgery.core.targets.Coverage`: the share
        of parameters and bytes, the largest tensors left and why): its selection's, or else the
        parameters its records hold (smooth, awq, rotate); ``None`` when it changes no parameter."""
        selection = getattr(self, "selection", None)
        if getattr(selection, "coverage", None) is not None:
            return selection.coverage
        model = self.model
        if model is None or not self._records:
            return None
        changed = {record.name: record.param for record in self._records}
        return coverage_of(model, changed, [], left_reason=f"not changed by {self.kind}")

    def outside_weights(self) -> list[str]:
        """What this change keeps outside the weights, so that baking or saving the weights
        drops it (activation quantization, input rewrites); empty for changes the weights hold."""
        return []

    def export_parts(self) -> list:
        """What a deployment format may hold of this change (integer grids, activation scales,
        sparsity masks; see :mod:`surgery.ops.numerics.deployment`); empty for changes it cannot."""
        return []

    def bake(self) -> nn.Module | None:
        """Keep the change in the weights, remove every hook, and return the now plain model.

        All or nothing: if a step fails (or is interrupted), the model is left hooked exactly
        as before and the handle stays attached.

        Raises:
            RuntimeError: if the handle was already restored.
            AlreadyModifiedError: before anything changes, if baking now would be out of order.
        """
        if self._state == "restored":
            raise RuntimeError(f"cannot bake {self.kind}: it was already restored")
        if self._state == "attached":
            revert = self._savepoint()
            try:
                self._bake_steps()
            except BaseException:
                revert()
                raise
            self._baked()
        return self.model

    def check_undo(self) -> None:
        """Raise before anything is undone if undoing now would be out of order (another
        transform attached later on top of one of this handle's), or would act on a parameter
        the model no longer holds (replaced by ``load_state_dict(assign=True)``: ``enforce()`` first)."""
        for step in self._steps:
            if step.check is not None:
                step.check()
        model = self.model
        current = dict(model.named_parameters(remove_duplicate=False)) if model is not None and self._records else {}
        for record in self._records:
            guards.check_last(record.param, record.transform, record.name)
            if record.name in current and current[record.name] is not record.param:
                raise ParameterReplacedError(
                    f"{self.kind}: {record.name} was replaced by a new object after the "
                    "surgery was attached; call enforce() first to carry it over"
                )

    def _check_nothing_later(self) -> None:
        """Refuse to restore under a later handle that must be undone first (a fine-tuning run
        on top would otherwise put back weights taken with this handle's changes in them)."""
        model = self.model
        for later in list(_later.get(model, ())) if model is not None else []:
            if later is not self and later.state == "attached" and later._order > self._order:
                raise AlreadyModifiedError(
                    f"{self.kind}: {later.kind} was applied after it and is still attached; "
                    f"restore {later.kind} first (undo in reverse order), or compose them"
                )

    def enforce(self) -> None:
        """Re-apply this handle's transforms to the weights now.

        Surgery re-applies them by itself after every optimizer step (fused ones too) and before
        each forward when a weight changed; call this after what it cannot see: an in-place
        edit through ``.data`` (it bypasses PyTorch's version counter), or
        ``load_state_dict(..., assign=True)``, which puts new parameter objects in the model
        (the next forward raises :class:`~surgery.core.errors.ParameterReplacedError` until
        then): the transforms, their gradient hooks and the undo records move to the new ones.
        """
        if self._state == "attached":
            for record in self._records:
                record.enforce(self)

    @contextlib.contextmanager
    def applying(self) -> Iterator[Handle]:
        """A verb's all-or-nothing block: an error or an interrupt inside it undoes what the handle
        holds so far (:meth:`rollback`) and is raised again.

        Example:
            >>> with handle.applying():
            ...     attach_all(handle, model, updates, "smooth hook")
        """
        try:
            yield self
        except BaseException as err:
            self.rollback(err)
            raise

    def rollback(self, error: BaseException) -> None:
        """Undo a verb that failed with ``error`` while applying: ``error`` stays the one raised
        (a failure of the undo itself is added to it as a note, never hiding it)."""
        try:
            self.restore()
        except Exception as undo_error:  # noqa: BLE001 - reported on the original error
            if hasattr(error, "add_note"):
                error.add_note(f"undoing the partial change also failed: {undo_error}")

    def _savepoint(self) -> Revert:
        """What baking changes — the dicts holding this handle's hooks and the tensor guards of
        the model's parameters — as a callable that puts it back exactly."""
        dicts = {id(d): d for hook in self._hooks for d in hook_dicts(hook)}
        saved = [(d, list(d.items())) for d in dicts.values()]
        model = self.model
        put_back_guards = guards.savepoint(model.parameters() if model is not None else [])

        def revert() -> None:
            for hook_dict, items in saved:
                hook_dict.clear()
                hook_dict.update(items)
            put_back_guards()

        return revert

    def _bake_steps(self) -> None:
        """Run the bake actions, last first, stopping at the first failure."""
        self.check_undo()
        for step in reversed(self._steps):
            if step.bake is not None:
                step.bake()

    def _baked(self) -> None:
        self._state = "baked"
        self._forget()

    def _forget(self) -> None:
        """Drop every step (and with them saved originals): the handle is done, and no longer kept on its model."""
        self._steps.clear()
        self._hooks.clear()
        self._records.clear()
        _drop_from(self.model, self)

    def __enter__(self) -> Handle:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.restore()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.kind} {self._state}, {len(self._steps)} steps>"


class HandleGroup(Handle):
    """Several handles undone (and baked) as one, last applied first; baking is all-or-nothing
    across the group.

    Example:
        >>> with surgery.compose(surgery.prune(model, 0.5), surgery.quantize(model)):
        ...     evaluate(model)
    """

    _tracked = False

    def __init__(self, handles: list[Handle], model: nn.Module | None = None) -> None:
        for handle in handles:
            if not isinstance(handle, Handle):
                raise ConfigTypeError(
                    "compose.handles",
                    handle,
                    "must be handles returned by surgery verbs (prune, quantize, rewrite_inputs, compose)",
                )
        model = model if model is not None else (handles[0].model if handles else None)
        if model is None:
            raise ConfigError("compose.handles", len(handles), "needs at least one handle whose model still exists")
        super().__init__("+".join(h.kind for h in handles) or "nothing", model)
        self.handles = list(handles)
        for handle in self.handles:
            self.add(repr(handle), handle.restore)

    def enforce(self) -> None:
        for handle in self.handles:
            handle.enforce()

    def outside_weights(self) -> list[str]:
        return [item for handle in self.handles for item in handle.outside_weights()]

    def _savepoint(self) -> Revert:
        reverts = [h._savepoint() for h in self.handles if h.state == "attached"]

        def revert() -> None:
            for each in reversed(reverts):
                each()

        return revert

    def _bake_steps(self) -> None:
        done: list[Handle] = []
        try:
            for handle in reversed(self.handles):
                if handle.state == "restored":
                    raise RuntimeError(f"cannot bake {self.kind}: {handle.kind} was already restored")
                if handle.state == "attached":
                    handle._bake_steps()
                    handle._baking = True  # baked but for its state: no longer "on top" of earlier members
                    done.append(handle)
        finally:
            for handle in done:
                handle._baking = False

    def _baked(self) -> None:
        for handle in self.handles:
            if handle.state == "attached":
                handle._baked()
        super()._baked()


@contextlib.contextmanager
def restored_on_error() -> Iterator[list[Handle]]:
    """If the block raises (an interrupt too), restore every handle created inside it in this
    thread and still attached, last first — handles the block never got hold of included
    (an error between a verb returning and its result being assigned) — then re-raise.
    Handles attached before the block are left alone."""
    made: list[Handle] = []
    stack = _scopes.__dict__.setdefault("stack", [])
    stack.append(made)
    try:
        yield made
    except BaseException as err:
        for handle in reversed(made):
            if handle.state == "attached":
                handle.rollback(err)
        raise
    finally:  # by identity: an inner block's list may equal this one's by value
        del stack[next(i for i in range(len(stack) - 1, -1, -1) if stack[i] is made)]


def attached_to(model: nn.Module) -> list[Handle]:
    """The handles still attached to ``model`` or to any of its submodules, first applied first
    (a group's members, each on its own): all the surgery ``model`` runs with now.

    Example:
        >>> handle = surgery.prune(model, 0.5)
        >>> attached_to(model) == [handle]
    """
    found = {
        id(h): h
        for module in model.modules()
        for h in list(module.__dict__.get(_ATTACHED, ()))
        if isinstance(h, Handle) and h.state == "attached"
    }
    return sorted(found.values(), key=lambda h: h._order)


def attached_after(handle: Handle) -> list[Handle]:
    """The handles applied to ``handle``'s model after it and still attached, first applied first
    (groups opened: a group's members count, never ``handle`` itself)."""
    model = handle.model
    if model is None:
        return []
    own = {id(h) for h in members(handle)}
    return [h for h in attached_to(model) if h._order > handle._order and id(h) not in own and not h._baking]


def members(handle: Handle) -> list[Handle]:
    """The handles a group is made of, nested groups opened; ``[handle]`` for a single one."""
    if isinstance(handle, HandleGroup):
        return [inner for each in handle.handles for inner in members(each)]
    return [handle]


def compose(*handles: Handle) -> HandleGroup:
    """Group handles so that they restore and bake together, in reverse order of application."""
    return HandleGroup(list(handles))


def _run_all(actions: list[Callable[[], None]]) -> list[BaseException]:
    """Run every action, whatever fails — an interrupt too: a half-undone model is worse than
    a slightly later stop. Returns the failures, in order."""
    failures: list[BaseException] = []
    for action in actions:
        try:
            action()
        except BaseException as err:  # noqa: BLE001 - collected, re-raised by _raise
            failures.append(err)
    return failures


def _raise(failures: list[BaseException]) -> None:
    """Re-raise the first interrupt (``KeyboardInterrupt``, ``SystemExit``) among ``failures``,
    else raise :class:`UndoError` with all of them (those of a composed handle listed flat)."""
    interrupts = [f for f in failures if not isinstance(f, Exception)]
    if interrupts:
        raise interrupts[0]
    if failures:
        raise UndoError([inner for f in failures for inner in (f.failures if isinstance(f, UndoError) else [f])])
