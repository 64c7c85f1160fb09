"""Resolve a selection (names, globs, ``re:`` regexes, types, predicates) to modules."""

from __future__ import annotations

import difflib
import fnmatch
import importlib
import re
from collections.abc import Callable, Iterable
from typing import Union

from torch import nn

from surgery.errors import ConfigTypeError, SelectionError

Predicate = Callable[[nn.Module, str], bool]
Pattern = Union[str, type, tuple, Predicate]
Selection = Union[Pattern, Iterable[Pattern], None]

REGEX_PREFIX = "re:"
TYPE_PREFIX = "type:"


def select(
    model: nn.Module,
    include: Selection = None,
    *,
    exclude: Selection = None,
    field: str = "select",
    exclude_field: str = "exclude",
) -> dict[str, nn.Module]:
    """Return the modules of ``model`` chosen by ``include`` minus ``exclude``, in model order.

    A pattern is an exact qualified name or a glob (``layer1.*.conv2``), a regular expression
    with an explicit ``re:`` prefix (matched against the whole name), a module class or tuple
    of classes (matched with ``isinstance``), a ``type:`` string naming a class (``type:Conv2d``
    for ``torch.nn`` classes, or a dotted import path), or a predicate ``(module, name) -> bool``.
    ``include=None`` selects every module. Exclusion beats inclusion. Every pattern must match
    something: a pattern that matches nothing raises :class:`SelectionError` naming the
    pattern and the closest module names. ``field``/``exclude_field`` name the arguments in
    error messages (the CLI passes ``prune.select``/``prune.exclude``).

    Example:
        >>> model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
        >>> list(select(model, nn.Linear, exclude="2"))
        ['0']
    """
    named = dict(model.named_modules(remove_duplicate=True))
    includes = _as_patterns(include, field)
    excludes = _as_patterns(exclude, exclude_field)
    chosen = set(named) if not includes else _matching(named, includes, field)
    chosen -= _matching(named, excludes, exclude_field)
    result = {name: module for name, module in named.items() if name in chosen}
    if not result:
        raise SelectionError(field, _describe(include), "the selection is empty after exclusions")
    return result


def _as_patterns(selection: Selection, field: str) -> list[Pattern]:
    if selection is None:
        return []
    if isinstance(selection, (str, type)) or callable(selection) and not isinstance(selection, type):
        patterns = [selection]
    elif isinstance(selection, tuple) and all(isinstance(t, type) for t in selection):
        patterns = [selection]
    elif isinstance(selection, Iterable):
        patterns = list(selection)
    else:
        raise ConfigTypeError(field, selection, "expected a name, glob, 're:' regex, type, predicate or a list of them")
    return [_compile(p, field) for p in patterns]


def _compile(pattern: Pattern, field: str) -> Pattern:
    if isinstance(pattern, str) and pattern.startswith(TYPE_PREFIX):
        return _import_type(pattern[len(TYPE_PREFIX):], field)
    if isinstance(pattern, str) and pattern.startswith(REGEX_PREFIX):
        try:
            re.compile(pattern[len(REGEX_PREFIX):])
        except re.error as err:
            raise SelectionError(field, pattern, f"not a valid regular expression: {err}") from None
        return pattern
    if isinstance(pattern, (str, type)) or callable(pattern):
        return pattern
    if isinstance(pattern, tuple) and all(isinstance(t, type) for t in pattern):
        return pattern
    raise ConfigTypeError(field, pattern, "expected a name, glob, 're:' regex, type or predicate")


def _import_type(spec: str, field: str) -> type:
    module_name, _, attr = spec.rpartition(".")
    try:
        found = getattr(importlib.import_module(module_name or "torch.nn"), attr)
    except (ImportError, AttributeError):
        found = None
    if not isinstance(found, type):
        raise SelectionError(field, f"{TYPE_PREFIX}{spec}", "names no class", "use e.g. 'type:Conv2d' or 'type:pkg.module.Class'")
    return found


def _matching(named: dict[str, nn.Module], patterns: list[Pattern], field: str) -> set[str]:
    chosen: set[str] = set()
    for pattern in patterns:
        hits = {name for name, module in named.items() if _matches(pattern, name, module)}
        if not hits:
            raise SelectionError(field, _describe(pattern), "matches no module", _closest(pattern, named))
        chosen |= hits
    return chosen


def _matches(pattern: Pattern, name: str, module: nn.Module) -> bool:
    if isinstance(pattern, str):
        if pattern.startswith(REGEX_PREFIX):
            return re.fullmatch(pattern[len(REGEX_PREFIX):], name) is not None
        return name == pattern or fnmatch.fnmatchcase(name, pattern)
    if isinstance(pattern, (type, tuple)):
        return isinstance(module, pattern)
    return bool(pattern(module, name))


def _closest(pattern: Pattern, named: dict[str, nn.Module]) -> str:
    if isinstance(pattern, str):
        text = pattern[len(REGEX_PREFIX):] if pattern.startswith(REGEX_PREFIX) else pattern
        close = difflib.get_close_matches(text, [n for n in named if n], n=3, cutoff=0.4)
    else:
        close = sorted({type(m).__name__ for m in named.values()})[:6]
        close = [f"types present: {', '.join(close)}"] if close else []
    return f"closest: {', '.join(close)}" if close else "the model has no similar module names"


def _describe(pattern: Selection) -> object:
    if isinstance(pattern, type):
        return pattern.__name__
    if isinstance(pattern, tuple) and all(isinstance(t, type) for t in pattern):
        return tuple(t.__name__ for t in pattern)
    if callable(pattern) and not isinstance(pattern, str):
        return getattr(pattern, "__name__", repr(pattern))
    return pattern
