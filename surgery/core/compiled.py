"""``torch.compile`` support: the graph op that keeps guarded parameters consistent, hooks dynamo notices.

The file holds :func:`enforce` (called by :class:`~surgery.core.guards.SubtreeEnforcer` while
dynamo traces it), the operator ``surgery::enforce`` it puts in the graph, the registry that
lets that operator find its :class:`~surgery.core.guards.TensorGuard` objects at run time, and
:func:`prepare` (what a verb operates on: the model a ``torch.compile`` wrapper compiles,
with dynamo told to notice hooks).

Why an operator: eager hooks re-apply a parameter's transforms only when its version counter
or storage changed, a check dynamo cannot trace (comparing data pointers breaks the graph).
Re-applying unconditionally inside the graph would be traceable but costs a full read and
write of every guarded weight per call (1.9x on resnet18 at batch 1, ``bench_compile.py``).
The operator is opaque to the compiler: the graph calls it before the layers run, and it
makes the eager check at run time, so a compiled forward after an optimizer step, ``load_state_dict`` or any
in-place edit sees masked / quantized weights, and an unchanged weight costs a comparison.

The operator declares that it mutates the parameters (so no reader can be scheduled before it)
and marks that mutation hidden from autograd under functionalization, as PyTorch does for
in-place Triton kernels: otherwise AOTAutograd bumps the version counter of every mutated input
on every call and the check would see a change each time. Without that private hook (another
PyTorch version) the result is still correct, only re-applied on every call.
"""

from __future__ import annotations

import itertools
import logging
import sys
import threading
import types
import weakref
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from surgery.core import _compat
from surgery.core.errors import ConfigError

_by_token: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
_tokens = itertools.count()
_unguarded: weakref.WeakSet[types.CodeType] = weakref.WeakSet()  # compiled before dynamo guarded hooks
_log = logging.getLogger(__name__)
_unguarded_scanned: list[bool] = []  # set once the flag was first changed (the WARNING is logged once)

_library: Any = None  # the ``surgery`` operator library: defined when the first guard is created
_define_lock = threading.Lock()


class Refreshable(Protocol):
    """What :func:`enforce` needs of a guard (:class:`~surgery.core.guards.TensorGuard`)."""

    param: nn.Parameter
    token: Tensor

    def refresh(self, target: Tensor) -> None: ...


def register(guard: Refreshable) -> Tensor:
    """A process-unique token by which the graph operator finds ``guard`` (held weakly).

    A tensor, not an int: a graph takes it as an input instead of baking it in as a constant,
    so copies of a model under the same surgery share their compiled code."""
    _define_operator()  # outside any trace: dynamo cannot trace defining a library
    token = next(_tokens)
    _by_token[token] = guard
    return torch.tensor(token)


def enforce(guards: list[Refreshable]) -> None:
    """Emit one ``surgery::enforce`` call for ``guards`` into the graph being traced."""
    torch.ops.surgery.enforce([g.param for g in guards], [g.token for g in guards])


def _enforce_kernel(params: list[Tensor], tokens: list[Tensor]) -> None:
    for target, token in zip(params, tokens):
        guard = _by_token.get(int(token))
        if guard is not None:  # None: the graph outlived its surgery (nothing left to enforce)
            guard.refresh(target)


def _enforce_fake(params: list[Tensor], tokens: list[Tensor]) -> None:
    return None


def _hide_from_autograd(mode: Any, func: Any, _types: Any, args: tuple, kwargs: dict) -> Any:
    """Functionalize ``surgery::enforce`` as usual, then mark the parameter writes hidden from
    autograd: the operator writes only after someone else changed the weight (which already
    bumped its version), so there is nothing new for autograd to detect."""
    return _compat.functionalize_hiding_mutation(
        mode, func, args, kwargs, mutated=args[0] if args else kwargs["params"]
    )


def _define_operator() -> None:
    """Define ``surgery::enforce`` once, when the first guard is created (``import surgery``
    registers nothing)."""
    global _library
    if _library is not None:
        return
    with _define_lock:
        if _library is None:
            _define_operator_now()


