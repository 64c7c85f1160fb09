"""Swap every fused experts module of a model for :class:`LinearExperts` and back, owned by a handle.

Verbs run inside :func:`with_linear_experts`, so that each expert of a mixture-of-experts layer is a
layer of its own for them; restoring or baking the verb folds the layers back into the fused
parameters (bit for bit when every change was undone) and puts the model's own class back.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch import Tensor, nn

from surgery.core._compat import module_has_hooks, module_hooks
from surgery.core.allocator import give_back_freed_memory
from surgery.core.errors import AlreadyModifiedError, ConfigError, NoCalibrationInputError
from surgery.core.handles import Handle, attached_after
from surgery.core.verbs import VerbCall, verb
from surgery.ops.experts.layouts import check_splittable, fused_experts
from surgery.ops.experts.linear_experts import LinearExperts, split_tensors
from surgery.ops.experts.routing import check_tokens, since, tokens_per_expert

log = logging.getLogger("surgery")
H = TypeVar("H", bound=Handle)


class LinearExpertsHandle(Handle):
    """The record of :func:`linear_experts`: which experts modules were swapped for per-expert layers."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__("linear_experts", model)
        self.swapped: list[str] = []


@dataclass(frozen=True)
class LinearExpertsSpec:
    """:func:`linear_experts` has no settings: every fused experts module is split."""


@verb("linear_experts", LinearExpertsSpec, calibration="none")
def linear_experts(model: nn.Module, spec: LinearExpertsSpec, call: VerbCall) -> LinearExpertsHandle:
    """Make each expert of every fused experts module in ``model`` its own ``nn.Linear`` layers.

    Every verb does this by itself for the time it is attached; call it to work on the experts
    by hand. ``restore()`` and ``bake()`` write the layers' weights back into the fused parameters
    and put the original modules back (their class, names and state-dict keys).

    Example:
        >>> with surgery.linear_experts(model):
        ...     model.model.layers[0].mlp.experts[3].down_proj   # an nn.Linear
    """
    handle = LinearExpertsHandle(model)
    swapped = linearize(model)
    handle.swapped = [name for name, *_ in swapped]
    if swapped:
        _own(handle, swapped)
    return handle


def with_linear_experts(
    model: nn.Module, verb: str, apply: Callable[[], H], *, per_expert_statistics: bool = True
) -> H:
    """Run a verb (``apply``, returning its handle) with ``model``'s fused experts made per-expert
    layers; the handle then owns them: its ``restore()`` and ``bake()`` fold them back last. If the
    verb fails, they are folded back at once.

    When the verb calibrated, ``handle.tokens_per_expert`` holds the tokens routed to each expert
    (summed over the passes: a block-by-block method runs each block more than once), and an
    expert that ran on none is refused in one line when the verb gathers statistics per expert
    layer (``per_expert_statistics``: its statistics would be empty)."""
    swapped = linearize(model)
    if not swapped:
        return apply()
    before = {key: tokens_per_expert(model, key) for key in ("routed", "seen")}
    try:
        handle = apply()
        seen = since(before["seen"], tokens_per_expert(model, "seen"))
        calibrated = any(sum(per) for per in seen.values())
        if calibrated:
            handle.tokens_per_expert = since(before["routed"], tokens_per_expert(model, "routed"))
        if calibrated and per_expert_statistics:
            selection = getattr(handle, "selection", None)
            layers = {t.module_name for t in selection.matched.values()} if selection is not None else None
            try:
                check_tokens(seen, 1, f"{verb}.calibration", verb, layers=layers)
            except ConfigError as err:
                handle.rollback(err)
                raise
    except ConfigError as err:
        fold_back(swapped)
        clearer = _unrouted(err, [name for name, *_ in swapped], verb)
        if clearer is err:
            raise
        raise clearer from err
    except BaseException:
        fold_back(swapped)
        raise
    _own(handle, swapped)
    return handle


def _unrouted(err: ConfigError, swapped: list[str], verb: str | None) -> ConfigError:
    """A calibration error about a layer of an expert means its router sent it no token: say so
    (under ``verb.calibration``, or the error's own field without ``verb``)."""
    layer = err.value if isinstance(err.value, str) and " " not in err.value else ""
    owner = next((name for name in swapped if layer.startswith(f"{name}.")), None)
    if owner is None or not isinstance(err, NoCalibrationInputError):
        return err  # another calibration error (NaN, GPTAQ's pairing) says what it is itself
    expert = layer[len(owner) + 1 :].split(".")[0]
    return ConfigError(
        f"{verb}.calibration" if verb else err.field,
        layer,
        f"expert {expert} of {owner} was sent no calibration token by its router, so it has no statistics",
        "calibrate on more tokens, or run every token through every expert: "
        "with surgery.every_expert_calibrated(): ...",
    )


Swapped = tuple[str, nn.Module, str, nn.Module, LinearExperts]


@contextlib.contextmanager
def linearized(model: nn.Module) -> Iterator[list[str]]:
    """Inside the block, ``model``'s fused experts are per-expert layers (for work that attaches and
    restores several handles, such as a sensitivity scan); they fold back when it ends."""
    swapped = linearize(model)
    names = [name for name, *_ in swapped]
    try:
        yield names
    except ConfigError as err:  # a layer of an expert without input: its router sent it no token
        clearer = _unrouted(err, names, None)
        if clearer is err:
            raise
        raise clearer from err
    finally:
        fold_back(swapped)


