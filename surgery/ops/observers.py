"""Quantizer settings, range observers, and scale/zero-point computation (as torch.ao)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from surgery.core.errors import ConfigError, ConfigTypeError

OBSERVERS = ("minmax", "moving_average", "percentile")
_QUANTILE_LIMIT = 1 << 24  # torch.quantile's input size limit


@dataclass
class QuantSpec:
    """How to fake-quantize one kind of tensor.

    ``bits`` in [2, 8]; ``symmetric`` uses signed integers and a zero point of 0, otherwise
    unsigned integers with an affine zero point; ``per_channel`` gives one scale per channel
    (weights: output channels; activations: dim 1 of conv outputs, the last dim of linear
    outputs). ``observer`` picks how ranges are estimated: ``minmax`` (running extremes),
    ``moving_average`` (``averaging`` constant, as torch.ao) or ``percentile`` (the
    ``percentile``/``100 - percentile`` quantiles of each batch, averaged over batches).
    """

    bits: int = 8
    symmetric: bool = False
    per_channel: bool = False
    observer: str = "minmax"
    percentile: float = 99.99
    averaging: float = 0.01

    def validate(self, field: str) -> QuantSpec:
        """Raise :class:`ConfigError` naming ``field.<key>`` for any value out of range."""
        if isinstance(self.bits, bool) or not isinstance(self.bits, int):
            raise ConfigTypeError(f"{field}.bits", self.bits, "must be an integer in [2, 8]")
        if not 2 <= self.bits <= 8:
            raise ConfigError(f"{field}.bits", self.bits, "must be an integer in [2, 8]")
        for flag in ("symmetric", "per_channel"):
            if not isinstance(getattr(self, flag), bool):
                raise ConfigTypeError(f"{field}.{flag}", getattr(self, flag), "must be true or false")
        if self.observer not in OBSERVERS:
            raise ConfigError(f"{field}.observer", self.observer, f"must be one of {', '.join(OBSERVERS)}")
        if not (isinstance(self.percentile, (int, float)) and 50 < self.percentile <= 100):
            raise ConfigError(f"{field}.percentile", self.percentile, "must be a number in (50, 100]")
        if not (isinstance(self.averaging, (int, float)) and 0 < self.averaging <= 1):
            raise ConfigError(f"{field}.averaging", self.averaging, "must be a number in (0, 1]")
        return self

    @property
    def quant_range(self) -> tuple[int, int]:
        """(quant_min, quant_max) of the integer grid."""
        if self.symmetric:
            return -(1 << (self.bits - 1)), (1 << (self.bits - 1)) - 1
        return 0, (1 << self.bits) - 1


class NonFiniteError(ConfigError):
    """NaN or Inf where a quantization range is being estimated."""


class Observer:
    """Running range estimate of a tensor, per tensor or per channel along ``axis``."""

    def __init__(self, spec: QuantSpec, axis: int | None, name: str) -> None:
        self.spec = spec
        self.axis = axis
        self.name = name
        self.low: Tensor | None = None
        self.high: Tensor | None = None
        self.count = 0

    def observe(self, x: Tensor) -> None:
        """Update the range with ``x``; NaN or Inf raises :class:`NonFiniteError`."""
        x = x.detach().float()
        if not torch.isfinite(x).all():
            raise NonFiniteError("quantize.calibration", self.name, "NaN or Inf reached this layer; clean the calibration data")
        flat = x.reshape(1, -1) if self.axis is None else x.movedim(self.axis, 0).reshape(x.shape[self.axis], -1)
        low, high = self._batch_range(flat)
        if self.low is None:
            self.low, self.high = low, high
        elif self.spec.observer == "minmax":
            self.low, self.high = torch.minimum(self.low, low), torch.maximum(self.high, high)
        elif self.spec.observer == "moving_average":
            c = self.spec.averaging
            self.low, self.high = self.low + c * (low - self.low), self.high + c * (high - self.high)
        else:  # percentile: mean of per-batch quantiles
            n = self.count
            self.low, self.high = (self.low * n + low) / (n + 1), (self.high * n + high) / (n + 1)
        self.count += 1

    def _batch_range(self, flat: Tensor) -> tuple[Tensor, Tensor]:
        if self.spec.observer != "percentile":
            return flat.amin(dim=1), flat.amax(dim=1)
        if flat.numel() > _QUANTILE_LIMIT:
            step = math.ceil(flat.numel() / _QUANTILE_LIMIT)
            flat = flat[:, ::step]
        q = torch.tensor([100 - self.spec.percentile, self.spec.percentile], dtype=flat.dtype) / 100
        low, high = torch.quantile(flat, q, dim=1)
        return low, high

    def qparams(self) -> tuple[Tensor, Tensor]:
        """(scale float32, zero_point int32), shaped () per tensor or (C,) per channel."""
        if self.low is None:
            raise ConfigError("quantize.calibration", self.name, "this layer saw no data during calibration",
                              "give batches that run through it, or exclude it")
        scale, zero_point = compute_qparams(self.low, self.high, self.spec)
        return (scale.reshape(()), zero_point.reshape(())) if self.axis is None else (scale, zero_point)


def compute_qparams(low: Tensor, high: Tensor, spec: QuantSpec) -> tuple[Tensor, Tensor]:
    """Scale and zero point for the range [low, high], with torch.ao's formulas."""
    quant_min, quant_max = spec.quant_range
    low = torch.minimum(low.float(), torch.zeros_like(low, dtype=torch.float32))
    high = torch.maximum(high.float(), torch.zeros_like(high, dtype=torch.float32))
    eps = torch.tensor(torch.finfo(torch.float32).eps)
    if spec.symmetric:
        scale = torch.maximum(torch.maximum(-low, high) / (float(quant_max - quant_min) / 2), eps)
        zero_point = torch.zeros_like(scale, dtype=torch.int32)
    else:
        scale = torch.maximum((high - low) / float(quant_max - quant_min), eps)
        zero_point = torch.clamp(quant_min - torch.round(low / scale).to(torch.int32), quant_min, quant_max)
    return scale, zero_point.to(torch.int32)


def fake_quantize(x: Tensor, scale: Tensor, zero_point: Tensor, axis: int | None, spec: QuantSpec) -> Tensor:
    """PyTorch's fused fake-quantization op for the given parameters."""
    quant_min, quant_max = spec.quant_range
    if axis is None:
        return torch.fake_quantize_per_tensor_affine(x, scale, zero_point, quant_min, quant_max)
    return torch.fake_quantize_per_channel_affine(x, scale, zero_point, axis, quant_min, quant_max)
