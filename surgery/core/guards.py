"""Tensor guards: in-place changes to a parameter (masks, fake quantization) kept applied.

A verb such as ``prune`` or ``quantize`` rewrites a parameter in place and registers a
*transform* on the parameter's :class:`TensorGuard`. Forward-pre hooks (one
:class:`SubtreeEnforcer` on every module from the root down to each owner of a guarded
parameter) call :meth:`TensorGuard.enforce`, which re-applies every transform, in the order
they were attached, only when the tensor changed since it was last made consistent (an
optimizer step, ``load_state_dict``, ``.to()``): an unchanged weight costs one comparison.
Transforms on one parameter are undone last-in-first-out. While ``torch.compile`` traces a
hook, the same check is put in the graph as one opaque operator (:mod:`surgery.core.compiled`).

Training: a fused optimizer step (and an edit through ``.data``) writes a parameter without
bumping its version counter, so the check above cannot see it. A global optimizer step
post-hook (:class:`StepEnforcer`, owned by the verb's handle) therefore re-applies the
transforms of every parameter an optimizer has just stepped, whatever its implementation; and
a parameter replaced by a new object (``load_state_dict(assign=True)``) is detected before
the next forward of its owner (:class:`ParameterReplacedError`).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable
from typing import Protocol

import torch
from torch import nn
from torch.compiler import is_compiling
from torch.utils.weak import WeakIdKeyDictionary

from surgery.core import compiled
from surgery.core._compat import get_slot, tensor_stamp
from surgery.core.errors import AlreadyModifiedError, ConfigError, ParameterReplacedError


class _GuardTable:
    """parameter -> its :class:`TensorGuard` while any transform is attached, holding neither
    strongly: the hooks and handles that use a guard keep it alive, and a model dropped with its
    surgery attached takes its parameters and guards with it (a guard refers to its parameter,
    so a strong value would keep the weak key alive for ever)."""

    def __init__(self) -> None:
        self._refs = WeakIdKeyDictionary()

    def get(self, param: torch.Tensor) -> TensorGuard | None:
        ref = self._refs.get(param)
        return ref() if ref is not None else None

    def __getitem__(self, param: torch.Tensor) -> TensorGuard:
        guard = self.get(param)
        if guard is None:
            raise KeyError("no transform is attached to this parameter")
        return guard

    def __setitem__(self, param: torch.Tensor, guard: TensorGuard) -> None:
        self._refs[param] = weakref.ref(guard)

    def __delitem__(self, param: torch.Tensor) -> None:
        del self._refs[param]


_guards = _GuardTable()
_lock = threading.Lock()


class Transform(Protocol):
    """Something that rewrites a parameter in place; ``kind`` names the verb (one per kind)."""

    kind: str

    def apply(self, param: torch.Tensor) -> None: ...


class TensorGuard:
    """The transforms attached to one parameter, re-applied in order when it changes."""

    def __init__(self, param: nn.Parameter) -> None:
        self.param = param
        self.transforms: list[Transform] = []
        self.seen: tuple[int, int] | None = None
        self.token = compiled.register(self)  # how a compiled graph finds this guard

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "token"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.token = compiled.register(self)  # a copy is a different guard

    def mark_clean(self) -> None:
        """Record that the parameter currently satisfies every transform."""
        self.seen = tensor_stamp(self.param)

    def enforce(self, force: bool = False) -> None:
        """Re-apply every transform if the parameter changed since it was last consistent (or
        ``force``: whatever its version counter says, after a fused step or a ``.data`` edit)."""
        if force or tensor_stamp(self.param) != self.seen:
            with torch.no_grad():
                for transform in self.transforms:
                    transform.apply(self.param)
            self.mark_clean()

    def refresh(self, target: torch.Tensor) -> None:
        """:meth:`enforce` from inside a compiled graph, writing to ``target``: the parameter
        itself, or the copy of it the compiler threads through the graph."""
        if tensor_stamp(self.param) != self.seen:
            with torch.no_grad():
                for transform in self.transforms:
                    transform.apply(target)
            self.mark_clean()


@compiled.eager_at_top_level
class SubtreeEnforcer:
    """Forward-pre hook enforcing the guards of every guarded parameter at or below its module.

    ``owned`` lists where each of those parameters sits, ``(owner module, attribute, qualified
    name, guard)``: if one was replaced by a new object, the forward stops with
    :class:`ParameterReplacedError` instead of running on weights no transform reaches (also
    when a parent reads the child's weight without calling the child). It holds no weak
    references, so a model under surgery pickles and deep-copies.
    """

    def __init__(
        self, guards: list[TensorGuard], owned: list[tuple[nn.Module, str, str, TensorGuard]] | None = None
    ) -> None:
        self.guards = guards
        self.owned = owned or []

    def __call__(self, module: nn.Module, args: tuple) -> None:
        if is_compiling():  # dynamo cannot trace the check: one opaque op instead (~70 ns when eager)
            compiled.enforce(self.guards)
            return
        if self.owned:
            check_owned(self.owned)
        for guard in self.guards:
            guard.enforce()


def check_owned(owned: list[tuple[nn.Module, str, str, TensorGuard]]) -> None:
    """Raise :class:`ParameterReplacedError` if a guarded parameter is no longer where it was."""
    for owner, attribute, name, guard in owned:
        current = get_slot(owner, attribute)
        if current is not guard.param and getattr(current, "_surgery_source", None) is not guard.param:
            kinds = ", ".join(t.kind for t in guard.transforms)
            raise ParameterReplacedError(
                f"{name} was replaced by a new object after {kinds} was attached (load_state_dict(assign=True) or "
                "assignment), so the surgery no longer reaches it; call enforce() on the handles to carry it over "
                "to the new parameter, or restore() them before replacing"
            )


class StepEnforcer:
    """Global optimizer step post-hook: re-applies the transforms of every guarded parameter the
    optimizer just stepped, fused implementations included (they do not bump version counters),
    so the transforms hold right after ``step()``, before any forward."""

    def __init__(self, guards: list[TensorGuard]) -> None:
        self.guards = guards

    def __call__(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
        for guard in self.guards:
            if id(guard.param) in stepped:
                guard.enforce(force=True)


def stand_ins(module: nn.Module, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``values`` for ``torch.func.functional_call(module, values, ...)``, each tagged as standing
    in for the parameter of ``module`` with its name, so the replaced-parameter check lets a
    surgery-internal call through with the tensors swapped (AutoRound's block, learned rotations)."""
    params = dict(module.named_parameters(remove_duplicate=False))
    for name, value in values.items():
        source = params.get(name)
        if source is not None and value is not source:
            value._surgery_source = source
    return values


def adopt(guard: TensorGuard, param: nn.Parameter) -> None:
    """Move ``guard`` (every transform on it) to ``param``, which replaced its parameter, and
    apply the transforms to it now."""
    with _lock:
        if _guards.get(guard.param) is guard:
            del _guards[guard.param]
        guard.param = param
        _guards[param] = guard
    guard.enforce(force=True)


def attach(param: nn.Parameter, transform: Transform, name: str) -> TensorGuard:
    """Add ``transform`` to the guard of ``param`` and apply it now.

    Raises:
        AlreadyModifiedError: if a transform of the same kind is already attached.
    """
    with _lock:
        guard = _guards.get(param)
        if guard is None:
            guard = _guards[param] = TensorGuard(param)
            guard.mark_clean()
        if any(t.kind == transform.kind for t in guard.transforms):
            raise AlreadyModifiedError(
                f"{transform.kind}: {name} already has {transform.kind} attached; bake() or restore() that handle first"
            )
        guard.enforce()  # bring earlier transforms up to date before stacking a new one
        guard.transforms.append(transform)
    try:
        with torch.no_grad():
            transform.apply(param)
            if getattr(transform, "rewrites", False) and len(guard.transforms) > 1:
                guard.enforce(force=True)  # new values (SparseGPT, GPTQ) must still satisfy the earlier transforms
    except BaseException:  # nothing attached: no transform, and no guard left empty
        with _lock:
            guard.transforms.remove(transform)
            if not guard.transforms and _guards.get(param) is guard:
                del _guards[param]
        raise
    guard.mark_clean()
    return guard


def check_editable(named: dict[str, torch.Tensor], field: str) -> None:
    """Raise :class:`~surgery.core.errors.ConfigError` naming the first tensor that surgery cannot
    edit in place: one on the ``meta`` device (no values) or created under ``inference_mode``."""
    for name, tensor in named.items():
        if tensor.is_meta and getattr(tensor, "offloaded_to", None) is not None:
            raise ConfigError(
                field,
                name,
                f"is offloaded to {tensor.offloaded_to} (surgery.offloaded): give quantize, prune, smooth "
                "or sensitivity the handle itself to work block by block, or handle.materialise() to load it",
            )
        if tensor.is_meta:
            raise ConfigError(
                field,
                name,
                "is on the meta device and has no values; materialise the model first "
                "(model.to_empty(device='cpu') and load its weights)",
            )
        if tensor.is_inference():
            raise ConfigError(
                field,
                name,
                "was created under torch.inference_mode(), and PyTorch forbids editing "
                "it in place; build or load the model outside inference_mode",
            )


def check_last(param: nn.Parameter, transform: Transform, name: str) -> None:
    """Raise :class:`AlreadyModifiedError` if a later transform sits on top of ``transform``."""
    guard = _guards.get(param)
    if guard is not None and transform in guard.transforms and guard.transforms[-1] is not transform:
        later = guard.transforms[-1].kind
        raise AlreadyModifiedError(
            f"{transform.kind}: {name} also has {later} attached after it; "
            f"restore or bake the {later} handle first (undo in reverse order)"
        )


def detach(param: nn.Parameter, transform: Transform, name: str) -> None:
    """Remove ``transform`` from the guard of ``param`` (it must be the last one attached)."""
    with _lock:
        check_last(param, transform, name)
        guard = _guards.get(param)
        if guard is None or transform not in guard.transforms:
            return
        guard.transforms.pop()
        if not guard.transforms:
            del _guards[param]


def settle(param: nn.Parameter) -> None:
    """Re-apply the transforms of ``param`` now if it changed since they last ran (before a
    bake makes its current values final)."""
    guard = _guards.get(param)
    if guard is not None:
        guard.enforce()


def savepoint(params: Iterable[nn.Parameter]) -> Callable[[], None]:
    """The guards of ``params`` as they are now, as a callable that puts them back exactly
    (the rollback of a failed bake: transforms detached meanwhile are attached again)."""
    with _lock:
        saved = [(p, g, list(g.transforms), g.seen) for p in params if (g := _guards.get(p)) is not None]

    def put_back() -> None:
        with _lock:
            for param, guard, transforms, seen in saved:
                _guards[param] = guard
                guard.transforms[:] = transforms
                guard.seen = seen

    return put_back


def current_value(param: nn.Parameter) -> torch.Tensor:
    """``param`` as its attached transforms keep it, even if it changed since they last ran (an
    optimizer step after the last forward): then a corrected copy, else a detached view.
    ``param`` itself is never written to."""
    guard = _guards.get(param)
    if guard is None or tensor_stamp(param) == guard.seen:
        return param.detach()
    value = param.detach().clone()
    with torch.no_grad():
        for transform in guard.transforms:
            transform.apply(value)
    return value


def transforms_of(param: nn.Parameter) -> list[Transform]:
    """The transforms attached to ``param``, in order (empty if none)."""
    guard = _guards.get(param)
    return list(guard.transforms) if guard is not None else []


def guard_of(param: nn.Parameter) -> TensorGuard:
    """The guard of a parameter that has a transform attached."""
    return _guards[param]


def paths_to_owners(
    model: nn.Module, params: list[nn.Parameter]
) -> list[tuple[nn.Module, list[int], list[tuple[nn.Module, str, str, int]]]]:
    """Every module from the root down to each owner of one of ``params``, with the ids of
    those parameters at or below it (for a shared module or parameter: every path) and where
    each sits: ``(owner module, attribute, qualified name, id)``."""
    wanted = {id(p) for p in params}
    named = dict(model.named_modules(remove_duplicate=False))
    below: dict[int, tuple[nn.Module, dict[int, None], dict[tuple[int, str], tuple]]] = {}
    for name, module in named.items():
        owned = {
            attr: id(p)
            for attr, p in module.named_parameters(recurse=False, remove_duplicate=False)
            if p is not None and id(p) in wanted
        }
        if not owned:
            continue
        slots = {(id(module), attr): (module, attr, f"{name}.{attr}" if name else attr, i) for attr, i in owned.items()}
        parts = name.split(".") if name else []
        for depth in range(len(parts) + 1):
            ancestor = named[".".join(parts[:depth])]
            entry = below.setdefault(id(ancestor), (ancestor, {}, {}))
            entry[1].update(dict.fromkeys(owned.values()))
            entry[2].update(slots)
    return [(module, list(ids), list(slots.values())) for module, ids, slots in below.values()]
