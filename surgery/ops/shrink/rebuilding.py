"""``surgery.rebuild``: the original class at the shrunk shapes, from the recorded structure
:meth:`ShrinkHandle.structure` gives (:mod:`surgery.ops.shrink.structure` checks it as untrusted input)."""

from __future__ import annotations

import importlib
import json
import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from surgery.core._compat import get_slot, set_slot
from surgery.core.errors import ConfigError, ConfigTypeError
from surgery.ops.build import rules
from surgery.ops.build.intercept import RuleNeverFiredWarning, intercept
from surgery.ops.shrink import structure
from surgery.ops.shrink.smaller import describe, rebuildable, rebuildable_kinds
from surgery.ops.shrink.structure import ShrinkError


def _layer_class(path: str) -> type:
    """The class a plan names: a layer shrink makes (a subclass keeping its base's constructor,
    such as torchvision's ``LayerNorm2d``, included)."""
    module_name, _, name = path.rpartition(".") if isinstance(path, str) else ("", "", "")
    known = module_name == "torch" or module_name.startswith(("torch.", "torchvision.", "timm.", "transformers."))
    try:  # a module outside the libraries shrink knows is imported only if it is already loaded
        module = importlib.import_module(module_name) if known else sys.modules.get(module_name)
        cls = getattr(module, name, None)
    except ImportError:
        cls = None
    if not isinstance(cls, type) or not rebuildable(cls):
        raise ConfigError(
            "rebuild.plan",
            path,
            f"is not a layer shrink makes (a class of the kinds {rebuildable_kinds()}, "
            "or a subclass keeping its constructor)",
        )
    return cls


def rebuild(
    factory: Callable[[], nn.Module],
    plan: dict[str, dict[str, Any]],
    *,
    device: str | torch.device = "cpu",
    meta: bool = True,
) -> nn.Module:
    """The original class at the shrunk shapes, ready for ``load_state_dict(strict=True)`` of
    the baked state dict.

    ``factory()`` runs inside :func:`surgery.intercept`: each layer the plan names is swapped
    for a layer of the planned shape as the constructor attaches it, and planned attributes
    (attention head counts) are set then, so the constructor's own code after that point sees
    the smaller model. Layers are recognised by the order they are attached in, learnt from a
    first build with parameters on ``meta``. With ``meta=True`` (default) the real build also
    puts every parameter on ``meta`` as it is registered (no full-size weight is kept;
    buffers stay real) and the model is materialised on ``device`` uninitialised: load the baked
    weights next.

    Example:
        >>> model = surgery.rebuild(torchvision.models.resnet50, handle.structure())
        >>> model.load_state_dict(baked.state_dict(), strict=True)
    """
    if not callable(factory):
        raise ConfigTypeError("rebuild.factory", type(factory).__name__, "must be a callable returning the model")
    plan, expected = structure.read_entries(_read_plan(plan))
    for entry in plan.values():
        if "args" in entry:
            _layer_class(entry["class"])
    order, model = _attach_order(factory)
    structure.check_model(model, expected, factory)
    named = dict(model.named_modules())
    for name, entry in plan.items():
        if name not in named:
            raise ConfigError("rebuild.plan", name, "is not a module of the model the factory builds")
        if not _is_planned_class(named[name], entry):
            raise ConfigError(
                "rebuild.plan",
                name,
                f"is a {type(named[name]).__name__} in this model; the plan has a {entry['class'].rpartition('.')[2]}",
            )
        structure.check_attributes(name, named[name], entry.get("attributes", {}))
        if id(named[name]) not in order and "args" in entry:
            raise ConfigError(
                "rebuild.plan", name, "is not attached by the constructor; only submodules can be replaced"
            )
    wanted = {order[id(named[name])]: (name, entry) for name, entry in plan.items() if id(named[name]) in order}
    counter = _AttachCounter()
    made: dict[str, nn.Module] = {}

    def planned(parent: nn.Module, local: str, child: nn.Module) -> bool:
        return counter.next(child) in wanted

    def build(child: nn.Module) -> nn.Module:
        name, entry = wanted[counter.last]
        if not _is_planned_class(child, entry):
            raise ShrinkError(
                f"rebuild: {name} does not have its planned shape: the second build attached a "
                f"{type(child).__name__} where the first had a {entry['class'].rpartition('.')[2]}; "
                "the factory does not build the same model twice"
            )
        made[name] = _planned(child, entry, meta)
        return made[name]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuleNeverFiredWarning)
        with intercept(*([rules.swap(planned, build)] if wanted else []), *_meta_parameters(meta)):
            model = factory()
    for name, entry in plan.items():  # the model itself is never attached: changed once it is built
        if name not in made and name in dict(model.named_modules()):
            made[name] = _planned(model.get_submodule(name), entry, meta)
    _check_rebuilt(model, plan, made)
    return _materialise(model, device) if meta else model.to(device)


def _read_plan(plan: Any) -> dict[str, Any]:
    """A plan dict, its JSON text, or the path of a ``model.plan.json``."""
    if isinstance(plan, (str, os.PathLike)):
        text = str(plan)
        if not text.lstrip().startswith("{"):
            try:
                text = Path(text).read_text()
            except OSError as err:
                raise ConfigError(
                    "rebuild.plan", str(plan)[:80], f"is neither plan JSON nor a readable file ({type(err).__name__})"
                ) from None
        try:
            plan = json.loads(text)
        except json.JSONDecodeError as err:
            raise ConfigError("rebuild.plan", str(plan)[:80], f"is not valid JSON ({err})") from None
        except RecursionError:
            raise ConfigError("rebuild.plan", str(plan)[:80], "is nested too deeply to be a plan") from None
    if not isinstance(plan, dict):
        raise ConfigTypeError(
            "rebuild.plan",
            type(plan).__name__,
            "must be the dict ShrinkHandle.structure() returns, its JSON, or a model.plan.json path",
        )
    return plan


