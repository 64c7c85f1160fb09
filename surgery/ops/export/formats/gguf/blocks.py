"""GGUF's block types as surgery's grids: which grid each holds exactly, and the packing of a
weight's integers and scales into that type's bytes (llama.cpp's ``ggml-common.h`` layouts,
checked against gguf-py's dequantizers).

A block runs along a weight's inputs (a row of ``weight.reshape(out, -1)``), as surgery's groups
do. The legacy types keep one fp16 scale ``d`` per 32 inputs:

- ``Q8_0``: ``d * q``, ``q`` in [-128, 127] (int8);
- ``Q4_0``: ``d * (n - 8)``, ``n`` a nibble; ``Q5_0``: ``d * (n - 16)``, ``n`` five bits;
- ``Q4_1``, ``Q5_1``: ``d * n + m``, ``m`` an fp16 minimum.

The K-quants group 16 or 32 inputs under super-blocks of 256, each group's scale an integer
times the super-block's fp16 ``d``: ``Q6_K`` ``d * sc * (n - 32)`` (``sc`` int8, groups of 16),
``Q3_K`` ``d * sc * (n - 4)`` (``sc`` six bits and a sign), ``Q4_K``/``Q5_K`` ``d * sc * n - dmin
* mn`` (``sc``, ``mn`` six bits, groups of 32).

Surgery's integer grid computes ``scale * (q - zero point)``. A ``_0`` or ``Q3_K``/``Q6_K``
block holds it exactly when the groups match, the scales are the type's (fp16, or integers times
an fp16 ``d``: ``quantize(target="gguf:...")`` computes on them) and every ``q - zero point``
fits the type's signed range, or its negation does, stored under a negated scale (llama.cpp's
own Q4_0 stores ``d`` negative when the block's positive side is larger): ``observer=
"full_range"`` and symmetric grids. The ``_1`` types and ``Q4_K``/``Q5_K`` hold surgery's
float-offset grids (``float_offset=True``: ``scale * q - offset``, the offset ``-m``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from surgery.ops.numerics.deployment import WeightGrid

BLOCK = 32  # inputs per block of the legacy types
K_BLOCK = 256  # inputs per super-block of the K-quants


class Blocks(NamedTuple):
    """One weight's rows as a type stores them: ``values`` (rows, blocks, inputs a block) the
    stored integers' meaning (signed ``q - zero point``, or the unsigned ``q`` of a float-offset
    grid), ``d`` (rows, blocks) fp16, ``sub`` (rows, blocks, groups) the K-quants' integer
    scales; with a float offset, ``m`` (rows, blocks) fp16 (the legacy types' minimum ``-offset``,
    the K-quants' ``dmin``) and the K-quants' integer ``mins``."""

    values: np.ndarray
    d: np.ndarray
    sub: np.ndarray | None = None
    m: np.ndarray | None = None
    mins: np.ndarray | None = None


@dataclass(frozen=True)
class BlockType:
    """One GGUF tensor type surgery writes from a grid: ``stored`` is the range of what it
    stores per input (``q - zero point``, or ``q`` for ``float_offset`` types) in groups of
    ``group`` inputs; the legacy types keep each group's scale as an fp16 ``d``, the K-quants
    (``scale_levels`` set) every ``super_block`` inputs' as one fp16 ``d`` times an integer of
    magnitude at most ``scale_levels`` per group (and so the offsets, under ``dmin``).
    ``pack(blocks)`` gives the rows' bytes; ``target`` the GridSpec fields that make
    :func:`surgery.quantize` compute on this type's grid."""

    name: str
    stored: tuple[int, int]
    pack: Callable[[Blocks], np.ndarray]
    target: dict = field(default_factory=dict)
    bits: int = 8
    block_bytes: int = 34  # bytes of one block of super_block inputs
    group: int = BLOCK
    super_block: int = BLOCK
    scale_levels: int | None = None
    float_offset: bool = False

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
        if spec.float_offset != self.float_offset:
            return "a float offset per group (float_offset=true)" if self.float_offset else "integer zero points"
        why = self._range_problem(grid)
        if why is not None:
            return why
        hint = f"(quantize with target='gguf:{self.name}')"
        scale, offset = grid.scale.float(), grid.zero_point.float()
        if self.scale_levels is None:
            exact = torch.equal(scale.half().float(), scale) and torch.equal(offset.half().float(), offset)
            return None if exact else f"fp16 scales{' and offsets' if self.float_offset else ''} {hint}"
        rows = scale.shape[0]
        parts = [(scale, 1)] + ([(offset, 0)] if self.float_offset else [])
        for part, least in parts:
            d, levels = self._two_level(part.reshape(rows, -1))
            exact = torch.equal(d.half().double(), d) and torch.equal(levels, levels.round())
            if not exact or levels.min() < least or levels.max() > self.scale_levels:
                what = "scale" if least else "offset"
                return (
                    f"each group's {what} an integer in [{least}, {self.scale_levels}] times one fp16 "
                    f"{what} per {self.super_block} inputs {hint}"
                )
        return None

    def _range_problem(self, grid: WeightGrid) -> str | None:
        """Why the grid's integers do not fit what the type stores, or None."""
        low, high = grid.spec.quant_range
        if self.float_offset:
            fits = self.stored[0] <= low and high <= self.stored[1]
            return None if fits else f"integers within [{self.stored[0]}, {self.stored[1]}] (bits={grid.spec.bits})"
        fits, _ = self._orientation(grid.zero_point.to(torch.int32), low, high)
        if fits is None:
            return f"signed integers within [{self.stored[0]}, {self.stored[1]}] (bits={grid.spec.bits})"
        return None

    def _orientation(self, zero: Tensor, low: int, high: int) -> tuple[Tensor | None, Tensor]:
        """Each group's sign (1, or -1 where only the negated integers fit), or None where neither fits."""
        lowest, highest = low - zero, high - zero  # each group's signed range q - zero point
        fits = (lowest >= self.stored[0]) & (highest <= self.stored[1])
        flipped = (-highest >= self.stored[0]) & (-lowest <= self.stored[1])
        return (None if not bool((fits | flipped).all()) else fits), torch.where(fits, 1, -1)

    def _two_level(self, part: Tensor) -> tuple[Tensor, Tensor]:
        """(rows, groups) scales (or offsets) as (rows, blocks, 1) super-block scales ``d`` (float64:
        the largest group is at the top level, as the simulation puts it) and (rows, blocks,
        groups) multiples of ``d``: integers where the grid is two-level (0 where ``d`` is)."""
        blocks = part.double().reshape(part.shape[0], -1, self.super_block // self.group)
        d = blocks.amax(-1, keepdim=True) / self.scale_levels
        return d, torch.where(d > 0, blocks / d.clamp_min(torch.finfo(torch.float64).tiny), 0.0)

    def encode(self, grid: WeightGrid, integers: Tensor) -> np.ndarray:
        """The (rows, bytes per row) uint8 data of a weight's (rows, columns) ``integers`` on ``grid``
        (checked by :meth:`holds`)."""
        rows, _ = integers.shape
        scale = grid.scale.float().cpu().reshape(rows, -1)
        grouped = integers.cpu().reshape(rows, -1, self.group).to(torch.int32)
        if self.float_offset:
            sign = torch.ones_like(scale, dtype=torch.int32)
        else:
            zero = grid.zero_point.to(torch.int32).cpu().reshape(rows, -1)
            _, sign = self._orientation(zero, *grid.spec.quant_range)
            grouped = (grouped - zero[..., None]) * sign[..., None]  # a negated group under a negated scale
        values = grouped.reshape(rows, -1, self.super_block).numpy()
        offset = grid.zero_point.float().cpu().reshape(rows, -1)
        if self.scale_levels is None:
            m = (-offset).half().numpy() if self.float_offset else None
            return self.pack(Blocks(values, (scale * sign).half().numpy(), m=m))
        d, levels = self._two_level(scale)
        sub = (levels.round().to(torch.int32) * sign.reshape(levels.shape)).numpy()
        if not self.float_offset:
            return self.pack(Blocks(values, d[..., 0].half().numpy(), sub))
        dmin, mins = self._two_level(offset)
        m = dmin[..., 0].half().numpy()
        return self.pack(Blocks(values, d[..., 0].half().numpy(), sub, m, mins.round().to(torch.int32).numpy()))


def _half_bytes(d: np.ndarray) -> np.ndarray:
    """(rows, blocks) fp16 as (rows, blocks, 2) little-endian bytes."""
    return d.astype("<f2").view(np.uint8).reshape(*d.shape, 2)


def _nibbles(low: np.ndarray) -> np.ndarray:
    """(rows, blocks, 32) values in [0, 15] as 16 bytes a block: byte j holds value j in its low
    nibble and value j + 16 in its high one."""
    return (low[..., :16] | (low[..., 16:] << 4)).astype(np.uint8)


def _fifth_bits(stored: np.ndarray) -> np.ndarray:
    """(rows, blocks, 32) values' fifth bits as a little-endian uint32 a block (value i at bit i)."""
    rows, blocks, _ = stored.shape
    high = ((stored.astype(np.uint32) >> 4) & 1) << np.arange(BLOCK, dtype=np.uint32)
    return high.sum(axis=-1, dtype=np.uint32).astype("<u4").view(np.uint8).reshape(rows, blocks, 4)


def _bit_fields(values: np.ndarray, width: int) -> np.ndarray:
    """(..., k, n) values of ``width`` bits as (..., n) bytes: value ``i`` of the k at bit ``i * width``."""
    shifts = (np.arange(values.shape[-2], dtype=np.uint8) * width)[:, None]
    return np.bitwise_or.reduce((values.astype(np.uint8) << shifts).astype(np.uint8), axis=-2)


def _rows(parts: list[np.ndarray]) -> np.ndarray:
    """The per-block byte parts, concatenated, as (rows, bytes a row)."""
    data = np.concatenate(parts, axis=-1)
    return data.reshape(data.shape[0], -1)


def pack_q8_0(b: Blocks) -> np.ndarray:
    """``d``, then 32 int8."""
    return _rows([_half_bytes(b.d), b.values.astype(np.int8).view(np.uint8)])


def pack_q4_0(b: Blocks) -> np.ndarray:
    """``d``, then 16 bytes of nibbles ``q + 8``."""
    return _rows([_half_bytes(b.d), _nibbles((b.values + 8).astype(np.uint8))])


def pack_q5_0(b: Blocks) -> np.ndarray:
    """``d``, a little-endian uint32 of every value's fifth bit, then the low nibbles of ``q + 16``."""
    stored = (b.values + 16).astype(np.uint8)
    return _rows([_half_bytes(b.d), _fifth_bits(stored), _nibbles(stored & 15)])


def pack_q4_1(b: Blocks) -> np.ndarray:
    """``d``, ``m``, then 16 bytes of nibbles ``q``."""
    return _rows([_half_bytes(b.d), _half_bytes(b.m), _nibbles(b.values.astype(np.uint8))])


def pack_q5_1(b: Blocks) -> np.ndarray:
    """``d``, ``m``, a little-endian uint32 of every value's fifth bit, then the low nibbles of ``q``."""
    stored = b.values.astype(np.uint8)
    return _rows([_half_bytes(b.d), _half_bytes(b.m), _fifth_bits(stored), _nibbles(stored & 15)])


def pack_q6_k(b: Blocks) -> np.ndarray:
    """Per 256 inputs: the low nibbles of ``q + 32`` (each half's 128 values as 64 bytes, value
    ``j`` low and ``j + 64`` high), their top two bits (each half's as 32 bytes, values ``j``,
    ``j + 32``, ``j + 64``, ``j + 96`` from the lowest bits up), 16 int8 sub-scales, ``d``."""
    rows, blocks, _ = b.values.shape
    halves = (b.values + 32).astype(np.uint8).reshape(rows, blocks, 2, 128)
    low = _bit_fields((halves & 15).reshape(rows, blocks, 2, 2, 64), 4).reshape(rows, blocks, 128)
    high = _bit_fields((halves >> 4).reshape(rows, blocks, 2, 4, 32), 2).reshape(rows, blocks, 64)
    return _rows([low, high, b.sub.astype(np.int8).view(np.uint8), _half_bytes(b.d)])


def pack_q3_k(b: Blocks) -> np.ndarray:
    """Per 256 inputs: the third bit of ``q + 4`` (32 bytes, values ``j + 32 k`` at bit ``k``), its
    low two bits (each half's 128 values as 32 bytes, ``j + 32 k`` at bits ``2 k``), the 16
    sub-scales ``+ 32`` in six bits (low nibbles of ``j`` and ``j + 8`` in 8 bytes, top two bits of
    ``j + 4 k`` in 4), ``d``."""
    rows, blocks, _ = b.values.shape
    stored = (b.values + 4).astype(np.uint8)
    third = _bit_fields((stored >> 2).reshape(rows, blocks, 8, 32), 1)
    low = _bit_fields((stored & 3).reshape(rows, blocks, 2, 4, 32), 2).reshape(rows, blocks, 64)
    scales = (b.sub + 32).astype(np.uint8)
    nibbles = _bit_fields((scales & 15).reshape(rows, blocks, 2, 8), 4)
    tops = _bit_fields((scales >> 4).reshape(rows, blocks, 4, 4), 2)
    return _rows([third, low, nibbles, tops, _half_bytes(b.d)])


def _k_scales(sub: np.ndarray, mins: np.ndarray) -> np.ndarray:
    """Q4_K's and Q5_K's 12 bytes of eight 6-bit scales and mins: the first four of each in the
    low six bits of bytes 0-3 (scales) and 4-7 (mins), the last four's low nibbles in bytes 8-11
    (scale low, min high) and their top two bits in the top bits of bytes 0-7."""
    sub, mins = sub.astype(np.uint8), mins.astype(np.uint8)
    scales = (sub[..., :4] & 63) | ((sub[..., 4:] >> 4) << 6)
    lows = (mins[..., :4] & 63) | ((mins[..., 4:] >> 4) << 6)
    rest = (sub[..., 4:] & 15) | ((mins[..., 4:] & 15) << 4)
    return np.concatenate([scales, lows, rest], axis=-1).astype(np.uint8)


def _k_nibbles(stored: np.ndarray) -> np.ndarray:
    """(rows, blocks, 256) values' low nibbles as 128 bytes: value ``64 c + j`` low, ``64 c + 32 + j`` high."""
    rows, blocks, _ = stored.shape
    return _bit_fields((stored & 15).reshape(rows, blocks, 4, 2, 32), 4).reshape(rows, blocks, 128)


def pack_q4_k(b: Blocks) -> np.ndarray:
    """Per 256 inputs: ``d``, ``dmin``, the scales and mins (:func:`_k_scales`), the nibbles ``q``."""
    stored = b.values.astype(np.uint8)
    return _rows([_half_bytes(b.d), _half_bytes(b.m), _k_scales(b.sub, b.mins), _k_nibbles(stored)])


def pack_q5_k(b: Blocks) -> np.ndarray:
    """Per 256 inputs: ``d``, ``dmin``, the scales and mins, every value's fifth bit (32 bytes,
    values ``j + 32 k`` at bit ``k``), the low nibbles of ``q``."""
    rows, blocks, _ = b.values.shape
    stored = b.values.astype(np.uint8)
    fifth = _bit_fields((stored >> 4).reshape(rows, blocks, 8, 32), 1)
    parts = [_half_bytes(b.d), _half_bytes(b.m), _k_scales(b.sub, b.mins), fifth, _k_nibbles(stored)]
    return _rows(parts)


def _target(bits: int) -> dict:
    """The grid llama.cpp's own Q4_0/Q5_0 compute: symmetric about zero, the extra level on the larger side."""
    return {"bits": bits, "symmetric": False, "observer": "full_range", "group_size": BLOCK, "scale_dtype": "float16"}


def _offset_target(bits: int) -> dict:
    """Q4_1's and Q5_1's grid: each group's range from its minimum to its maximum, the minimum a float."""
    return {"bits": bits, "symmetric": False, "float_offset": True, "group_size": BLOCK, "scale_dtype": "float16"}


def _k_target(bits: int, scale_bits: int, group: int, base: dict) -> dict:
    """A K-quant's grid: ``base``'s in groups of ``group`` whose scales (and offsets) sit on the
    super-block's two levels."""
    return {**base, "group_size": group, "super_group": K_BLOCK, "scale_bits": scale_bits}


BLOCK_TYPES: dict[str, BlockType] = {
    "Q8_0": BlockType(
        "Q8_0",
        (-128, 127),
        pack_q8_0,
        {"bits": 8, "symmetric": True, "group_size": BLOCK, "scale_dtype": "float16"},
        8,
        34,
    ),
    "Q6_K": BlockType("Q6_K", (-32, 31), pack_q6_k, _k_target(6, 7, 16, _target(6)), 6, 210, 16, K_BLOCK, 127),
    "Q5_1": BlockType("Q5_1", (0, 31), pack_q5_1, _offset_target(5), 5, 24, float_offset=True),
    "Q5_0": BlockType("Q5_0", (-16, 15), pack_q5_0, _target(5), 5, 22),
    "Q5_K": BlockType(
        "Q5_K", (0, 31), pack_q5_k, _k_target(5, 6, 32, _offset_target(5)), 5, 176, 32, K_BLOCK, 63, True
    ),
    "Q4_1": BlockType("Q4_1", (0, 15), pack_q4_1, _offset_target(4), 4, 20, float_offset=True),
    "Q4_0": BlockType("Q4_0", (-8, 7), pack_q4_0, _target(4), 4, 18),
    "Q4_K": BlockType(
        "Q4_K", (0, 15), pack_q4_k, _k_target(4, 6, 32, _offset_target(4)), 4, 144, 32, K_BLOCK, 63, True
    ),
    "Q3_K": BlockType("Q3_K", (-4, 3), pack_q3_k, _k_target(3, 5, 16, _target(3)), 3, 110, 16, K_BLOCK, 31),
}
# what stays float (norms, embeddings, unquantized layers): each torch dtype's GGUF type, and its bytes
FLOAT_TYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}
FLOAT_BYTES = {"F32": 4, "F16": 2, "BF16": 2}


def tensor_bytes(kind: BlockType | str, shape: tuple[int, ...]) -> tuple[int, tuple[int, ...]]:
    """The bytes a tensor of ``shape`` takes as ``kind`` (a block type, or a float type's name),
    and its shape in bytes (rows of packed blocks, or of a float's bytes): from the one table,
    :data:`BLOCK_TYPES` (its sizes held equal to gguf-py's ``GGML_QUANT_SIZES`` by a test)."""
    row = shape[-1] * FLOAT_BYTES[kind] if isinstance(kind, str) else shape[-1] // kind.super_block * kind.block_bytes
    return math.prod(shape[:-1]) * row, (*shape[:-1], row)
