"""Audits of a model under surgery: snapshots of everything ``restore()`` must put back, hook
counts (per module and in torch's global registries), outputs collected over batches, and which
parameters carry transforms. The command line's round-trip checks run on them, and
:mod:`surgery.testing` gives them to your tests."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from surgery.analysis.metrics import same_bits
from surgery.core import guards
from surgery.core._compat import global_hook_counts, module_hook_counts
from surgery.core.inputs import Inputs, batches, evaluating, outputs


@dataclass
class Snapshot:
    """Everything restore must put back: tensors, keys, classes and hooks."""

    tensors: dict[str, Tensor]
    keys: list[str]
    classes: dict[str, type]
    hooks: dict[str, int]
    global_hooks: dict[str, int] = field(default_factory=dict)


def snapshot(model: nn.Module) -> Snapshot:
    """Copy the state of ``model`` that ``restore()`` must reproduce bit for bit."""
    tensors = {f"param:{k}": v.detach().clone() for k, v in model.named_parameters(remove_duplicate=False)}
    tensors |= {f"buffer:{k}": v.detach().clone() for k, v in model.named_buffers(remove_duplicate=False)}
    return Snapshot(
        tensors,
        list(model.state_dict()),
        {n: type(m) for n, m in model.named_modules()},
        module_hook_counts(model),
        global_hook_counts(),
    )


def snapshot_differences(before: Snapshot, after: Snapshot) -> list[str]:
    """Human-readable differences between two snapshots (empty when bit-identical)."""
    diffs = [
        f"tensor {k} changed"
        for k, v in before.tensors.items()
        if k not in after.tensors or not same_bits(v, after.tensors[k])
    ]
    diffs += [f"tensor {k} appeared" for k in after.tensors if k not in before.tensors]
    if before.keys != after.keys:
        diffs.append("state_dict keys changed")
    if before.classes != after.classes:
        diffs.append("module classes or children changed")
    diffs += [f"hooks {k}: {v} -> {after.hooks.get(k)}" for k, v in before.hooks.items() if after.hooks.get(k) != v]
    diffs += [
        f"global {k}: {v} -> {after.global_hooks.get(k)}"
        for k, v in before.global_hooks.items()
        if after.global_hooks.get(k) != v
    ]
    return diffs


def collect(model: nn.Module, inputs: Inputs) -> list[Tensor]:
    """Every floating output tensor of ``model`` over ``inputs`` (eval mode, no grad)."""
    with evaluating(model), torch.no_grad():
        return [t for batch in batches(inputs) for t in outputs(model, batch)]


def max_difference(a: list[Tensor], b: list[Tensor]) -> tuple[bool, float]:
    """(bit-identical?, largest absolute difference) between two output lists.

    Identity is bit for bit, so a NaN equals the same NaN; the difference is ``inf`` where
    one side is non-finite and the other is not the same value.
    """
    if len(a) != len(b) or any(x.shape != y.shape for x, y in zip(a, b)):
        return False, float("inf")
    identical = all(same_bits(x, y) for x, y in zip(a, b))
    return identical, 0.0 if identical else max((_worst(x, y) for x, y in zip(a, b) if x.numel()), default=0.0)


def _worst(x: Tensor, y: Tensor) -> float:
    x, y = x.detach().double(), y.detach().double()
    differ = ~((x == y) | (torch.isnan(x) & torch.isnan(y)))
    if not differ.any():
        return 0.0
    return (x[differ] - y[differ]).abs().nan_to_num(nan=math.inf).max().item()


def transformed_parameters(model: nn.Module) -> list[str]:
    """Qualified names of the parameters of ``model`` that have a transform attached
    (masks, quantization, :func:`surgery.attach_transform`)."""
    return [name for name, p in model.named_parameters(remove_duplicate=False) if guards.transforms_of(p)]
