"""The ``mse`` and ``imatrix_mse`` observers: each row's range shrunk step by step to the
clipping that rounds it with the least error, as llm-compressor's observers of those names
search it; ``imatrix_mse`` weighs each value's error by its input column's calibration energy."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from surgery.ops.numerics.fake_quant import compute_qparams, fake_quantize
from surgery.ops.numerics.grid import GridSpec, ObservedRange, register_observer


class Search(NamedTuple):
    """How far and how finely the range shrinks, and the error's power."""

    max_shrink: float  # the search goes down to (1 - max_shrink) of each row's range
    steps_per_unit: int  # in steps of 1 / steps_per_unit
    patience: int  # stops after this many steps in a row that improve no row
    norm: float  # the error is sum |rounded - x| ** norm
    inclusive: bool  # the last step (1 - max_shrink itself) is tried too


MSE = Search(0.2, 100, 5, 2.4, inclusive=False)  # 1, 0.99 ... 0.81: llm-compressor 0.14's mse
IMATRIX = Search(0.95, 20, 5, 3.0, inclusive=True)  # 1, 0.95 ... 0.05: its imatrix_mse defaults


def mse(x: Tensor, previous: ObservedRange | None, spec: GridSpec) -> tuple[Tensor, Tensor]:
    """The per-row ``(low, high)`` among ``p × (min, max)``, ``p`` = 1, 0.99, ... 0.81, whose
    rounding onto ``spec``'s grid leaves the least ``sum |error| ** 2.4``; over batches
    (activations), an exponential moving average by ``spec.averaging``, as their observer."""
    best_low, best_high = searched(x, spec, MSE)
    if previous is None:
        return best_low, best_high
    c = spec.averaging
    return previous.low + c * (best_low - previous.low), previous.high + c * (best_high - previous.high)


def imatrix_mse(x: Tensor, previous: ObservedRange | None, spec: GridSpec, importance: Tensor) -> tuple[Tensor, Tensor]:
    """The per-row ``(low, high)`` among ``p × (min, max)``, ``p`` = 1, 0.95, ... 0.05, whose
    rounding leaves the least ``sum importance × |error| ** 3`` (``importance`` shaped as ``x``:
    each value's input column's E[x²] over the layer's mean), as llm-compressor's ``imatrix_mse``."""
    return searched(x, spec, IMATRIX, importance)


def searched(x: Tensor, spec: GridSpec, search: Search, importance: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Each row's best shrunk range by ``search`` (errors weighted by ``importance`` if given)."""
    low, high = x.amin(dim=1), x.amax(dim=1)
    best_low, best_high = low.clone(), high.clone()
    best = torch.full_like(low, torch.finfo(torch.float32).max)
    stale = 0
    steps = max(1, int(search.max_shrink * search.steps_per_unit)) + int(search.inclusive)
    for step in range(steps):
        p = 1 - step / search.steps_per_unit
        error = _rounding_error(x, low * p, high * p, spec, search.norm, importance)
        better = error < best
        if not better.any():
            stale += 1
            if stale >= search.patience:
                break
            continue
        stale = 0
        best = torch.where(better, error, best)
        best_low, best_high = torch.where(better, low * p, best_low), torch.where(better, high * p, best_high)
    return best_low, best_high


def _rounding_error(
    x: Tensor, low: Tensor, high: Tensor, spec: GridSpec, norm: float, importance: Tensor | None
) -> Tensor:
    """Each row's ``sum (importance ×) |rounded - x| ** norm`` on the grid of ``[low, high]``."""
    scale, zero_point = compute_qparams(low, high, spec)
    rounded = fake_quantize(x, scale, zero_point, 0, spec)
    error = (rounded - x).abs().pow(norm)
    return (error if importance is None else error * importance).sum(dim=1)


register_observer("mse", mse)
register_observer("imatrix_mse", imatrix_mse, importance=True)
