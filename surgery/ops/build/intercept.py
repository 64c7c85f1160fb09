"""``surgery.ops.build.intercept``: build-time surgery through torch's global registration hooks.

While an ``intercept`` block is open, torch's global module, parameter and buffer
registration hooks are installed. They act only for the thread (and the asyncio task: the
context) that opened the block, and apply its rules to every submodule, parameter and buffer
attached while a model's own ``__init__`` runs — so the model's initialisation code, weight tying and
``zero_init_residual`` run on what the rules put in.

Registration hooks fire bottom-up, when a child is attached to its parent and before that
parent is attached to its own parent: qualified names do not exist yet. Rules therefore match
on class and local name; the log's qualified names are resolved when the block closes (or on
:meth:`InterceptLog.resolve`), from the recorded parent links.

The root module — the object your code constructs — is never attached to a parent, so module
rules never see it (swap it yourself after construction); its own parameters and buffers are
registered in its ``__init__`` and do pass through parameter and buffer rules.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
import weakref
from collections.abc import Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn
from torch.nn.modules import module as module_globals

from surgery.core.errors import ConfigTypeError, SurgeryError
from surgery.ops.build.rules import Rule


class InterceptError(SurgeryError, TypeError):
    """A build rule failed or produced something invalid; the message names rule and module."""


@dataclass(frozen=True)
class Event:
    """One change made during a build: ``kind`` is swap, wrap, parameter or buffer."""

    kind: str
    name: str
    old_type: str
    new_type: str
    rule: str
    root: str


class InterceptLog(Sequence):
    """The events of one ``intercept`` block, with qualified names (``layer1.0.relu``)."""

    def __init__(self) -> None:
        self._pending: list[tuple[str, Any, str, str, str, str]] = []
        self._parents: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._events: list[Event] = []

    def record(self, kind: str, parent: nn.Module, name: str, old: str, new: str, rule: str) -> None:
        self._pending.append((kind, weakref.ref(parent), name, old, new, rule))

    def link(self, parent: nn.Module, name: str, child: nn.Module) -> None:
        self._parents[child] = (weakref.ref(parent), name)

    def resolve(self) -> list[Event]:
        """Turn pending records into events with qualified names; returns all events."""
        for kind, parent_ref, name, old, new, rule in self._pending:
            prefix, root = self._qualify(parent_ref())
            self._events.append(Event(kind, f"{prefix}.{name}" if prefix else name, old, new, rule, root))
        self._pending.clear()
        return self._events

    def close(self) -> None:
        self.resolve()
        self._parents = weakref.WeakKeyDictionary()

    def _qualify(self, module: nn.Module | None) -> tuple[str, str]:
        if module is None:
            return "?", "?"
        parts: list[str] = []
        seen: set[int] = set()
        while module in self._parents and id(module) not in seen:
            seen.add(id(module))
            parent_ref, name = self._parents[module]
            parts.append(name)
            module = parent_ref()
            if module is None:
                return ".".join(["?", *reversed(parts)]), "?"
        return ".".join(reversed(parts)), type(module).__name__

    def __getitem__(self, index):  # type: ignore[override]
        return self.resolve()[index]

    def __len__(self) -> int:
        return len(self.resolve())

    def __repr__(self) -> str:
        return f"InterceptLog({self.resolve()!r})"


class _Session:
    """The rules and log of one open ``intercept`` block."""

    def __init__(self, rules: tuple[Rule, ...]) -> None:
        self.rules = rules
        self.by_kind = {kind: [r for r in rules if r.kind == kind] for kind in ("swap", "wrap", "parameter", "buffer")}
        self.module_rules = [r for r in rules if r.kind in ("swap", "wrap")]
        self.log = InterceptLog()
        # id(original) -> (a weak reference to it, result): an original the constructor drops is
        # freed at once (a model built with its weights set aside never holds them all)
        self.tensors: dict[int, tuple[weakref.ref, Tensor]] = {}
        self.results: dict[int, Tensor] = {}  # id(result) -> result: never transformed again
        self.fired: set[int] = set()  # ids of the rules whose action ran at least once
        self.closed = False
        self.produced: weakref.WeakSet = weakref.WeakSet()  # shared with the blocks it nests in
        self.token: Any = None

    def never_fired(self) -> list[Rule]:
        return [rule for rule in self.rules if id(rule) not in self.fired]


class _Registry:
    """Global hooks installed once for any number of open blocks (a counter, not a flag).

    Which blocks apply is a context variable, not a thread's: each thread starts with none,
    and so does an asyncio task created outside a block, even while another task of the same
    thread holds one open across an ``await``. A block closed from another thread or context
    (a generator finalised elsewhere) is marked closed, so it never applies again anywhere.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.count = 0
        self.handles: list = []
        self.sessions: ContextVar[tuple[_Session, ...]] = ContextVar("surgery_intercept_blocks", default=())
        self.busy: ContextVar[bool] = ContextVar("surgery_intercept_busy", default=False)

    def stack(self) -> list[_Session]:
        """The blocks open in this context, outermost first."""
        return [session for session in self.sessions.get() if not session.closed]

    def produced(self) -> weakref.WeakSet:
        """Modules made or wrapped by a rule in this context's open blocks: never matched again."""
        stack = self.stack()
        return stack[0].produced if stack else weakref.WeakSet()

    def enter(self, session: _Session) -> None:
        with self.lock:
            if self.count == 0:
                self.handles = [
                    module_globals.register_module_module_registration_hook(_on_module),
                    module_globals.register_module_parameter_registration_hook(_on_parameter),
                    module_globals.register_module_buffer_registration_hook(_on_buffer),
                ]
            self.count += 1
        stack = self.stack()
        session.produced = stack[0].produced if stack else weakref.WeakSet()
        session.token = self.sessions.set((*stack, session))

    def exit(self, session: _Session) -> None:
        session.closed = True
        with contextlib.suppress(ValueError, RuntimeError):  # closed from another context: the closed mark suffices
            self.sessions.reset(session.token)
        with self.lock:
            self.count -= 1
            if self.count == 0:
                for handle in self.handles:
                    handle.remove()
                self.handles = []


