"""4-bit Linear weights in ONNX Runtime's ``MatMulNBits`` (``com.microsoft``): the MatMul of a
layer quantized to 4 bits in groups becomes one MatMulNBits node holding surgery's integers
(two a byte, low nibble first, along the inputs), its scales and, for an affine grid, its zero
points; ONNX Runtime multiplies with its block-quantized kernels (MLAS), dequantizing
``(q - zero point) x scale`` block by block.

Held: 4-bit weights of a Linear traced as ``MatMul``, symmetric (stored ``q + 8``, the op's
default zero point) or affine, in groups of 16, 32, 64, 128 or 256 inputs (the op's block sizes);
the layer's inputs stay float (the op takes float activations)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch import Tensor

from surgery.ops.numerics.deployment import WeightGrid

BITS = 4
BLOCK_SIZES = (16, 32, 64, 128, 256)
DOMAIN = "com.microsoft"


def nbits_problem(grid: WeightGrid) -> str | None:
    """What keeps ``grid`` out of MatMulNBits, or None."""
    spec = grid.spec
    if spec.is_float or spec.bits != BITS:
        return f"{BITS}-bit integer weights"
    if spec.group_size not in BLOCK_SIZES:
        return f"groups of {', '.join(map(str, BLOCK_SIZES))} inputs (group_size={spec.group_size})"
    return None


def pack_nibbles(values: np.ndarray) -> np.ndarray:
    """(..., 2m) values in [0, 15] as (..., m) bytes, the first of each pair in the low nibble."""
    return (values[..., 0::2] | (values[..., 1::2] << 4)).astype(np.uint8)


def gemm_problem(node: Any) -> str | None:
    """Why a traced ``node`` cannot become MatMulNBits, or None: a MatMul, or a Gemm computing
    ``x @ W^T + b`` (``transB=1``, no other attribute but unit ``alpha``/``beta``)."""
    if node.op_type == "MatMul":
        return None
    if node.op_type != "Gemm":
        return f"is traced as {node.op_type}; MatMulNBits replaces a MatMul or Gemm"
    attributes = {a.name: (a.f if a.type == a.FLOAT else a.i) for a in node.attribute}
    if attributes.get("transA", 0) or not attributes.get("transB", 0) or attributes.get("alpha", 1.0) != 1.0:
        return "is traced as a Gemm other than x @ W^T + b"
    if attributes.get("beta", 1.0) != 1.0:
        return "is traced as a Gemm with a scaled bias"
    return None


def matmul_nbits(node: Any, grid: WeightGrid, integers: Tensor, constant: Any) -> None:
    """Rewrite the MatMul or Gemm ``node`` (``x @ W^T``, a Gemm's bias kept as the op's bias) into
    MatMulNBits holding ``integers`` ((outputs, inputs) on ``grid``); ``constant(base, array)``
    adds an initializer, giving its name."""
    from onnx import helper

    rows, columns = integers.shape
    block = grid.spec.group_size
    blocks = math.ceil(columns / block)
    integers = integers.cpu()
    zero = grid.zero_point.to(torch.int32).cpu().reshape(rows, blocks)
    symmetric = grid.spec.symmetric
    stored = (integers + 8) if symmetric else integers  # symmetric: the op's default zero point 8
    pad = blocks * block - columns  # a last, shorter group: padded with its zero point (dequantized 0)
    if pad:
        filler = torch.full((rows, pad), 8, dtype=torch.int32) if symmetric else zero[:, -1:].expand(rows, pad)
        stored = torch.cat([stored, filler], dim=1)
    data = pack_nibbles(stored.to(torch.uint8).numpy().reshape(rows, blocks, block))
    scales = grid.scale.float().cpu().reshape(rows * blocks).numpy()
    inputs = [node.input[0], constant(f"{node.input[1]}_nbits", data), constant(f"{node.input[1]}_scales", scales)]
    if not symmetric:
        zeros = zero.numpy().astype(np.uint8)
        if blocks % 2:
            zeros = np.concatenate([zeros, np.zeros((rows, 1), np.uint8)], axis=1)
        inputs.append(constant(f"{node.input[1]}_zero_points", pack_nibbles(zeros).reshape(-1)))
    if node.op_type == "Gemm" and len(node.input) > 2 and node.input[2]:
        inputs += [""] * (5 - len(inputs)) + [node.input[2]]  # zero points and g_idx left out, then the bias
    replacement = helper.make_node(
        "MatMulNBits",
        inputs,
        list(node.output),
        domain=DOMAIN,
        K=columns,
        N=rows,
        bits=BITS,
        block_size=block,
        accuracy_level=0,  # float32 arithmetic on the dequantized blocks
    )
    node.CopyFrom(replacement)


def uses_domain(model: Any) -> None:
    """Declare ``com.microsoft`` among the model's opsets (once)."""
    from onnx import helper

    if not any(entry.domain == DOMAIN for entry in model.opset_import):
        model.opset_import.append(helper.make_opsetid(DOMAIN, 1))
