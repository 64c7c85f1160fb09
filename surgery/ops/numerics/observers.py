"""Observers: how a range is estimated from what a tensor held (minmax, moving average,
percentile, full range), and the :class:`Observer` a quantizer keeps."""

from __future__ import annotations

import logging
import math
from contextvars import ContextVar
from typing import Any

import torch
from torch import Tensor

from surgery.core.errors import ConfigError
from surgery.ops.numerics.fake_quant import compute_qparams
from surgery.ops.numerics.grid import GridSpec, ObservedRange, register_observer

log = logging.getLogger("surgery")
# set by quantize_kv_cache: keys and values are never constant by construction, so a constant range is bad data
VARIED_RANGES_REQUIRED: ContextVar[bool] = ContextVar("VARIED_RANGES_REQUIRED", default=False)

_QUANTILE_LIMIT = 1 << 24  # torch.quantile's input size limit


def relative_importance(energy: Tensor) -> Tensor:
    """Each input column's calibration energy E[x²] over the layer's mean (llm-compressor's
    imatrix normalisation): the ``importance`` a weighted observer receives, per column."""
    energy = energy.float()
    return energy / (energy.mean() + torch.finfo(torch.float32).tiny)


def minmax(x: Tensor, previous: ObservedRange | None, spec: GridSpec) -> tuple[Tensor, Tensor]:
    """Running extremes."""
    low, high = x.amin(dim=1), x.amax(dim=1)
    if previous is None:
        return low, high
    return torch.minimum(previous.low, low), torch.maximum(previous.high, high)


def moving_average(x: Tensor, previous: ObservedRange | None, spec: GridSpec) -> tuple[Tensor, Tensor]:
    """Exponential moving average of each batch's extremes (``spec.averaging``), as torch.ao."""
    low, high = x.amin(dim=1), x.amax(dim=1)
    if previous is None:
        return low, high
    c = spec.averaging
    low, high = previous.low + c * (low - previous.low), previous.high + c * (high - previous.high)
    # a channel whose every value is the same can come out of the two averages one ulp apart,
    # the wrong way round (c = 1: a + (b - a) need not be b); its range is that one value
    return low, torch.maximum(high, low)


def percentile(x: Tensor, previous: ObservedRange | None, spec: GridSpec) -> tuple[Tensor, Tensor]:
    """The ``100 - p`` and ``p`` quantiles of each batch, averaged over batches."""
    if x.numel() > _QUANTILE_LIMIT:
        x = x[:, :: math.ceil(x.numel() / _QUANTILE_LIMIT)]
    q = torch.tensor([100 - spec.percentile, spec.percentile], dtype=x.dtype, device=x.device) / 100
    low, high = torch.quantile(x, q, dim=1)
    if previous is None:
        return low, high
    n = previous.batches
    return (previous.low * n + low) / (n + 1), (previous.high * n + high) / (n + 1)


def full_range(x: Tensor, previous: ObservedRange | None, spec: GridSpec) -> tuple[Tensor, Tensor]:
    """Running extremes made symmetric about zero on an affine grid of ``2^bits`` levels, the
    extra level on the side of each row's larger magnitude ``M``: scale ``M / 2^(bits-1)``, zero
    point ``2^(bits-1)`` (``-M`` the lowest level) or ``2^(bits-1) - 1`` (``M`` the highest):
    llama.cpp's Q4_0/Q5_0 grids and auto-round's ``int_sym``."""
    low, high = minmax(x, previous, spec)
    low, high = low.clamp(max=0), high.clamp(min=0)
    shrink = 1 - 2.0 ** (1 - spec.bits)  # the short side: (2^(bits-1) - 1) / 2^(bits-1) of M
    largest = torch.maximum(-low, high)
    negative = -low > high  # a tie goes to the positive side, as auto-round's int_sym
    return torch.where(negative, -largest, -largest * shrink), torch.where(negative, largest * shrink, largest)


for _observer in (minmax, moving_average, percentile, full_range):
    register_observer(_observer.__name__, _observer)


class NonFiniteError(ConfigError):
    """NaN or Inf where a quantization range is being estimated."""


