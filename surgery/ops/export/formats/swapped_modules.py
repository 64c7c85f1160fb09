"""What the pickled-model formats share: a copy of the model under surgery without surgery's
hooks, some of its layers replaced by kernel-backed modules, saved whole with ``torch.save``."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from surgery.core._compat import drop_forward_hooks


def save_swapped(
    model: nn.Module, path: Path, replacements: dict[str, Callable[[nn.Module], nn.Module]]
) -> dict[str, Any]:
    """Pickle a hook-free copy of ``model`` to ``path`` with each named layer replaced by
    ``make(layer)`` (the copy's layer); the notes of a format whose kernels round otherwise."""
    plain = copy.deepcopy(model).eval()
    drop_forward_hooks(plain)
    for layer, make in replacements.items():
        parent, _, name = layer.rpartition(".")
        setattr(plain.get_submodule(parent) if parent else plain, name, make(plain.get_submodule(layer)))
    torch.save(plain, str(path))
    return {"exact": False}