_registry = _Registry()


class RuleNeverFiredWarning(UserWarning):
    """A build rule of an ``intercept`` block matched nothing built inside it."""


class RuleNeverFiredError(InterceptError):
    """With ``strict=True``: a build rule matched nothing built inside the block."""

    def __init__(self, message: str, rule: Rule) -> None:
        super().__init__(message)
        self.rule = rule


@contextlib.contextmanager
def intercept(*rules: Rule, strict: bool = False) -> Iterator[InterceptLog]:
    """Apply build-time ``rules`` to every model constructed in the block, in this thread.

    Yields the :class:`InterceptLog` of every change. The global hooks are removed when the
    block exits, exceptions included; blocks nest (inner rules apply first, outer rules still
    hold after the inner block closes). A rule that never fired (e.g. ``swap(nn.GELU, ...)`` on
    a model whose GELU is its own class) gives a :class:`RuleNeverFiredWarning` when the block
    ends, or a :class:`RuleNeverFiredError` with ``strict=True``.

    Example:
        >>> from surgery import rules
        >>> with surgery.intercept(rules.swap(nn.ReLU, lambda old: nn.SiLU())) as log:
        ...     model = torchvision.models.resnet18()
        >>> log[0].name, log[0].new_type
        ('relu', 'SiLU')
    """
    for rule in rules:
        if not isinstance(rule, Rule):
            raise ConfigTypeError(
                "intercept.rules",
                rule,
                "is not a rule; build rules with surgery.rules.swap/wrap/on_parameter/on_buffer",
            )
    session = _Session(rules)
    _registry.enter(session)
    try:
        yield session.log
    finally:
        _registry.exit(session)
        session.tensors.clear()
        session.results.clear()
        session.log.close()
    _report_never_fired(session.never_fired(), strict)


def _report_never_fired(rules: list[Rule], strict: bool) -> None:
    for rule in rules:
        message = (
            f"build rule {rule.label} never fired: nothing built in the intercept block matched it "
            "(check the class: models often define their own, e.g. transformers' GELUActivation)"
        )
        if strict:
            raise RuleNeverFiredError(message, rule)
        warnings.warn(message, RuleNeverFiredWarning, stacklevel=4)


def _active() -> list[_Session]:
    return [] if _registry.busy.get() else _registry.stack()


