"""Build-time rules for :func:`surgery.ops.build.intercept`: swap, wrap, on_parameter, on_buffer.

A rule pairs a ``match`` with an action. ``match`` is a class or tuple of classes (for module
rules: the child's class; for tensor rules: the owning module's class), a glob on the local
attribute name (``"relu"``, ``"*proj"``, ``"weight"``), or a predicate
``(parent, local_name, value) -> bool``.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from surgery.core.errors import ConfigError, ConfigTypeError

Match = type | tuple | str | Callable[[nn.Module, str, Any], bool]
KINDS = ("swap", "wrap", "parameter", "buffer")


@dataclass(frozen=True)
class Rule:
    """One build-time rule; create it with :func:`swap`, :func:`wrap`, :func:`on_parameter` or
    :func:`on_buffer` rather than directly."""

    kind: str
    match: Match
    action: Callable[[Any], Any]

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError("rule.kind", self.kind, f"must be one of {', '.join(KINDS)}")
        valid = (
            isinstance(self.match, (type, str))
            or callable(self.match)
            or (isinstance(self.match, tuple) and self.match and all(isinstance(t, type) for t in self.match))
        )
        if not valid:
            raise ConfigTypeError(
                f"{self.kind}.match",
                self.match,
                "must be a class, a tuple of classes, "
                "a glob on the attribute name, or a predicate (parent, name, value) -> bool",
            )
        if not callable(self.action):
            raise ConfigTypeError(f"{self.kind}.action", self.action, "must be callable")

    @property
    def label(self) -> str:
        """A short description used in logs and errors, e.g. ``swap(ReLU)``."""
        match = self.match
        if isinstance(match, type):
            text = match.__name__
        elif isinstance(match, tuple):
            text = "|".join(t.__name__ for t in match)
        elif isinstance(match, str):
            text = repr(match)
        else:
            text = getattr(match, "__name__", type(match).__name__)
        return f"{self.kind}({text})"

    def matches(self, parent: nn.Module, name: str, value: Any) -> bool:
        """Whether the rule applies to ``value`` being registered as ``parent.<name>``."""
        if isinstance(self.match, str):
            return fnmatch.fnmatchcase(name, self.match)
        if isinstance(self.match, (type, tuple)):
            subject = value if self.kind in ("swap", "wrap") else parent
            return isinstance(subject, self.match)
        return bool(self.match(parent, name, value))


def swap(match: Match, factory: Callable[[nn.Module], nn.Module]) -> Rule:
    """Replace each matching submodule by ``factory(old)`` as it is attached to its parent.

    Example:
        >>> with surgery.intercept(surgery.rules.swap(nn.ReLU, lambda old: nn.SiLU())):
        ...     model = torchvision.models.resnet18()
    """
    return Rule("swap", match, factory)


def wrap(match: Match, wrapper: Callable[[nn.Module], nn.Module]) -> Rule:
    """Replace each matching submodule by ``wrapper(old)``, a module that holds the old one.

    Example:
        >>> surgery.rules.wrap(nn.Linear, LoggingWrapper)
    """
    return Rule("wrap", match, wrapper)


def on_parameter(match: Match, fn: Callable[[nn.Parameter], Tensor | None]) -> Rule:
    """Transform each matching parameter as it is registered: ``fn`` returns a new tensor or
    ``None`` to keep it. A parameter shared by several modules is transformed once.

    Example:
        >>> surgery.rules.on_parameter("weight", surgery.rules.freeze())
    """
    return Rule("parameter", match, fn)


def on_buffer(match: Match, fn: Callable[[Tensor], Tensor | None]) -> Rule:
    """Transform each matching buffer as it is registered (``None`` keeps it).

    Example:
        >>> surgery.rules.on_buffer("running_var", lambda b: b.double())
    """
    return Rule("buffer", match, fn)


def cast(dtype: torch.dtype) -> Callable[[Tensor], Tensor | None]:
    """A tensor transform casting floating tensors to ``dtype`` (others are kept)."""

    def to_dtype(tensor: Tensor) -> Tensor | None:
        if not tensor.is_floating_point():
            return None
        cast_tensor = tensor.detach().to(dtype)
        if isinstance(tensor, nn.Parameter):
            return nn.Parameter(cast_tensor, requires_grad=tensor.requires_grad and cast_tensor.is_floating_point())
        return cast_tensor

    to_dtype.__name__ = f"cast({dtype})"
    return to_dtype


def freeze() -> Callable[[nn.Parameter], nn.Parameter]:
    """A parameter transform setting ``requires_grad=False`` (same tensor, same object)."""

    def frozen(param: nn.Parameter) -> nn.Parameter:
        return param.requires_grad_(False)

    return frozen


def reinit(init: Callable[[Tensor], Any]) -> Callable[[nn.Parameter], nn.Parameter]:
    """A parameter transform re-initialising it in place, e.g. ``reinit(nn.init.zeros_)``.

    It runs when the parameter is registered; a module that initialises its own parameters
    afterwards (``nn.Linear.reset_parameters``) overwrites it, as does a model's init loop.
    It sticks for parameters nothing re-initialises later.
    """

    def reinitialised(param: nn.Parameter) -> nn.Parameter:
        with torch.no_grad():
            init(param)
        return param

    reinitialised.__name__ = f"reinit({getattr(init, '__name__', init)})"
    return reinitialised
