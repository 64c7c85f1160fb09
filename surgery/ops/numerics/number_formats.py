"""Number formats a quantized tensor is rounded onto: the integer grid (the default) and
floating-point ones, FP8 and micro-scaled FP4.

A format is a :class:`NumberFormat` in the ``FORMATS`` registry (``GridSpec(format=...)``);
:func:`register_number_format` adds one. A floating-point format rounds ``x / scale`` to the
nearest value it holds (ties to even), saturating at its largest magnitude, and scales by
``amax / largest`` (zero point 0):

- ``fp8_e4m3`` and ``fp8_e5m2``: exactly the rounding of ``torch.float8_e4m3fn`` /
  ``torch.float8_e5m2`` (a cast), per tensor, per channel or per block (``group_size``);
- ``mxfp4`` (OCP Microscaling): FP4 E2M1 elements in blocks of 32, each block's scale a power
  of two (E8M0): ``2^(floor(log2 amax) − 2)``, at least 2^-126 (an all-zero block: 1);
- ``nvfp4``: FP4 E2M1 elements in blocks of 16, each block's scale ``amax / 6`` stored in
  FP8 E4M3 relative to a per-tensor scale ``amax_tensor / (448 · 6)``.

The micro-scaled formats equal torchao's ``to_mx`` (floor scaling) and ``nvfp4_quantize``
(with a per-tensor scale) on the same tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from surgery.core.registry import Registry

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# the midpoints between E2M1 values, and whether a value exactly on one goes up (to the even
# neighbour: 0.75 -> 1.0, 1.75 -> 2.0, 3.5 -> 4.0) or down (0.25 -> 0, 1.25 -> 1.0, 2.5 -> 2.0, 5.0 -> 4.0)
_E2M1_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))
E4M3_LARGEST = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
E5M2_LARGEST = float(torch.finfo(torch.float8_e5m2).max)  # 57344


@dataclass(frozen=True)
class NumberFormat:
    """A grid to round onto. ``round`` maps values in units of the scale to the nearest grid
    value (float32); ``scales(amax, tensor_amax)`` turns each slice's largest magnitude into its
    scale (default ``amax / largest``); ``block_size``, for micro-scaled formats, is the number
    of consecutive inputs sharing a scale. The integer format has no ``round`` (``GridSpec``'s
    bits, symmetry and zero point define it)."""

    name: str
    bits: int
    largest: float = 0.0
    round: Callable[[Tensor], Tensor] | None = None
    scales: Callable[[Tensor, Tensor | None], Tensor] | None = None
    block_size: int | None = None
    activations: bool = True  # usable for activations (observed ranges, one static scale)

    @property
    def is_float(self) -> bool:
        return self.round is not None

    def __call__(self, x: Tensor) -> Tensor:
        return self.round(x)

    def scale_of(self, amax: Tensor, tensor_amax: Tensor | None = None) -> Tensor:
        """The scale of each slice whose largest magnitude is ``amax`` (never zero)."""
        amax = amax.float()
        scale = self.scales(amax, tensor_amax) if self.scales is not None else amax / self.largest
        return torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero slice stays zero at any scale

    def fake_quantize(self, x: Tensor, scale: Tensor) -> Tensor:
        """``x`` rounded onto the grid scaled by ``scale`` (broadcast against ``x``), in x's dtype."""
        return (self.round(x.float() / scale) * scale).to(x.dtype)


FORMATS: Registry[NumberFormat] = Registry("quantize.weights.format")


def register_number_format(fmt: NumberFormat, *, replace: bool = False) -> NumberFormat:
    """Add a number format under ``fmt.name`` (the built-ins are registered the same way)."""
    return FORMATS.register(fmt.name, fmt, replace=replace)


def number_format(name: str) -> NumberFormat:
    return FORMATS.get(name)


def _cast(dtype: torch.dtype, largest: float) -> Callable[[Tensor], Tensor]:
    def rounded(x: Tensor) -> Tensor:
        return x.float().clamp(-largest, largest).to(dtype).float()  # saturate: e4m3fn has no Inf

    return rounded


def e2m1(x: Tensor) -> Tensor:
    """``x`` rounded to FP4 E2M1 (±{0, 0.5, 1, 1.5, 2, 3, 4, 6}), ties to even, saturating at 6."""
    magnitude = x.float().abs()
    index = torch.zeros_like(magnitude, dtype=torch.long)
    for midpoint, up in _E2M1_MIDPOINTS:
        index += (magnitude >= midpoint) if up else (magnitude > midpoint)
    values = torch.tensor(E2M1_VALUES, device=x.device)[index]
    return torch.where(x < 0, -values, values)


def _e8m0_scales(amax: Tensor, tensor_amax: Tensor | None) -> Tensor:
    """2^(floor(log2 amax) − 2), the exponent clamped to E8M0's [−127, 127] (2 = log2 of E2M1's 4)."""
    exponent = torch.frexp(amax)[1] - 1  # floor(log2 amax) for amax > 0
    scale = torch.exp2((exponent - 2).clamp(-126, 127).float())  # float32's normal range (E8M0 reaches 2^-127)
    return torch.where(amax > 0, scale, torch.ones_like(scale))  # an all-zero block stays zero at any scale


def _nvfp4_scales(amax: Tensor, tensor_amax: Tensor | None) -> Tensor:
    """amax / 6 in FP8 E4M3 relative to the per-tensor scale amax_tensor / (448 · 6)."""
    whole = amax.max() if tensor_amax is None else tensor_amax.float()
    outer = whole / (E4M3_LARGEST * 6.0)
    if float(outer) == 0:
        return torch.ones_like(amax)
    eps = float(torch.finfo(torch.float8_e4m3fn).tiny)
    inner = (amax / 6.0 / outer).clamp(eps, E4M3_LARGEST).to(torch.float8_e4m3fn).float()
    return inner * outer


register_number_format(NumberFormat("int", bits=8))
register_number_format(NumberFormat("fp8_e4m3", 8, E4M3_LARGEST, _cast(torch.float8_e4m3fn, E4M3_LARGEST)))
register_number_format(NumberFormat("fp8_e5m2", 8, E5M2_LARGEST, _cast(torch.float8_e5m2, E5M2_LARGEST)))
register_number_format(NumberFormat("mxfp4", 4, 6.0, e2m1, _e8m0_scales, block_size=32, activations=False))
register_number_format(NumberFormat("nvfp4", 4, 6.0, e2m1, _nvfp4_scales, block_size=16, activations=False))
