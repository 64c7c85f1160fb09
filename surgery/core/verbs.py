"""The one door every verb goes through: a verb is a frozen spec plus a handler.

:func:`verb` declares one. The door owns what every verb shares, in this order, before the
handler runs: the spec built from the caller's keywords (or taken as given; a keyword beside a
spec is refused naming it), old spellings mapped with a warning, the calibration batches
checked present, an offloaded model dispatched to the verb's offloaded handler, a
``torch.compile`` wrapper unwrapped, and a mixture-of-experts model's fused experts made
per-expert layers for the handler's time by the opening the verb names (folded back if it
fails: its rollback); afterwards, the memory its temporaries freed goes back to the system
(:mod:`surgery.core.allocator`).

Example:
    >>> @dataclass(frozen=True)
    ... class ScaleSpec:
    ...     factor: float = 1.0
    >>> @verb("scale", ScaleSpec, first="factor", calibration="none")
    ... def scale(model, spec, call):
    ...     '''Multiply every weight by ``factor`` (a handle restores them).'''
    ...     ...
    >>> scale(model, 0.5)            # the spec's first field given positionally
    >>> scale(model, ScaleSpec(0.5))  # or the spec itself
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from surgery.core import compiled
from surgery.core.allocator import give_back_freed_memory
from surgery.core.errors import ConfigError, ConfigTypeError
from surgery.core.registry import Registry

CALIBRATION = ("required", "optional", "none")  # whether a verb's calibration= must, may or cannot be given
CALL_KEYWORDS = ("calibration", "work", "progress")  # what every verb may take beside its spec
REMOVED_IN = "0.4"
_BUILT: Any = type("Built", (), {"__repr__": lambda self: "<the spec's default>"})()


class OffloadedSource:
    """What an offloaded model's handle (:class:`surgery.Offloaded`) is to the door: a model not
    in memory, dispatched to a verb's offloaded handler."""


ExpertsOpening = Callable[..., Any]  # (model, verb, apply, per_expert_statistics=) -> apply()'s handle


