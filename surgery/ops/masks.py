"""Pruning mask computation (pure functions: they read weights and never modify them)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

METHODS = ("l1_unstructured", "random_unstructured", "ln_structured")
SCOPES = ("layer", "global")


def compute_masks(
    weights: list[Tensor],
    amount: float,
    *,
    method: str,
    scope: str,
    n: float = 2.0,
    dim: int = 0,
    seed: int = 0,
) -> list[Tensor]:
    """Return one boolean keep-mask per weight (``True`` keeps the entry).

    ``amount`` is the fraction of entries (unstructured) or of slices along ``dim``
    (``ln_structured``) to prune, rounded to the nearest whole count. With ``scope="global"``
    the ranking is shared by all weights; for ``ln_structured`` a slice's Ln norm is divided by
    ``numel ** (1/n)`` of the slice so that layers of different fan-in compare fairly.
    """
    if method == "ln_structured":
        scores = [_slice_scores(w, n, dim, normalise=scope == "global") for w in weights]
    elif method == "l1_unstructured":
        scores = [w.detach().abs() for w in weights]
    else:
        generator = torch.Generator().manual_seed(seed)
        scores = [torch.rand(w.shape, generator=generator).to(w.device) for w in weights]
    if scope == "global":
        keeps = _split(_keep_smallest_pruned(torch.cat([s.flatten().float() for s in scores]), amount), scores)
    else:
        keeps = [_keep_smallest_pruned(s.flatten().float(), amount).view(s.shape) for s in scores]
    if method == "ln_structured":
        keeps = [_expand(keep, w, dim) for keep, w in zip(keeps, weights)]
    return keeps


def _keep_smallest_pruned(scores: Tensor, amount: float) -> Tensor:
    count = round(amount * scores.numel())
    keep = torch.ones_like(scores, dtype=torch.bool)
    if count > 0:
        keep[torch.topk(scores, count, largest=False, sorted=False).indices] = False
    return keep


def _split(flat: Tensor, like: list[Tensor]) -> list[Tensor]:
    sizes = [t.numel() for t in like]
    return [part.view(t.shape) for part, t in zip(flat.split(sizes), like)]


def _slice_scores(weight: Tensor, n: float, dim: int, *, normalise: bool) -> Tensor:
    dims = [d for d in range(weight.dim()) if d != dim % weight.dim()]
    norms = torch.linalg.vector_norm(weight.detach().float(), ord=n, dim=dims)
    if normalise and math.isfinite(n):
        norms = norms / (weight.numel() // weight.shape[dim]) ** (1.0 / n)
    return norms


def _expand(keep: Tensor, weight: Tensor, dim: int) -> Tensor:
    shape = [1] * weight.dim()
    shape[dim] = weight.shape[dim]
    return keep.view(shape).expand(weight.shape).clone()


def pack(mask: Tensor) -> Tensor:
    """Pack a boolean mask into a ``uint8`` tensor holding eight entries per byte."""
    flat = mask.flatten().to(torch.uint8)
    flat = torch.nn.functional.pad(flat, (0, (-flat.numel()) % 8)).view(-1, 8)
    weights = torch.arange(8, dtype=torch.uint8, device=mask.device)
    return (flat << weights).sum(dim=1, dtype=torch.uint8)


def unpack(packed: Tensor, shape: torch.Size) -> Tensor:
    """Invert :func:`pack` for a mask of the given shape."""
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    bits = (packed.unsqueeze(1) >> shifts) & 1
    return bits.flatten()[: math.prod(shape)].view(shape).bool()
