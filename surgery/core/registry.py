"""Named extension points: criteria, observers, reductions. Built-ins register the same way users do."""

from __future__ import annotations

import difflib
import threading
from collections.abc import Iterator
from typing import Generic, TypeVar

from surgery.core.errors import ConfigError, ConfigTypeError

T = TypeVar("T")


class Registry(Generic[T]):
    """A name -> entry table for one kind of extension (``"prune.method"``, ``"observer"``...).

    Example:
        >>> CRITERIA = Registry("prune.method")
        >>> CRITERIA.register("l1_unstructured", l1_score)
        >>> CRITERIA.get("l1_unstructured") is l1_score
        True
    """

    def __init__(self, field: str, *, table: bool = False) -> None:
        self.field = field
        self.table = table  # a table of settings (deploy targets, plan choices): any entry, names such as "2:4"
        self._entries: dict[str, T] = {}
        self._lock = threading.Lock()

    def register(self, name: str, entry: T, *, replace: bool = False) -> T:
        """Add ``entry`` under ``name``; a taken name raises unless ``replace``. Returns ``entry``."""
        if not self.table and not callable(entry) and not callable(getattr(entry, "score", None)):
            raise ConfigTypeError(f"{self.field} entry", entry, "must be callable")
        if self.table and isinstance(name, str) and name and not any(c.isspace() for c in name):
            pass
        elif not isinstance(name, str) or not name.replace("-", "_").isidentifier():
            raise ConfigTypeError(
                f"{self.field} name", name, "must be a Python identifier (or hyphenated) such as 'my_criterion'"
            )
        with self._lock:
            if name in self._entries and not replace and self._entries[name] is not entry:
                raise ConfigError(f"{self.field} name", name, "is already registered; pass replace=True to replace it")
            self._entries[name] = entry
        return entry

    def unregister(self, name: str) -> None:
        """Remove ``name`` (a no-op when it is not registered)."""
        with self._lock:
            self._entries.pop(name, None)

    def get(self, name: object) -> T:
        """The entry registered as ``name``; anything else raises a one-line :class:`ConfigError`
        listing what is registered, closest first."""
        if isinstance(name, str) and name in self._entries:
            return self._entries[name]
        close = difflib.get_close_matches(name, list(self._entries), n=1) if isinstance(name, str) else []
        hint = f"did you mean {close[0]!r}?" if close else ""
        raise ConfigError(self.field, name, f"must be one of {', '.join(self._entries)}", hint)

    def __getitem__(self, name: object) -> T:
        return self.get(name)

    def names(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._entries))
