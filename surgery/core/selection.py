"""Resolve a selection (names, globs, ``re:`` regexes, types, predicates) to modules."""

from __future__ import annotations

import difflib
import functools
import re

try:  # the parser behind `re`, to refuse patterns that backtrack exponentially
    from re import _constants as sre_constants  # Python 3.11+
    from re import _parser as sre_parse
except ImportError:  # pragma: no cover - Python 3.10
    import sre_constants  # type: ignore[no-redef]
    import sre_parse
from collections.abc import Callable, Iterable

from torch import nn

from surgery.core.errors import ConfigError, ConfigTypeError, SelectionError
from surgery.core.importing import import_object

Predicate = Callable[[nn.Module, str], bool]
Pattern = str | type | tuple | Predicate
Selection = Pattern | Iterable[Pattern] | None

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

    A pattern is an exact qualified name or a glob on dotted names (``*`` is one name segment,
    ``**`` any number: ``layer1.*.conv2``, ``layer1.**``, ``**.conv1``), a regular expression
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
    includes = as_patterns(include, field)
    excludes = as_patterns(exclude, exclude_field)
    chosen = set(named) if not includes else _matching(named, includes, field)
    chosen -= _matching(named, excludes, exclude_field)
    result = {name: module for name, module in named.items() if name in chosen}
    if not result:
        raise SelectionError(field, describe(include), "the selection is empty after exclusions")
    return result


def as_patterns(selection: Selection, field: str) -> list[Pattern]:
    if selection is None:
        return []
    if (
        isinstance(selection, (str, type))
        or callable(selection)
        and not isinstance(selection, type)
        or isinstance(selection, tuple)
        and all(isinstance(t, type) for t in selection)
    ):
        patterns = [selection]
    elif isinstance(selection, Iterable):
        patterns = list(selection)
    else:
        raise ConfigTypeError(field, selection, "expected a name, glob, 're:' regex, type, predicate or a list of them")
    return [_compile(p, field) for p in patterns]


def _compile(pattern: Pattern, field: str) -> Pattern:
    if isinstance(pattern, nn.Module):
        raise ConfigTypeError(
            field,
            type(pattern).__name__,
            "a module object is not a pattern; pass its qualified "
            "name (e.g. '0' or 'layer1.0'), its class, or a predicate (module, name) -> bool",
        )
    if isinstance(pattern, str) and pattern.startswith(TYPE_PREFIX):
        return _import_type(pattern[len(TYPE_PREFIX) :], field)
    if isinstance(pattern, str) and pattern.startswith(REGEX_PREFIX):
        try:
            re.compile(pattern[len(REGEX_PREFIX) :])
        except re.error as err:
            raise SelectionError(field, pattern, f"not a valid regular expression: {err}") from None
        if _nested_repeat(sre_parse.parse(pattern[len(REGEX_PREFIX) :])):
            raise SelectionError(
                field,
                pattern,
                "repeats a group that itself repeats or alternates, e.g. (a+)+, "
                "(.*)* or (a|ab)*, which can take exponential time to match",
                "rewrite it without the outer repeat",
            )
        return pattern
    if isinstance(pattern, str):
        try:
            glob_regex(pattern)
        except re.error as err:
            raise SelectionError(field, pattern, f"not a valid glob: {err}") from None
        return pattern
    if isinstance(pattern, type) or callable(pattern):
        return pattern
    if isinstance(pattern, tuple) and all(isinstance(t, type) for t in pattern):
        return pattern
    raise ConfigTypeError(field, pattern, "expected a name, glob, 're:' regex, type or predicate")


def _nested_repeat(parsed: object, inside_repeat: bool = False) -> bool:
    """Whether a parsed regex repeats (``*``, ``+``, ``{n,}``) something that itself repeats, or
    an alternation (``(?:.|..)*``): both can backtrack exponentially."""
    for op, av in parsed:
        if op in (
            sre_constants.MAX_REPEAT,
            sre_constants.MIN_REPEAT,
            getattr(sre_constants, "POSSESSIVE_REPEAT", None),
        ):
            low, high, sub = av
            repeats = high is sre_constants.MAXREPEAT or high > 1
            if repeats and inside_repeat or _nested_repeat(sub, inside_repeat or repeats):
                return True
        elif op is sre_constants.BRANCH:
            if inside_repeat or any(_nested_repeat(branch, inside_repeat) for branch in av[1]):
                return True
        elif op is sre_constants.SUBPATTERN:
            if _nested_repeat(av[-1], inside_repeat):
                return True
        elif op in (sre_constants.ASSERT, sre_constants.ASSERT_NOT) and _nested_repeat(av[1], inside_repeat):
            return True
    return False


