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


@dataclass(frozen=True)
class BlockType:
    """One GGUF tensor type surgery writes from a grid: ``signed`` is the range of the stored
    integer (``value = d * (stored - offset)``); ``pack(values, d)`` gives a row's bytes from its
    (rows, blocks, 32) signed integers and (rows, blocks) fp16 ``d``; ``target`` the GridSpec
    fields that make :func:`surgery.quantize` compute on this type's grid."""

    name: str
    signed: tuple[int, int]
    pack: Callable[[np.ndarray, np.ndarray], np.ndarray]
    target: dict = field(default_factory=dict)
    bits: int = 8
    block_bytes: int = 34  # bytes of a block of 32: the fp16 scale and the packed integers

    def holds(self, grid: WeightGrid, columns: int) -> str | None:
        """Why ``grid`` (of a weight with ``columns`` inputs) cannot be written as this type, or None."""
        spec = grid.spec
        if spec.is_float or grid.g_idx is not None:
            return "an integer grid of consecutive groups" if grid.g_idx is None else "groups of consecutive inputs"
        if spec.group_size != BLOCK or columns % BLOCK:
            return f"groups of {BLOCK} inputs that tile each row (group_size={spec.group_size}, {columns} inputs)"
        scale = grid.scale.float()
        if not torch.equal(scale.half().float(), scale):
            return "fp16 scales (quantize with target='gguf:...' or scale_dtype='float16')"
        low, high = spec.quant_range
        zero = grid.zero_point.to(torch.int32)
        lowest, highest = low - zero, high - zero  # each group's signed range q - zero point
        fits = (lowest >= self.signed[0]) & (highest <= self.signed[1])
        flipped = (-highest >= self.signed[0]) & (-lowest <= self.signed[1])
        if not bool((fits | flipped).all()):
            return f"signed integers within [{self.signed[0]}, {self.signed[1]}] (bits={spec.bits})"
        return None

    def encode(self, grid: WeightGrid, integers: Tensor) -> np.ndarray:
        """The (rows, bytes per row) uint8 data of a weight's (rows, columns) ``integers`` on ``grid``
        (checked by :meth:`holds`)."""
        rows, columns = integers.shape
        zero = grid.zero_point.to(torch.int32).cpu().reshape(rows, -1)
        scale = grid.scale.float().cpu().reshape(rows, -1)
        signed = (integers.cpu().reshape(rows, -1, BLOCK) - zero[..., None]).to(torch.int32)
        low, high = grid.spec.quant_range
        fits = ((low - zero) >= self.signed[0]) & ((high - zero) <= self.signed[1])
        signed = torch.where(fits[..., None], signed, -signed)  # the negated block under d = -scale
        d = torch.where(fits, scale, -scale).half()
        return self.pack(signed.numpy(), d.numpy())


def _d_bytes(d: np.ndarray) -> np.ndarray:
    """(rows, blocks) fp16 as (rows, blocks, 2) little-endian bytes."""
    return d.astype("<f2").view(np.uint8).reshape(*d.shape, 2)


def _nibbles(low: np.ndarray) -> np.ndarray:
    """(rows, blocks, 32) values in [0, 15] as 16 bytes a block: byte j holds value j in its low
    nibble and value j + 16 in its high one."""
    return (low[..., :16] | (low[..., 16:] << 4)).astype(np.uint8)


def pack_q8_0(signed: np.ndarray, d: np.ndarray) -> np.ndarray:
    """``d``, then 32 int8."""
    rows, blocks, _ = signed.shape
    data = np.concatenate([_d_bytes(d), signed.astype(np.int8).view(np.uint8)], axis=-1)
    return data.reshape(rows, blocks * 34)


def pack_q4_0(signed: np.ndarray, d: np.ndarray) -> np.ndarray:
    """``d``, then 16 bytes of nibbles ``q + 8``."""
    rows, blocks, _ = signed.shape
    data = np.concatenate([_d_bytes(d), _nibbles((signed + 8).astype(np.uint8))], axis=-1)
    return data.reshape(rows, blocks * 18)


def pack_q5_0(signed: np.ndarray, d: np.ndarray) -> np.ndarray:
    """``d``, a little-endian uint32 of every value's fifth bit, then the low nibbles of ``q + 16``."""
    rows, blocks, _ = signed.shape
    stored = (signed + 16).astype(np.uint32)
    high = ((stored >> 4) & 1) << np.arange(BLOCK, dtype=np.uint32)
    fifth = high.sum(axis=-1, dtype=np.uint32).astype("<u4").view(np.uint8).reshape(rows, blocks, 4)
    data = np.concatenate([_d_bytes(d), fifth, _nibbles((stored & 15).astype(np.uint8))], axis=-1)
    return data.reshape(rows, blocks * 22)


def _target(bits: int) -> dict:
    """The grid llama.cpp's own Q4_0/Q5_0 compute: symmetric about zero, the extra level on the larger side."""
    return {"bits": bits, "symmetric": False, "observer": "full_range", "group_size": BLOCK, "scale_dtype": "float16"}


BLOCK_TYPES: dict[str, BlockType] = {
    "Q8_0": BlockType(
        "Q8_0",
        (-128, 127),
        pack_q8_0,
        {"bits": 8, "symmetric": True, "group_size": BLOCK, "scale_dtype": "float16"},
        8,
        34,
    ),
    "Q5_0": BlockType("Q5_0", (-16, 15), pack_q5_0, _target(5), 5, 22),
    "Q4_0": BlockType("Q4_0", (-8, 7), pack_q4_0, _target(4), 4, 18),
}
FLOAT_TYPES = ("F32", "F16", "BF16")  # what stays float: norms, embeddings and unquantized layers