@dataclass(frozen=True)
class VerbCall:
    """What a verb's handler is given beside the model and its spec: the calibration batches,
    the progress flag, an offloaded model's ``work`` folder, and the verb's own keywords that are
    no settings (``prune``'s ``loss``, ``quantize``'s ``qparams``), defaults filled in."""

    calibration: Any = None
    progress: bool = True
    work: Any = None
    extras: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Verb:
    """A declared verb (see :func:`verb`); calling it runs the door, then its handler."""

    name: str
    spec: type
    handler: Callable[[Any, Any, VerbCall], Any]
    offloaded: Callable[[Any, Any, VerbCall], Any] | None = None
    positional: tuple[str, ...] = ()
    calibration: str = "optional"
    experts: ExpertsOpening | None = None
    expert_statistics: bool = True
    extras: Mapping[str, Any] = field(default_factory=dict)
    renamed: Mapping[str, str] = field(default_factory=dict)
    old_positional: tuple[str, ...] = ()
    unwrap_compiled: bool = True

    def __call__(self, model: Any, *args: Any, **keywords: Any) -> Any:
        spec, call = self.settle(args, keywords)
        try:
            return self._run(model, spec, call)
        finally:  # the handler's temporaries are freed: their pages go back to the system
            give_back_freed_memory()

    def _run(self, model: Any, spec: Any, call: VerbCall) -> Any:
        """Dispatch an offloaded model, unwrap a compiled one, open the experts, run the handler."""
        if isinstance(model, OffloadedSource):
            if self.offloaded is None:
                raise ConfigError(
                    self.name,
                    "an offloaded model",
                    "works on a model in memory: load it so, or handle.materialise() the offloaded one first",
                )
            return self.offloaded(model, spec, call)
        if self.unwrap_compiled:
            model = compiled.in_memory(self.name, model, call.work)
        if self.experts is None or not isinstance(model, nn.Module):
            return self.handler(model, spec, call)
        # unrouted="rtn" (a spec that has it): an expert no token reached is solved without statistics, not refused
        statistics = self.expert_statistics and getattr(spec, "unrouted", "refuse") != "rtn"
        return self.experts(model, self.name, lambda: self.handler(model, spec, call), per_expert_statistics=statistics)

    def settle(self, args: tuple, keywords: dict[str, Any]) -> tuple[Any, VerbCall]:
        """The spec and the call from what the caller gave, checked before anything runs."""
        keywords = self._keywords(keywords)
        if args and args[0] is None and not self.positional:  # quantize(model, None): no spec, its defaults
            args = args[1:]
        if args and isinstance(args[0], self.spec):
            if len(args) > 1:
                raise ConfigTypeError(self.name, args[1], f"takes nothing positionally after its {self.spec.__name__}")
            named = {"spec": args[0]}
        else:
            named = self._positional(args)
        for name, value in named.items():
            if name in keywords:
                raise ConfigError(f"{self.name}.{name}", value, "is given twice: positionally and as a keyword")
            keywords[name] = value
        spec = keywords.pop("spec", None)
        fields = [f.name for f in dataclasses.fields(self.spec)]
        settings = {name: keywords.pop(name) for name in fields if name in keywords}
        if spec is None:
            spec = self.spec(**settings)
        elif not isinstance(spec, self.spec):
            raise ConfigTypeError(
                f"{self.name}.spec", spec, f"must be a {self.spec.__name__} (or pass its settings as keywords)"
            )
        elif settings:
            beside = next(iter(settings))
            raise ConfigError(
                f"{self.name}.{beside}",
                settings[beside],
                f"is given beside {_a(self.spec.__name__)}: set it in the spec "
                f"(dataclasses.replace(spec, {beside}=...)), not also as a keyword",
            )
        calibration = keywords.pop("calibration", None)
        if self.calibration == "required" and calibration is None:
            raise ConfigError(
                f"{self.name}.calibration", None, f"{self.name} needs calibration batches: pass calibration="
            )
        extras = {name: keywords.pop(name, default) for name, default in self.extras.items()}
        return spec, VerbCall(calibration, keywords.pop("progress", True), keywords.pop("work", None), extras)

    def allowed(self) -> list[str]:
        """Every keyword the verb takes: its spec's fields, ``spec``, then the call's own."""
        own = [k for k in CALL_KEYWORDS if (k != "calibration" or self.calibration != "none")]
        own = [k for k in own if k != "work" or self.offloaded is not None]
        return [*(f.name for f in dataclasses.fields(self.spec)), "spec", *own, *self.extras]

    def _keywords(self, keywords: dict[str, Any]) -> dict[str, Any]:
        """``keywords`` with old names mapped to new ones (warned), an unknown one refused."""
        keywords = dict(keywords)
        for old, new in self.renamed.items():
            if old in keywords:
                if new in keywords:
                    raise ConfigError(f"{self.name}.{old}", keywords[old], f"is {new}'s old name: give {new} only")
                _warn(f"{self.name}({old}=...) is now {self.name}({new}=...); the old name goes away in {REMOVED_IN}")
                keywords[new] = keywords.pop(old)
        allowed = self.allowed()
        unknown = next((name for name in keywords if name not in allowed), None)
        if unknown is not None:
            raise ConfigTypeError(self.name, unknown, f"unknown keyword; allowed: {', '.join(allowed)}")
        return keywords

    def _positional(self, args: tuple) -> dict[str, Any]:
        """Positional arguments by the names they set: the verb's own, or (warned) its old order."""
        if len(args) <= len(self.positional):
            return dict(zip(self.positional, args))
        if len(args) <= len(self.old_positional):
            named = dict(zip(self.old_positional, args))
            moved = [name for name in named if name not in self.positional]
            _warn(
                f"{self.name}: {', '.join(moved)} given positionally is now keyword-only "
                f"({', '.join(f'{name}=...' for name in moved)}); positional use goes away in {REMOVED_IN}"
            )
            return named
        takes = f"its {self.spec.__name__}" + (f" or {', '.join(self.positional)}" if self.positional else "")
        raise ConfigTypeError(self.name, args[-1], f"takes {takes} positionally after the model; the rest as keywords")

    def signature(self, returns: Any) -> inspect.Signature:
        """The public function's signature: the model, the positional settings, then keywords."""
        kinds = inspect.Parameter
        defaults = {f.name: _default(f) for f in dataclasses.fields(self.spec)}
        params = [kinds("model", kinds.POSITIONAL_ONLY)]
        params += [kinds(name, kinds.POSITIONAL_OR_KEYWORD, default=defaults[name]) for name in self.positional]
        rest = [name for name in self.allowed() if name not in self.positional]
        given = {"spec": None, "calibration": None, "work": None, "progress": True, **self.extras}
        for name in rest:
            params.append(kinds(name, kinds.KEYWORD_ONLY, default=defaults.get(name, given.get(name))))
        return inspect.Signature(params, return_annotation=returns)