def _define_operator_now() -> None:
    global _library
    library = torch.library.Library("surgery", "DEF")
    library.define("enforce(Tensor(a!)[] params, Tensor[] tokens) -> ()")
    library.impl("enforce", _enforce_kernel, "CompositeExplicitAutograd")
    torch.library.register_fake("surgery::enforce", _enforce_fake, lib=library)
    _compat.register_functional_rule("surgery::enforce", _hide_from_autograd, library)
    _library = library


def eager_at_top_level(cls: type) -> type:
    """Class decorator for hook classes: run ``cls.__call__`` as plain Python when dynamo meets
    it as a frame of its own, inline it as usual when it is called from a frame being traced.

    ``torch.compile(model)`` calls the hooks of ``model`` itself from ``Module._call_impl``,
    outside the graph of ``forward``; dynamo would compile each such hook as a separate graph
    (``torch._dynamo.explain`` counts each as a graph break). Run eagerly, a root hook costs
    what it costs without compile, and the forward stays one graph. Hooks of submodules are
    traced into that graph. Uses a private dynamo setting; without it (another PyTorch
    version) root hooks are compiled separately, which is slower to compile but as correct.
    """
    _compat.run_eagerly_when_called_directly(cls.__call__.__code__)
    return cls


def prepare(model: nn.Module) -> nn.Module:
    """The module a surgery verb operates on, made ready for hooks under ``torch.compile``.

    A ``torch.compile`` wrapper (``OptimizedModule``) is unwrapped: surgery applies to the
    model it compiles, with that model's own names, and the wrapper follows on its next call.
    That works because dynamo is told to guard the hook dictionaries of modules
    (``torch._dynamo.config.skip_nnmodule_hook_guards = False``). Its default skips guards on
    hook dictionaries that were empty when it traced, so code compiled for a plain instance of
    the same class, or for this model before the surgery, would be reused and silently ignore
    the hooks. Code compiled under that default for the classes of ``model`` is dropped (once;
    those models recompile on their next call). Costs about a second the first time if nothing
    had loaded dynamo yet; the guards themselves cost no measurable time.

    Example:
        >>> prepare(torch.compile(model)) is model
        True
    """
    model = _compat.unwrap_compiled(model)
    if _compat.dynamo_loaded():  # nothing can have been compiled otherwise: dynamo stays untouched
        _guard_hook_dicts(model)
    return model


def _guard_hook_dicts(model: nn.Module) -> None:
    if _compat.hook_guards_skipped():  # building a torchvision model loads dynamo: silent unless code was compiled
        compiled_before = _compat.guard_hook_dicts()
        if compiled_before:
            _log.info(
                "surgery: setting torch._dynamo.config.skip_nnmodule_hook_guards = False for this process so "
                "that compiled code notices surgery's hooks (once; see docs/compile.md)"
            )
        _unguarded.update(compiled_before)
        _unguarded_scanned.append(True)
    if not _unguarded:
        return
    files = {getattr(sys.modules.get(type(m).__module__), "__file__", None) for m in model.modules()}
    files |= _compat.wrapper_files()  # Module._call_impl, compiled wrappers
    stale = [code for code in _unguarded if code.co_filename in files]
    if stale:  # compiled code exists for this model: a user with torch.compile should know it recompiles
        _log.warning(
            "surgery: dropped %d piece(s) of code torch.compile made for %s's classes without guards on "
            "their hooks; they recompile on the next call (see docs/compile.md)",
            len(stale),
            type(model).__name__,
        )
    for code in stale:
        _compat.reset_code(code)
        _unguarded.discard(code)


def in_memory(verb: str, model: nn.Module, work: object) -> nn.Module:
    """The prologue every verb runs on a model in memory (an offloaded one was dispatched before):
    ``work=`` refused (it is for offloaded models), a ``torch.compile`` wrapper unwrapped and its
    hooks guarded (:func:`prepare`)."""
    if work is not None:
        raise ConfigError(f"{verb}.work", str(work), "is for an offloaded model (surgery.offloaded); leave it None")
    return prepare(model)
