"""Recipe ``build:`` rules: turn YAML rule specs into :mod:`surgery.ops.build.rules` objects."""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from surgery.cli.config import BuildRuleConfig
from surgery.core import importing
from surgery.core.errors import ConfigError
from surgery.core.selection import TYPE_PREFIX
from surgery.ops.build import rules
from surgery.ops.build.rules import Rule


def import_object(path: str, field: str) -> Any:
    """Import ``package.module.name``; a bare name is looked up in ``torch.nn``."""
    return importing.import_object(path, field, default_module="torch.nn")


def _match(spec: Any, field: str) -> Any:
    items = spec if isinstance(spec, (list, tuple)) else [spec]
    if not items or not all(isinstance(item, str) for item in items):
        raise ConfigError(field, spec, "must be 'type:ClassName', a name glob, or a list of them")
    types = [import_object(item[len(TYPE_PREFIX) :], field) for item in items if item.startswith(TYPE_PREFIX)]
    globs = [item for item in items if not item.startswith(TYPE_PREFIX)]
    for found in types:
        if not isinstance(found, type):
            raise ConfigError(field, spec, f"{found!r} is not a class")
    if types and not globs:
        return tuple(types)
    if globs and not types and len(globs) == 1:
        return globs[0]

    def matches(parent: nn.Module, name: str, value: Any) -> bool:
        subject = value if isinstance(value, nn.Module) else parent
        return isinstance(subject, tuple(types)) or any(fnmatch.fnmatchcase(name, g) for g in globs)

    matches.__name__ = "|".join(items)
    return matches


def _module_action(spec: BuildRuleConfig, field: str) -> Callable[[nn.Module], nn.Module]:
    if spec.kind == "swap" and spec.to:
        target = import_object(spec.to, f"{field}.to")
        return lambda old: target(**spec.kwargs)
    path = spec.factory if spec.kind == "swap" else spec.wrapper
    name = "factory" if spec.kind == "swap" else "wrapper"
    if not path:
        raise ConfigError(
            f"{field}.{name}",
            None,
            f"a {spec.kind} rule needs "
            f"{'to: CLASS or factory: CALLABLE' if spec.kind == 'swap' else 'wrapper: CALLABLE'}",
        )
    target = import_object(path, f"{field}.{name}")
    return lambda old: target(old, **spec.kwargs)


def _tensor_action(spec: BuildRuleConfig, field: str) -> Callable[[torch.Tensor], Any]:
    steps: list[Callable[[torch.Tensor], Any]] = []
    if spec.init:
        steps.append(rules.reinit(import_object(spec.init, f"{field}.init")))
    if spec.dtype:
        dtype = getattr(torch, str(spec.dtype), None)
        if not isinstance(dtype, torch.dtype):
            raise ConfigError(f"{field}.dtype", spec.dtype, "is not a torch dtype (e.g. bfloat16, float16, float64)")
        steps.append(rules.cast(dtype))
    if spec.requires_grad is not None:
        steps.append(lambda t: t.requires_grad_(spec.requires_grad) if isinstance(t, nn.Parameter) else None)
    if not steps:
        raise ConfigError(field, spec.kind, "needs at least one of dtype, requires_grad, init")

    def transform(tensor: torch.Tensor) -> torch.Tensor:
        for step in steps:
            result = step(tensor)
            tensor = tensor if result is None else result
        return tensor

    return transform


def rules_from_config(specs: list[BuildRuleConfig]) -> list[Rule]:
    """Build the :class:`Rule` objects of a recipe's ``build:`` list, in order."""
    built = []
    for index, spec in enumerate(specs):
        field = f"build[{index}]"
        match = _match(spec.match, f"{field}.match")
        if spec.kind in ("swap", "wrap"):
            built.append(Rule(spec.kind, match, _module_action(spec, field)))
        else:
            built.append(Rule(spec.kind, match, _tensor_action(spec, field)))
    return built


def neutral(rule_list: list[Rule]) -> list[Rule]:
    """The same matches with actions that change nothing: the build ``identity`` check."""
    return [
        Rule(r.kind, r.match, (lambda old: old) if r.kind in ("swap", "wrap") else (lambda t: None)) for r in rule_list
    ]
