"""Swap every fused experts module of a model for :class:`LinearExperts` and back, owned by a handle.

Verbs call :func:`own_linear_experts` first, so that each expert of a mixture-of-experts layer is a
layer of its own for them; restoring or baking the verb folds the layers back into the fused
parameters (bit for bit when every change was undone) and puts the model's own class back.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from surgery.core._compat import module_has_hooks
from surgery.core.errors import AlreadyModifiedError, ConfigError
from surgery.core.handles import Handle, attached_after
from surgery.ops.experts.layouts import check_splittable, fused_experts
from surgery.ops.experts.linear_experts import LinearExperts

log = logging.getLogger("surgery")


class LinearExpertsHandle(Handle):
    """The record of :func:`linear_experts`: which experts modules were swapped for per-expert layers."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__("linear_experts", model)
        self.swapped: list[str] = []


def linear_experts(model: nn.Module) -> LinearExpertsHandle:
    """Make each expert of every fused experts module in ``model`` its own ``nn.Linear`` layers.

    ``restore()`` and ``bake()`` write the layers' weights back into the fused parameters and put
    the original modules back (their class, names and state-dict keys).

    Example:
        >>> with surgery.linear_experts(model):
        ...     model.model.layers[0].mlp.experts[3].down_proj   # an nn.Linear
    """
    handle = LinearExpertsHandle(model)
    with handle.applying():
        handle.swapped = own_linear_experts(handle, model)
    return handle


def own_linear_experts(handle: Handle, model: nn.Module) -> list[str]:
    """Swap ``model``'s fused experts modules for :class:`LinearExperts`, as one step of ``handle``
    (undone and baked after the steps ``handle`` adds later). Returns the names swapped."""
    found = fused_experts(model)
    for name, layout in found.items():
        check_splittable(name, layout, model.get_submodule(name))
    swapped: list[tuple[nn.Module, str, nn.Module, LinearExperts]] = []
    try:
        for name, layout in found.items():
            fused = model.get_submodule(name)
            _refuse_hooked(name, fused)
            linear = LinearExperts.from_fused(fused, layout)
            parent, local = _parent(model, name)
            setattr(parent, local, linear)
            swapped.append((parent, local, fused, linear))
    except BaseException:
        _fold_back(swapped)
        raise
    if swapped:
        names = list(found)
        handle.add(
            f"linear experts ({len(names)} layer(s))",
            lambda: _fold_back(swapped),
            lambda: _fold_back(swapped),
            check=lambda: _check_nothing_on_top(handle),
        )
        log.debug("%s: %d experts module(s) made per-expert layers: %s", handle.kind, len(names), ", ".join(names))
    return list(found)


def _fold_back(swapped: list[tuple[nn.Module, str, nn.Module, LinearExperts]]) -> None:
    """Write each :class:`LinearExperts`' weights into its fused module and put that back, last first.

    Every tensor is computed before any is written, so a failure leaves the model as it was."""
    planned = [(parent, local, fused, linear.fused_tensors()) for parent, local, fused, linear in swapped]
    for parent, local, fused, tensors in reversed(planned):
        with torch.no_grad():
            for attr, value in tensors.items():
                param = getattr(fused, attr)
                if param.shape != value.shape:
                    raise ConfigError(
                        "experts", f"{local}.{attr}", f"now has shape {tuple(value.shape)}, not {tuple(param.shape)}"
                    )
                if param.device != value.device or param.dtype != value.dtype:
                    param.data = torch.empty_like(value)
                param.copy_(value)
        setattr(parent, local, fused)


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
    """A hook on the fused module would stop firing while the per-expert layers stand in for it."""
    if module_has_hooks(module):
        raise ConfigError(
            "experts", name, "has hooks of its own; remove them first (they would not run on per-expert layers)"
        )


def _parent(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    parent, _, local = name.rpartition(".")
    return (model.get_submodule(parent) if parent else model), local
