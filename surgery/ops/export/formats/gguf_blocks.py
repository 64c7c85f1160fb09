"""GGUF's block types as surgery's grids: which grid each holds exactly, and the packing of a
weight's integers and scales into that type's bytes (llama.cpp's ``ggml-common.h`` layouts,
checked against gguf-py's dequantizers).

A block runs along a weight's inputs (a row of ``weight.reshape(out, -1)``), as surgery's groups
do. The legacy types hold a signed integer under one fp16 scale ``d`` per 32 inputs:

- ``Q8_0``: ``d * q``, ``q`` in [-128, 127] (int8);
- ``Q4_0``: ``d * (n - 8)``, ``n`` a nibble; ``Q5_0``: ``d * (n - 16)``, ``n`` five bits.

Surgery's integer grid computes ``scale * (q - zero point)``. A block holds it exactly when the
group is 32 inputs, the scale is an fp16 value (``scale_dtype="float16"``, which
``quantize(target="gguf:Q4_0")`` sets) and every ``q - zero point`` fits the type's signed range
— or its negation does, stored under ``d = -scale`` (llama.cpp's own Q4_0 stores ``d`` negative
when the block's positive side is larger). So ``Q4_0``/``Q5_0`` hold ``observer="full_range"``
(zero point 8/7, 16/15) and symmetric grids of their bits; ``Q8_0`` symmetric 8-bit and
``full_range`` 8-bit. Grids with a float minimum (``Q4_1``, ``Q5_1``) and the two-level K-quants
are not held here: surgery's affine zero point is an integer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from surgery.ops.numerics.deployment import WeightGrid

BLOCK = 32  # inputs per block of the legacy types
K_BLOCK = 256  # inputs per super-block of the K-quants


@dataclass(frozen=True)
class BlockType:
    """One GGUF tensor type surgery writes from a grid: ``signed`` is the range of the stored
    integer (``value = scale * stored``, the grid's ``q - zero point``) in groups of ``group``
    inputs; the legacy types store each group's scale as an fp16 ``d``; the K-quants
    (``scale_levels`` set) every ``super_block`` inputs' as one fp16 ``d`` times a signed integer
    of magnitude at most ``scale_levels`` per group. ``pack(values, d, sub_scales)`` gives the
    rows' bytes from (rows, blocks, super_block) signed integers, (rows, blocks) fp16 ``d`` and
    (rows, blocks, groups) integer sub-scales (None for the legacy types); ``target`` the
    GridSpec fields that make :func:`surgery.quantize` compute on this type's grid."""

    name: str
    signed: tuple[int, int]
    pack: Callable[[np.ndarray, np.ndarray, np.ndarray | None], np.ndarray]
    target: dict = field(default_factory=dict)
    bits: int = 8
    block_bytes: int = 34  # bytes of one block of super_block inputs
    group: int = BLOCK
    super_block: int = BLOCK
    scale_levels: int | None = None

    def holds(self, grid: WeightGrid, columns: int) -> str | None:
        """Why ``grid`` (of a weight with ``columns`` inputs) cannot be written as this type, or None."""
        spec = grid.spec
        if spec.is_float or grid.g_idx is not None:
            return "an integer grid of consecutive groups" if grid.g_idx is None else "groups of consecutive inputs"
        if spec.group_size != self.group or columns % self.super_block:
            return (
                f"groups of {self.group} inputs in rows of a multiple of {self.super_block} "
                f"(group_size={spec.group_size}, {columns} inputs)"
            )
        low, high = spec.quant_range
        zero = grid.zero_point.to(torch.int32)
        lowest, highest = low - zero, high - zero  # each group's signed range q - zero point
        fits = (lowest >= self.signed[0]) & (highest <= self.signed[1])
        flipped = (-highest >= self.signed[0]) & (-lowest <= self.signed[1])
        if not bool((fits | flipped).all()):
            return f"signed integers within [{self.signed[0]}, {self.signed[1]}] (bits={spec.bits})"
        if self.scale_levels is None:
            scale = grid.scale.float()
            if not torch.equal(scale.half().float(), scale):
                return f"fp16 scales (quantize with target='gguf:{self.name}' or scale_dtype='float16')"
            return None
        d, levels = self._two_level(grid.scale.float().reshape(grid.scale.shape[0], -1))
        exact = torch.equal(d.half().double(), d) and torch.equal(levels, levels.round())
        if not exact or levels.min() < 1 or levels.max() > self.scale_levels:
            return (
                f"each group's scale an integer in [1, {self.scale_levels}] times one fp16 scale per "
                f"{self.super_block} inputs (quantize with target='gguf:{self.name}')"
            )
        return None

    def _two_level(self, scale: Tensor) -> tuple[Tensor, Tensor]:
        """(rows, groups) scales as (rows, blocks, 1) super-block scales ``d`` (float64: the largest
        group is at the top level, as the simulation puts it) and (rows, blocks, groups)
        multiples of ``d``: integers where the grid is two-level."""
        blocks = scale.double().reshape(scale.shape[0], -1, self.super_block // self.group)
        d = blocks.amax(-1, keepdim=True) / self.scale_levels
        return d, blocks / d

    def encode(self, grid: WeightGrid, integers: Tensor) -> np.ndarray:
        """The (rows, bytes per row) uint8 data of a weight's (rows, columns) ``integers`` on ``grid``
        (checked by :meth:`holds`)."""
        rows, columns = integers.shape
        zero = grid.zero_point.to(torch.int32).cpu().reshape(rows, -1)
        scale = grid.scale.float().cpu().reshape(rows, -1)
        signed = (integers.cpu().reshape(rows, -1, self.group) - zero[..., None]).to(torch.int32)
        low, high = grid.spec.quant_range
        fits = ((low - zero) >= self.signed[0]) & ((high - zero) <= self.signed[1])
        sign = torch.where(fits, 1, -1)  # a negated group is stored under a negated scale
        signed = (signed * sign[..., None]).reshape(rows, -1, self.super_block)
        if self.scale_levels is None:
            return self.pack(signed.numpy(), (scale * sign).half().numpy(), None)
        d, levels = self._two_level(scale)
        sub = (levels.round().to(torch.int32) * sign.reshape(levels.shape)).numpy()
        return self.pack(signed.numpy(), d[..., 0].half().numpy(), sub)


def _d_bytes(d: np.ndarray) -> np.ndarray:
    """(rows, blocks) fp16 as (rows, blocks, 2) little-endian bytes."""
    return d.astype("<f2").view(np.uint8).reshape(*d.shape, 2)


def _nibbles(low: np.ndarray) -> np.ndarray:
    """(rows, blocks, 32) values in [0, 15] as 16 bytes a block: byte j holds value j in its low
    nibble and value j + 16 in its high one."""
    return (low[..., :16] | (low[..., 16:] << 4)).astype(np.uint8)


def pack_q8_0(signed: np.ndarray, d: np.ndarray, _sub: None = None) -> np.ndarray:
    """``d``, then 32 int8."""
    rows, blocks, _ = signed.shape
    data = np.concatenate([_d_bytes(d), signed.astype(np.int8).view(np.uint8)], axis=-1)
    return data.reshape(rows, blocks * 34)


def pack_q4_0(signed: np.ndarray, d: np.ndarray, _sub: None = None) -> np.ndarray:
    """``d``, then 16 bytes of nibbles ``q + 8``."""
    rows, blocks, _ = signed.shape
    data = np.concatenate([_d_bytes(d), _nibbles((signed + 8).astype(np.uint8))], axis=-1)
    return data.reshape(rows, blocks * 18)


def pack_q5_0(signed: np.ndarray, d: np.ndarray, _sub: None = None) -> np.ndarray:
    """``d``, a little-endian uint32 of every value's fifth bit, then the low nibbles of ``q + 16``."""
    rows, blocks, _ = signed.shape
    stored = (signed + 16).astype(np.uint32)
    high = ((stored >> 4) & 1) << np.arange(BLOCK, dtype=np.uint32)
    fifth = high.sum(axis=-1, dtype=np.uint32).astype("<u4").view(np.uint8).reshape(rows, blocks, 4)
    data = np.concatenate([_d_bytes(d), fifth, _nibbles((stored & 15).astype(np.uint8))], axis=-1)
    return data.reshape(rows, blocks * 22)


def _bit_fields(values: np.ndarray, width: int) -> np.ndarray:
    """(..., k, n) values of ``width`` bits as (..., n) bytes: value ``i`` of the k at bit ``i * width``."""
    shifts = (np.arange(values.shape[-2], dtype=np.uint8) * width)[:, None]
    return np.bitwise_or.reduce((values.astype(np.uint8) << shifts).astype(np.uint8), axis=-2)


def pack_q6_k(signed: np.ndarray, d: np.ndarray, sub: np.ndarray) -> np.ndarray:
    """Per 256 inputs: the low nibbles of ``q + 32`` (each half's 128 values as 64 bytes, value
    ``j`` low and ``j + 64`` high), their top two bits (each half's as 32 bytes, values ``j``,
    ``j + 32``, ``j + 64``, ``j + 96`` from the lowest bits up), 16 int8 sub-scales, ``d``."""
    rows, blocks, _ = signed.shape
    halves = (signed + 32).astype(np.uint8).reshape(rows, blocks, 2, 128)
    low = _bit_fields((halves & 15).reshape(rows, blocks, 2, 2, 64), 4).reshape(rows, blocks, 128)
    high = _bit_fields((halves >> 4).reshape(rows, blocks, 2, 4, 32), 2).reshape(rows, blocks, 64)
    data = np.concatenate([low, high, sub.astype(np.int8).view(np.uint8), _d_bytes(d)], axis=-1)
    return data.reshape(rows, blocks * 210)


def pack_q3_k(signed: np.ndarray, d: np.ndarray, sub: np.ndarray) -> np.ndarray:
    """Per 256 inputs: the third bit of ``q + 4`` (32 bytes, values ``j + 32 k`` at bit ``k``), its
    low two bits (each half's 128 values as 32 bytes, ``j + 32 k`` at bits ``2 k``), the 16
    sub-scales ``+ 32`` in six bits (low nibbles of ``j`` and ``j + 8`` in 8 bytes, top two bits of
    ``j + 4 k`` in 4), ``d``."""
    rows, blocks, _ = signed.shape
    stored = (signed + 4).astype(np.uint8)
    third = _bit_fields((stored >> 2).reshape(rows, blocks, 8, 32), 1)
    low = _bit_fields((stored & 3).reshape(rows, blocks, 2, 4, 32), 2).reshape(rows, blocks, 64)
    scales = (sub + 32).astype(np.uint8)
    nibbles = _bit_fields((scales & 15).reshape(rows, blocks, 2, 8), 4)
    tops = _bit_fields((scales >> 4).reshape(rows, blocks, 4, 4), 2)
    data = np.concatenate([third, low, nibbles, tops, _d_bytes(d)], axis=-1)
    return data.reshape(rows, blocks * 110)


def _target(bits: int) -> dict:
    """The grid llama.cpp's own Q4_0/Q5_0 compute: symmetric about zero, the extra level on the larger side."""
    return {"bits": bits, "symmetric": False, "observer": "full_range", "group_size": BLOCK, "scale_dtype": "float16"}


def _k_target(bits: int, scale_bits: int) -> dict:
    """Q6_K's and Q3_K's grid: ``full_range`` in groups of 16 (as llama.cpp's own quantizer,
    which maps each group's largest magnitude to the negative end), their scales on the
    super-block's two levels."""
    return {**_target(bits), "group_size": 16, "super_group": K_BLOCK, "scale_bits": scale_bits}


BLOCK_TYPES: dict[str, BlockType] = {
    "Q8_0": BlockType(
        "Q8_0",
        (-128, 127),
        pack_q8_0,
        {"bits": 8, "symmetric": True, "group_size": BLOCK, "scale_dtype": "float16"},
        8,
        34,
    ),
    "Q6_K": BlockType("Q6_K", (-32, 31), pack_q6_k, _k_target(6, 7), 6, 210, 16, K_BLOCK, 127),
    "Q5_0": BlockType("Q5_0", (-16, 15), pack_q5_0, _target(5), 5, 22),
    "Q4_0": BlockType("Q4_0", (-8, 7), pack_q4_0, _target(4), 4, 18),
    "Q3_K": BlockType("Q3_K", (-4, 3), pack_q3_k, _k_target(3, 5), 3, 110, 16, K_BLOCK, 31),
}
FLOAT_TYPES = ("F32", "F16", "BF16")  # what stays float: norms, embeddings and unquantized layers