class Observer:
    """Running range estimate of a tensor, per tensor or per channel along ``axis``."""

    def __init__(self, spec: GridSpec, axis: int | None, name: str) -> None:
        self.spec = spec
        self.axis = axis
        self.requested_axis = axis  # may count from the end (-1): resolved against each batch
        self.name = name
        self.low: Tensor | None = None
        self.high: Tensor | None = None
        self.count = 0
        self.values = 0  # values seen per row (channel, or the whole tensor)

    def observe(self, x: Tensor) -> None:
        """Update the range with ``x``; NaN or Inf raises :class:`NonFiniteError`."""
        x = x.detach().float()
        if not torch.isfinite(x).all():
            raise NonFiniteError(
                "quantize.calibration", self.name, "NaN or Inf reached this layer; clean the calibration data"
            )
        flat = x.reshape(1, -1) if self.axis is None else x.movedim(self.axis, 0).reshape(x.shape[self.axis], -1)
        previous = None if self.low is None else ObservedRange(self.low, self.high, self.count)
        self.low, self.high = self._checked(self.spec.observe(flat, previous), flat.shape[0])
        self.count += 1
        self.values += flat.shape[1]

    def check_varied(self, what: str) -> None:
        """A range over many values that never varied (all zeros, or a bias alone) gets its scale
        from that one value (or from eps) and clips whatever the layer sees later: refused where
        a varied range is certain (:data:`VARIED_RANGES_REQUIRED`, the key/value cache), else
        warned (a layer may be constant by construction, e.g. after a zero-initialised norm)."""
        if self.low is None or self.values <= 1 or not torch.equal(self.low, self.high):
            return
        value = float(self.low.flatten()[0]) if self.low.numel() == 1 or self.low.eq(self.low[0]).all() else None
        seen = f"the value {value:g}" if value is not None else "one value per channel"
        problem = f"its {what} held {seen} in every calibration batch and position, so no range to quantize it by"
        if VARIED_RANGES_REQUIRED.get():
            raise ConfigError(
                "quantize.calibration",
                self.name,
                f"{problem} can be learned; give batches of real data, or exclude the layer",
            )
        log.warning(
            "quantize.calibration=%r: %s was learned; it will clip other values at run time", self.name, problem
        )

    def _checked(self, result: Any, rows: int) -> tuple[Tensor, Tensor]:
        """An observer's ``(low, high)``: tensors of one value per row, finite, low <= high."""
        field, name = "quantize.observer", self.spec.observer_name
        if not (isinstance(result, tuple) and len(result) == 2 and all(isinstance(r, Tensor) for r in result)):
            raise ConfigError(
                field,
                name,
                f"returned {type(result).__name__} for {self.name}; an observer returns (low, high) tensors",
            )
        low, high = (r.float().reshape(-1) for r in result)
        if low.numel() != rows or high.numel() != rows:
            raise ConfigError(
                field,
                name,
                f"returned {low.numel()} and {high.numel()} values for {self.name}; it needs one per row of x ({rows})",
            )
        if not (torch.isfinite(low).all() and torch.isfinite(high).all()) or (low > high).any():
            raise ConfigError(field, name, f"returned a range for {self.name} that is not finite with low <= high")
        return low, high

    def update(self, x: Tensor) -> None:
        """:meth:`observe` as a capture reducer (the channel axis counted from the end is
        resolved against ``x``)."""
        if self.requested_axis is not None:
            self.axis = self.requested_axis % x.dim()
        self.observe(x)

    def result(self) -> tuple[Tensor, Tensor] | None:
        return None if self.low is None else (self.low, self.high)

    def qparams(self) -> tuple[Tensor, Tensor]:
        """(scale float32, zero_point int32), shaped () per tensor or (C,) per channel."""
        if self.low is None:
            raise ConfigError(
                "quantize.calibration",
                self.name,
                "this layer saw no data during calibration",
                "give batches that run through it, or exclude it",
            )
        scale, zero_point = compute_qparams(self.low, self.high, self.spec)
        if not torch.isfinite(scale).all():
            raise NonFiniteError(
                "quantize.calibration",
                self.name,
                f"its range [{float(self.low.min()):g}, {float(self.high.max()):g}] overflows float32 in the "
                "quantization scale; clean or rescale the calibration data",
            )
        return (scale.reshape(()), zero_point.reshape(())) if self.axis is None else (scale, zero_point)