def _plain(value: Any) -> Any:
    """``value`` as JSON holds it (tuples as lists)."""
    return list(value) if isinstance(value, tuple) else value


def _is_planned_class(module: nn.Module, entry: dict[str, Any]) -> bool:
    if "args" in entry:
        return isinstance(module, _layer_class(entry["class"]))
    return f"{type(module).__module__}.{type(module).__qualname__}" == entry["class"]


def _planned(module: nn.Module, entry: dict[str, Any], meta: bool) -> nn.Module:
    """``module`` as the plan entry has it: a new layer of the planned shape, or the same module
    with planned attributes and per-channel parameters (uninitialised) set."""
    if "args" in entry:
        args = {k: tuple(v) if isinstance(v, list) and k != "normalized_shape" else v for k, v in entry["args"].items()}
        try:
            new = _layer_class(entry["class"])(**args)
        except (TypeError, ValueError, RuntimeError) as err:
            raise ConfigError(
                "rebuild.plan",
                entry["class"].rpartition(".")[2],
                f"cannot be built with {args}: {type(err).__name__}: {err}",
            ) from None
        new.train(module.training)
        return new
    for attr, value in entry.get("attributes", {}).items():
        setattr(module, attr, tuple(value) if isinstance(getattr(module, attr, None), tuple) else value)
    for attr, shape in entry.get("parameters", {}).items():
        old = get_slot(module, attr)
        device = "meta" if meta else old.device
        set_slot(module, attr, nn.Parameter(torch.empty(shape, dtype=old.dtype, device=device), old.requires_grad))
    for attr, shape in entry.get("buffers", {}).items():  # real storage: a buffer is not moved to meta
        old = get_slot(module, attr, "buffers")
        set_slot(module, attr, torch.empty(shape, dtype=old.dtype, device=old.device), "buffers")
    return module


def _meta_parameters(meta: bool) -> list[rules.Rule]:
    """Parameters go to ``meta`` as they are registered (no weight is filled or kept); buffers
    stay real, so values the constructor computes (position ids, masks) survive."""
    if not meta:
        return []
    return [rules.on_parameter("*", lambda p: nn.Parameter(p.detach().to("meta"), requires_grad=p.requires_grad))]


def _materialise(model: nn.Module, device: str | torch.device) -> nn.Module:
    """Uninitialised storage on ``device`` for every ``meta`` parameter (tied ones stay tied)."""
    made: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False, remove_duplicate=False)):
            if param is not None and param.is_meta:
                if id(param) not in made:
                    made[id(param)] = nn.Parameter(
                        torch.empty_like(param, device=device), requires_grad=param.requires_grad
                    )
                set_slot(module, name, made[id(param)])
    return model.to(device)


class _AttachCounter:
    """Numbers the modules a build attaches, in order, each object once."""

    def __init__(self) -> None:
        self.seen: dict[int, nn.Module] = {}  # holds every module: a freed one's id could be reused
        self.count = -1
        self.last = -1

    def next(self, child: nn.Module) -> int:
        if id(child) in self.seen:
            return -1
        self.seen[id(child)] = child
        self.count += 1
        self.last = self.count
        return self.count


def _attach_order(factory: Callable[[], nn.Module]) -> tuple[dict[int, int], nn.Module]:
    """A build on ``meta``: the attach number of every module, keyed by ``id``."""
    counter = _AttachCounter()
    numbers: dict[int, int] = {}

    def record(parent: nn.Module, local: str, child: nn.Module) -> bool:
        number = counter.next(child)
        if number >= 0:
            numbers[id(child)] = number
        return False

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuleNeverFiredWarning)
        with intercept(rules.swap(record, lambda old: old), *_meta_parameters(True)):
            model = factory()
    if not isinstance(model, nn.Module):
        raise ConfigTypeError("rebuild.factory", type(model).__name__, "must return an nn.Module")
    alive = {id(module) for module in model.modules()}  # ids of modules the build dropped may be reused
    return {key: number for key, number in numbers.items() if key in alive}, model


def _check_rebuilt(model: nn.Module, plan: dict[str, dict[str, Any]], made: dict[str, nn.Module]) -> None:
    """Every planned layer is where the plan puts it, with its planned shape: a factory that
    builds in another order fails here."""
    named = dict(model.named_modules())
    for name, entry in plan.items():
        module = named.get(name)
        same = (
            module is not None
            and made.get(name) is module
            and (
                describe(module)["args"] == entry["args"]
                if "args" in entry
                else (
                    all(
                        _plain(getattr(module, attr, None)) == value
                        for attr, value in entry.get("attributes", {}).items()
                    )
                    and all(
                        list(get_slot(module, attr, kind).shape) == shape
                        for kind in ("parameters", "buffers")
                        for attr, shape in entry.get(kind, {}).items()
                    )
                )
            )
        )
        if not same:
            raise ShrinkError(
                f"rebuild: {name} does not have its planned shape after the build; the factory does "
                "not build the same model twice (random architecture?)"
            )