def _import_type(spec: str, field: str) -> type:
    try:
        found = import_object(spec, field, default_module="torch.nn")
    except ConfigError:
        found = None
    if not isinstance(found, type):
        raise SelectionError(
            field, f"{TYPE_PREFIX}{spec}", "names no class", "use e.g. 'type:Conv2d' or 'type:pkg.module.Class'"
        )
    return found


def _matching(named: dict[str, nn.Module], patterns: list[Pattern], field: str) -> set[str]:
    chosen: set[str] = set()
    for pattern in patterns:
        hits = {name for name, module in named.items() if matches(pattern, name, module)}
        if not hits:
            raise SelectionError(field, describe(pattern), "matches no module", closest(pattern, named))
        chosen |= hits
    return chosen


def matches(pattern: Pattern, name: str, module: nn.Module) -> bool:
    if isinstance(pattern, str):
        if pattern.startswith(REGEX_PREFIX):
            return re.fullmatch(pattern[len(REGEX_PREFIX) :], name) is not None
        return name == pattern or glob_regex(pattern).fullmatch(name) is not None
    if isinstance(pattern, (type, tuple)):
        return isinstance(module, pattern)
    return bool(pattern(module, name))


@functools.lru_cache(maxsize=256)
def glob_regex(pattern: str) -> re.Pattern:
    """The regular expression of a glob on dotted names, whose segments are separated by ``.``:
    ``*`` matches within one segment (``layer1.*`` = ``layer1.0``, not ``layer1.0.conv1``),
    ``**`` as a whole segment matches any number of segments (``layer1.**`` = everything below
    ``layer1``; ``**.conv1`` = every ``conv1``; ``a.**.b`` includes ``a.b``), ``?`` one
    character and ``[...]`` one of a set, as in gitignore-style globs."""
    segments = [
        s for i, s in enumerate(pattern.split(".")) if not (s == "**" and pattern.split(".")[i - 1 : i] == ["**"])
    ]
    regex = ""
    for index, segment in enumerate(segments):
        last = index == len(segments) - 1
        if segment == "**":
            if index == 0:
                regex += r".+" if last else r"(?:[^.]+\.)*"
            else:
                regex += r"(?:\.[^.]+)+" if last else r"(?:\.[^.]+)*"
            continue
        separator = "" if index == 0 or segments[index - 1] == "**" and index == 1 else r"\."
        regex += separator + _segment_regex(segment)
    return re.compile(regex)


def _segment_regex(segment: str) -> str:
    out, i = "", 0
    while i < len(segment):
        char = segment[i]
        if char == "*":
            out += r"[^.]*"
        elif char == "?":
            out += r"[^.]"
        elif char == "[":
            start = i + 1 + (segment[i + 1 : i + 2] == "!")
            end = segment.find("]", start + (segment[start : start + 1] == "]"))
            if end == -1:
                out += re.escape(char)
            else:
                body = segment[i + 1 : end]
                out += "[" + ("^" + body[1:] if body.startswith("!") else body).replace("\\", "\\\\") + "]"
                i = end
        else:
            out += re.escape(char)
        i += 1
    return out


def closest(pattern: Pattern, named: dict[str, nn.Module]) -> str:
    if isinstance(pattern, str):
        text = pattern[len(REGEX_PREFIX) :] if pattern.startswith(REGEX_PREFIX) else pattern
        close = difflib.get_close_matches(text, [n for n in named if n], n=3, cutoff=0.4)
    else:
        close = sorted({type(m).__name__ for m in named.values()})[:6]
        close = [f"types present: {', '.join(close)}"] if close else []
    return f"closest: {', '.join(close)}" if close else "the model has no similar module names"


def describe(pattern: Selection) -> object:
    if isinstance(pattern, type):
        return pattern.__name__
    if isinstance(pattern, tuple) and all(isinstance(t, type) for t in pattern):
        return tuple(t.__name__ for t in pattern)
    if callable(pattern) and not isinstance(pattern, str):
        return getattr(pattern, "__name__", repr(pattern))
    return pattern