def _call(rule: Rule, parent: nn.Module, name: str, value: Any, action: bool) -> Any:
    """Run a rule's match or action; rules do not apply to modules a rule itself builds."""
    if not action and isinstance(rule.match, (type, tuple, str)):
        return rule.matches(parent, name, value)  # cannot build modules or raise: no guard needed
    token = _registry.busy.set(True)
    try:
        return rule.action(value) if action else rule.matches(parent, name, value)
    except SurgeryError:
        raise
    except Exception as err:
        step = "action" if action else "match"
        raise InterceptError(
            f"build rule {rule.label} failed in its {step} for {type(parent).__name__}.{name}: "
            f"{type(err).__name__}: {err}"
        ) from err
    finally:
        _registry.busy.reset(token)


def _on_module(parent: nn.Module, name: str, child: nn.Module | None) -> nn.Module | None:
    sessions = _active()
    if not sessions or child is None:
        return None
    result = child
    for session in reversed(sessions):  # innermost block first
        if result not in _registry.produced():
            result = _apply_module_rules(session, parent, name, result)
    for session in sessions:
        session.log.link(parent, name, result)
    return None if result is child else result


def _apply_module_rules(session: _Session, parent: nn.Module, name: str, child: nn.Module) -> nn.Module:
    for rule in session.module_rules:
        if not _call(rule, parent, name, child, action=False):
            continue
        _registry.produced().add(child)
        new = _call(rule, parent, name, child, action=True)
        session.fired.add(id(rule))
        if not isinstance(new, nn.Module):
            raise InterceptError(
                f"build rule {rule.label} returned {type(new).__name__} for "
                f"{type(parent).__name__}.{name}; it must return an nn.Module"
            )
        _registry.produced().add(new)
        session.log.record(rule.kind, parent, name, type(child).__name__, type(new).__name__, rule.label)
        return new
    return child


def _on_parameter(module: nn.Module, name: str, param: Tensor | None) -> Tensor | None:
    return _on_tensor("parameter", module, name, param)


def _on_buffer(module: nn.Module, name: str, buffer: Tensor | None) -> Tensor | None:
    return _on_tensor("buffer", module, name, buffer)


def _on_tensor(kind: str, module: nn.Module, name: str, tensor: Tensor | None) -> Tensor | None:
    sessions = _active()
    if not sessions or tensor is None:
        return None
    result = tensor
    for session in reversed(sessions):
        if session.by_kind[kind]:
            result = _apply_tensor_rules(session, kind, module, name, result)
    return None if result is tensor else result


def _apply_tensor_rules(session: _Session, kind: str, module: nn.Module, name: str, tensor: Tensor) -> Tensor:
    if id(tensor) in session.results:
        return tensor  # already a rule's result (e.g. a tied weight registered again)
    seen = session.tensors.get(id(tensor))
    if seen is not None and seen[0]() is tensor:
        return seen[1]  # the same tensor registered again: tied
    result = tensor
    for rule in session.by_kind[kind]:
        if not _call(rule, module, name, result, action=False):
            continue
        before = _describe(result)
        new = _call(rule, module, name, result, action=True)
        session.fired.add(id(rule))
        if new is None:
            continue
        result = _checked_tensor(rule, kind, module, name, result, new)
        session.log.record(kind, module, name, before, _describe(result), rule.label)
    session.tensors[id(tensor)] = (weakref.ref(tensor), result)
    session.results[id(result)] = result
    return result


def _checked_tensor(rule: Rule, kind: str, module: nn.Module, name: str, old: Tensor, new: Any) -> Tensor:
    where = f"{type(module).__name__}.{name}"
    if not isinstance(new, Tensor):
        raise InterceptError(
            f"build rule {rule.label} returned {type(new).__name__} for {where}; it must return a tensor or None"
        )
    if kind == "parameter" and not isinstance(new, nn.Parameter):
        requires_grad = old.requires_grad
        if requires_grad and not (new.is_floating_point() or new.is_complex()):
            raise InterceptError(
                f"build rule {rule.label} made {where} {new.dtype}, but it requires grad; "
                "only floating parameters can require grad (freeze it first)"
            )
        new = nn.Parameter(new.detach(), requires_grad=requires_grad)
    return new


def _describe(tensor: Tensor) -> str:
    dtype = str(tensor.dtype).removeprefix("torch.")
    if isinstance(tensor, nn.Parameter):
        return f"{dtype}{'' if tensor.requires_grad else ' frozen'}{' meta' if tensor.is_meta else ''}"
    return f"{dtype}{' meta' if tensor.is_meta else ''}"