VERBS: Registry[Verb] = Registry("verb")


def verb(
    name: str,
    spec: type,
    *,
    positional: tuple[str, ...] | str = (),
    calibration: str = "optional",
    offloaded: Callable[[Any, Any, VerbCall], Any] | bool | None = None,
    experts: ExpertsOpening | None = None,
    expert_statistics: bool = True,
    extras: Mapping[str, Any] | None = None,
    renamed: Mapping[str, str] | None = None,
    old_positional: tuple[str, ...] = (),
    unwrap_compiled: bool = True,
) -> Callable[[Callable[[Any, Any, VerbCall], Any]], Callable[..., Any]]:
    """Declare the verb ``name``: its settings are the frozen dataclass ``spec``; the decorated
    ``handler(model, spec, call)`` does its work on a model in memory; the public function
    returned takes ``(model, *positional, spec=, calibration=, progress=, **settings)``.

    Args:
        positional: the spec fields a caller may give positionally after the model, in order
            (the spec itself may always stand first).
        calibration: ``"required"``, ``"optional"`` or ``"none"`` (no ``calibration=`` keyword).
        offloaded: the handler of an offloaded model (:func:`surgery.offloaded`; ``True``: the
            handler itself takes it); ``None``: an offloaded model is refused in one line.
        experts: the opening that makes a mixture-of-experts model's fused experts per-expert
            layers for the handler's time (:func:`surgery.ops.experts.linearizing.with_linear_experts`);
            ``None``: the handler sees the model as it is.
        expert_statistics: with ``experts``, each expert must have seen calibration tokens (its
            statistics would be empty otherwise); ``False`` for verbs that share statistics.
        extras: the verb's keywords that are no settings, with their defaults (``{"loss": None}``).
        renamed: old keyword -> new one, accepted with a ``DeprecationWarning`` until 0.4.
        old_positional: the positional order before 0.3, accepted with a warning until 0.4.
        unwrap_compiled: ``False`` for a verb whose first argument is no model to unwrap (a handle),
            or one that works on a compiled model as it is (training).
    """
    if calibration not in CALIBRATION:
        raise ConfigError(f"verb {name!r} calibration", calibration, f"must be one of {', '.join(CALIBRATION)}")
    if not (dataclasses.is_dataclass(spec) and spec.__dataclass_params__.frozen):  # type: ignore[attr-defined]
        raise ConfigTypeError(f"verb {name!r} spec", spec, "must be a frozen dataclass")

    def declare(handler: Callable[[Any, Any, VerbCall], Any]) -> Callable[..., Any]:
        entry = Verb(
            name,
            spec,
            handler,
            handler if offloaded is True else offloaded or None,
            (positional,) if isinstance(positional, str) else tuple(positional),
            calibration,
            experts,
            expert_statistics,
            dict(extras or {}),
            dict(renamed or {}),
            old_positional,
            unwrap_compiled,
        )
        VERBS.register(name, entry, replace=True)

        @functools.wraps(handler)
        def public(model: Any, *args: Any, **keywords: Any) -> Any:
            return entry(model, *args, **keywords)

        public.__signature__ = entry.signature(inspect.signature(handler).return_annotation)  # type: ignore[attr-defined]
        public.verb = entry  # type: ignore[attr-defined]
        return public

    return declare


def _warn(message: str) -> None:
    """A ``DeprecationWarning`` pointing at the caller of the verb."""
    warnings.warn(message, DeprecationWarning, stacklevel=6)


def _default(spec_field: dataclasses.Field) -> Any:
    """A spec field's default as a signature shows it (none: required)."""
    if spec_field.default is not dataclasses.MISSING:
        return spec_field.default
    if spec_field.default_factory is not dataclasses.MISSING:
        return _BUILT  # built when the spec is (a factory may need what is registered later)
    return inspect.Parameter.empty


def _a(name: str) -> str:
    """``name`` with its indefinite article (an AwqSpec, a PruneSpec)."""
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"