def linearize(model: nn.Module, *, release: bool = True) -> list[Swapped]:
    """Swap every fused experts module of ``model`` for :class:`LinearExperts` (all or none).

    With ``release`` (what verbs do), the experts are then held once: the fused parameters give
    up their storage while the per-expert layers stand in (the same ``Parameter`` objects take the
    weights again in :func:`fold_back`); without it, the fused module keeps its tensors (a shrink
    puts them back as they were)."""
    found = fused_experts(model)
    for name, layout in found.items():
        check_splittable(name, layout, model.get_submodule(name))
        _refuse_hooked(name, model.get_submodule(name))
    swapped: list[Swapped] = []
    try:
        for name, layout in found.items():
            fused = model.get_submodule(name)
            linear = LinearExperts.from_fused(fused, layout)
            parent, local = _parent(model, name)
            setattr(parent, local, linear)
            swapped.append((name, parent, local, fused, linear))
            if release:
                _release(fused, linear)
    except BaseException:
        fold_back(swapped)
        raise
    if swapped:
        log.debug("%d experts module(s) made per-expert layers: %s", len(swapped), ", ".join(found))
    return swapped


def _release(fused: nn.Module, linear: LinearExperts) -> None:
    """Free the storage of ``fused``'s parameters (the per-expert layers hold their values now)."""
    with torch.no_grad():
        for attr in linear.fused_shapes:
            param = getattr(fused, attr)
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)


def _own(handle: Handle, swapped: list[Swapped]) -> None:
    """Make ``handle`` fold ``swapped`` back after undoing (or baking) everything else it holds."""
    handle.add(
        f"per-expert layers of {len(swapped)} experts module(s)",
        lambda: fold_back(swapped),
        lambda: fold_back(swapped),
        check=lambda: _check_nothing_on_top(handle),
        first=True,
    )


def fold_back(swapped: list[Swapped]) -> None:
    """Write each :class:`LinearExperts`' weights into its fused module and put that back, last first.

    Every shape is checked before anything is written, so a layer that changed shape leaves the
    model as it was; then each fused parameter is written expert by expert, one tensor at a time
    (never the whole of a module's experts twice)."""
    for _, _, local, _, linear in swapped:
        _check_shapes(local, linear)
    for _, parent, local, fused, linear in reversed(swapped):
        with torch.no_grad():
            targets = {
                attr: _writable(getattr(fused, attr), shape, linear) for attr, shape in linear.fused_shapes.items()
            }
            views = split_tensors(linear.layout, targets)
            for key, layer in linear.named_parameters():
                if key in views:
                    views[key].copy_(layer)
        setattr(parent, local, fused)
        _release_layers(linear)
    give_back_freed_memory()


def _release_layers(linear: LinearExperts) -> None:
    """Free the per-expert layers' storage once the fused module holds their values again (the
    handle that made them keeps them referenced; their values live on in the fused parameters)."""
    with torch.no_grad():
        for param in linear.parameters():
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)


def _writable(param: nn.Parameter, shape: torch.Size, linear: LinearExperts) -> Tensor:
    """``param`` ready to take the layers' values: its own storage, or new storage (of the layers'
    dtype and device) where it was released or the model moved since."""
    layer = next(linear.parameters())
    if param.shape != shape or param.dtype != layer.dtype or param.device != layer.device:
        param.data = torch.empty(shape, dtype=layer.dtype, device=layer.device)
    return param


def _check_shapes(local: str, linear: LinearExperts) -> None:
    """Refuse, before anything is written, a per-expert layer whose shape no longer fits its fused parameter."""
    shapes = {attr: torch.empty(shape, device="meta") for attr, shape in linear.fused_shapes.items()}
    expected = split_tensors(linear.layout, shapes)
    for key, layer in linear.named_parameters():
        if key in expected and layer.shape != expected[key].shape:
            raise ConfigError(
                "experts", f"{local}.{key}", f"now has shape {tuple(layer.shape)}, not {tuple(expected[key].shape)}"
            )


def _check_nothing_on_top(owner: Handle) -> None:
    """Refuse to fold experts back while a handle applied later may hold hooks or masks on them."""
    later = attached_after(owner)
    if later:
        kinds = ", ".join(h.kind for h in later)
        raise AlreadyModifiedError(
            f"{owner.kind}: {kinds} was applied after it on the per-expert layers it made and is still "
            f"attached; restore or bake {kinds} first (undo in reverse order), or compose them"
        )


def _refuse_hooked(name: str, module: nn.Module) -> None:
    """A hook on the fused module would stop firing while the per-expert layers stand in for it
    (an offloaded model's hooks that only bring its weights in are not missed: a verb swaps a
    module whose weights are held in memory, or one on ``meta`` that never runs)."""
    if module_has_hooks(module) and not _only_moves_weights(module):
        raise ConfigError(
            "experts", name, "has hooks of its own; remove them first (they would not run on per-expert layers)"
        )


def _parent(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    parent, _, local = name.rpartition(".")
    return (model.get_submodule(parent) if parent else model), local


def _only_moves_weights(module: nn.Module) -> bool:
    """Whether every hook on ``module`` is a method of an object marked ``only_moves_weights``."""
    return all(getattr(getattr(hook, "__self__", None), "only_moves_weights", False) for hook in module_hooks(module))
