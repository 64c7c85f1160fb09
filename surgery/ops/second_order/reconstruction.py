"""Second-order weight reconstruction of one layer: SparseGPT (pruning) and GPTQ (quantization).

Both see a layer as a matrix ``W`` (outputs × input columns) with the Hessian ``H = 2XᵀX`` of
its calibration inputs (:mod:`surgery.ops.second_order.hessians`), walk the columns left to right and,
after removing or rounding each one, spread its error over the columns not yet processed
through the inverse Hessian (optimal brain surgeon; Frantar & Alistarh 2022, Frantar et al.
2023), in blocks of ``block`` columns. They are plain functions on tensors; ``prune`` and
``quantize`` attach their results as guarded, restorable transforms.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from surgery.core.errors import ConfigError
from surgery.ops.numerics.observers import relative_importance

QParams = tuple[Tensor, Tensor]  # (scale, zero point), one per row
GPTAQ_ALPHA = 0.25  # the weight of the float model's outputs in GPTAQ's update, as the authors' code


def inverse_factor(hessian: Tensor, damping: float, name: str) -> Tensor:
    """The upper Cholesky factor of ``(H + λI)⁻¹``, λ = ``damping`` × mean diagonal; columns no
    calibration input reached (zero diagonal) get a unit diagonal. The damping grows tenfold
    (up to three times) if ``H`` is not positive definite."""
    dead = torch.diagonal(hessian) == 0
    mean = None
    for attempt in range(4):
        h = hessian.float().clone()  # float32, as the reference code: float64 factors move GPTQ's walk off theirs
        h[dead, dead] = 1.0
        if mean is None:  # the damping's base: the mean diagonal, dead columns counted as 1 (the reference code)
            mean = torch.diagonal(h).mean()
        torch.diagonal(h).add_(damping * 10**attempt * mean)  # in place, as the reference code: no n-by-n identity
        factor, info = torch.linalg.cholesky_ex(h)
        del h  # at most two n-by-n matrices beside the caller's at any time (a 5632-wide Hessian is 127 MB)
        if int(info) == 0:
            inverse = torch.cholesky_inverse(factor)
            del factor
            upper, info = torch.linalg.cholesky_ex(inverse, upper=True)
            if int(info) == 0:
                return upper
    raise ConfigError(
        "calibration",
        name,
        "its input Hessian is not positive definite even with 1000x damping "
        "(too few or degenerate calibration batches); give more batches or exclude the layer",
    )


def _outer(error: Tensor, row: Tensor, scratch: Tensor) -> Tensor:
    """``error ⊗ row`` by matmul, as the reference code (the same bits as a broadcast, 3x
    faster), into ``scratch``: one allocation a walk instead of one a column."""
    out = scratch[: error.numel() * row.numel()].view(error.numel(), row.numel())
    return torch.matmul(error.unsqueeze(1), row.unsqueeze(0), out=out)


def sparsegpt(
    weight: Tensor,
    hessian: Tensor,
    amount: float,
    *,
    pattern: tuple[int, int] | None = None,
    block: int = 128,
    damping: float = 0.01,
    name: str = "",
) -> tuple[Tensor, Tensor]:
    """Prune ``amount`` of a (outputs, columns) matrix, updating the weights kept.

    Within each block, the entries with the smallest ``w² / [H⁻¹]²_jj`` are pruned (exactly
    ``round(amount × numel)`` over the matrix), or with ``pattern=(N, M)`` the ``M − N``
    smallest of every M consecutive columns of each row. Returns ``(new matrix, keep-mask)``;
    pruned entries are exactly zero.
    """
    rows, cols = weight.shape
    w = weight.detach().float().clone(memory_format=torch.contiguous_format)
    factor = inverse_factor(hessian, damping, name)
    keep = torch.ones_like(w, dtype=torch.bool)
    if pattern is not None:
        block = max(pattern[1], block // pattern[1] * pattern[1])  # N:M groups never straddle blocks
    scratch = torch.empty(rows * block, device=w.device)  # each column's update, written in place
    for start in range(0, cols, block):
        end = min(start + block, cols)
        part, errors = w[:, start:end].clone(), torch.zeros(rows, end - start, device=w.device)
        local = factor[start:end, start:end]
        diagonal = torch.diagonal(local)
        pruned = torch.zeros_like(part, dtype=torch.bool)
        if pattern is None:
            count = round(amount * rows * end) - round(amount * rows * start)  # exact total over the matrix
            if count > 0:
                scores = (part**2 / diagonal**2).flatten()
                pruned.view(-1)[torch.topk(scores, count, largest=False).indices] = True
        for i in range(end - start):
            if pattern is not None and i % pattern[1] == 0:
                scores = part[:, i : i + pattern[1]] ** 2 / diagonal[i : i + pattern[1]] ** 2
                drop = torch.topk(scores, pattern[1] - pattern[0], dim=1, largest=False).indices
                pruned.scatter_(1, i + drop, True)
            column = part[:, i]
            kept = torch.where(pruned[:, i], torch.zeros_like(column), column)
            error = (column - kept) / diagonal[i]
            part[:, i:] -= _outer(error, local[i, i:], scratch)
            part[:, i] = kept
            errors[:, i] = error
        w[:, start:end] = part
        keep[:, start:end] = ~pruned
        w[:, end:] -= errors @ factor[start:end, end:]
    return w, keep


def gptq(
    weight: Tensor,
    hessian: Tensor,
    qparams_of: Callable[[Tensor, Tensor], QParams],
    fake_quantize: Callable[[Tensor, Tensor, Tensor], Tensor],
    *,
    group_size: int | None = None,
    keep: Tensor | None = None,
    block: int = 128,
    damping: float = 0.01,
    name: str = "",
    actorder: str | None = None,
    asymmetry: Tensor | None = None,
    groups: QParams | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """Quantize a (outputs, columns) matrix column by column, compensating each column's
    rounding error in the columns after it.

    ``qparams_of(columns, importance)`` gives the scale and zero point of a (outputs, k) slice (per
    row, or one for the tensor), ``importance`` its columns' Hessian diagonal over the mean
    (their inputs' relative energy, which ``imatrix_mse`` weighs the rounding error by); ``fake_quantize(column, scale, zero_point)`` rounds one column onto
    that grid. With ``group_size``, every ``group_size`` consecutive columns get their own
    scales, computed when the walk reaches the group's first column from the group's values as
    they stood at the start of the current block (the columns the walk updated inside the block
    are not used), as the original GPTQ code does (llm-compressor 0.14 takes every group's scales
    before the walk, as ``actorder="weight"`` does here). Returns
    ``(quantized matrix, scales, zero points, g_idx)``: scales ``(outputs, groups)`` with groups, else
    whatever ``qparams_of`` returned for the whole matrix; ``g_idx`` (int32, the group of
    every column) with ``actorder="group"`` and groups, else None (contiguous groups). With ``keep`` (a pruning mask), pruned
    entries stay exactly zero and their share of the error goes to the entries kept.

    ``actorder="weight"`` walks the columns in order of decreasing Hessian diagonal (the inputs
    with the most energy first) while each keeps the grid of its own group in the original
    order, every group's scales taken from the weights before the walk: llm-compressor's
    ``actorder="weight"`` (its default, ``"static"``), which stores nothing extra.
    ``actorder="group"`` walks the same order but forms the groups in it, every ``group_size``
    consecutive columns of the walk, each group's scales taken when the walk reaches it (the
    GPTQ authors' ``fasterquant(actorder=True, groupsize=g)``); column ``j`` is then in group
    ``g_idx[j]`` = its position in the walk // ``group_size``.

    ``asymmetry`` (GPTAQ, Li et al. 2025): ``2 (X̃ − X)ᵀX / rows``, with ``X̃`` the layer's inputs
    in the model before compression and ``X`` (the Hessian's) its inputs here; each column's
    update then also moves the later columns by ``w Pᵢ`` with ``P = α triu₁(ΔXᵀX Uᵀ) U``
    as the authors' code computes it (``α = 0.25``, ``U`` the inverse Hessian's upper factor), so
    the layer reproduces the float model's outputs, not only its own.

    ``groups``: every group's (outputs, groups) scales and zero points, fixed before the walk
    (two-level grids, whose groups' scales share one super group scale).
    """
    rows, cols = weight.shape
    w = weight.detach().float().clone(memory_format=torch.contiguous_format)
    energy = relative_importance(torch.diagonal(hessian))
    fixed = groups
    if fixed is None and actorder == "weight" and group_size:
        fixed = _static_groups(w, energy, qparams_of, group_size)
    order = torch.argsort(torch.diagonal(hessian), descending=True) if actorder in ("weight", "group") else None
    if order is not None:
        w, hessian, energy = w[:, order].contiguous(), hessian[order][:, order], energy[order]
        keep = None if keep is None else keep[:, order]
        asymmetry = None if asymmetry is None else asymmetry[order][:, order]
    scratch = torch.empty(rows * block, device=w.device)  # each column's update, written in place
    factor = inverse_factor(hessian, damping, name)
    shift = None if asymmetry is None else _asymmetric_shift(asymmetry, hessian, factor)
    scale, zero_point = (None, None) if group_size else qparams_of(w, energy)
    scales, zero_points = [], []
    original_columns = list(range(cols)) if order is None else order.tolist()  # read once: no sync per column
    for start in range(0, cols, block):
        end = min(start + block, cols)
        part, errors = w[:, start:end].clone(), torch.zeros(rows, end - start, device=w.device)
        local = factor[start:end, start:end]
        for i in range(end - start):
            column_index = start + i
            if fixed is not None:  # the column's own group, in the original order
                group = original_columns[column_index] // group_size
                scale, zero_point = fixed[0][:, group], fixed[1][:, group]
            elif group_size and column_index % group_size == 0:  # the group's values at the block's start
                group = slice(column_index, column_index + group_size)
                scale, zero_point = qparams_of(w[:, group], energy[group])
                scales.append(scale)
                zero_points.append(zero_point)
            column = part[:, i]
            rounded = fake_quantize(column, scale, zero_point)
            if keep is not None:
                rounded = torch.where(keep[:, column_index], rounded, torch.zeros_like(rounded))
            error = (column - rounded) / local[i, i]
            if shift is None:
                part[:, i:] -= _outer(error, local[i, i:], scratch)
            else:  # GPTAQ: towards the float model's outputs too, in the authors' order of operations
                part[:, i:] -= _outer(error, local[i, i:], scratch) - torch.outer(
                    column, shift[column_index, start + i : end]
                )
            part[:, i] = rounded
            errors[:, i] = error
        w[:, start:end] = part
        if shift is None:
            w[:, end:] -= errors @ factor[start:end, end:]
        else:
            w[:, end:] -= errors @ factor[start:end, end:] - part @ shift[start:end, end:]
    if order is not None:
        w = w[:, torch.argsort(order)]
    if fixed is not None:
        return w, fixed[0], fixed[1], None
    if group_size:
        g_idx = _group_index(order, group_size) if actorder == "group" else None
        return w, torch.stack(scales, dim=1), torch.stack(zero_points, dim=1), g_idx
    return w, scale, zero_point, None


def _group_index(order: Tensor, group_size: int) -> Tensor:
    """The group of every column (int32) when the groups are ``group_size`` consecutive columns of ``order``."""
    g_idx = torch.empty(order.numel(), dtype=torch.int32, device=order.device)
    g_idx[order] = torch.arange(order.numel(), dtype=torch.int32, device=order.device) // group_size
    return g_idx


def _asymmetric_shift(asymmetry: Tensor, hessian: Tensor, factor: Tensor) -> Tensor:
    """GPTAQ's ``P = α triu₁(ΔXᵀX Uᵀ) U`` (``U``: the inverse Hessian's upper Cholesky factor),
    with the columns no input reached left out, as the authors' code has it."""
    dead = torch.diagonal(hessian) == 0
    cross = asymmetry.float().clone()
    cross[:, dead] = 0
    return GPTAQ_ALPHA * torch.triu(cross @ factor.t(), diagonal=1) @ factor


def _static_groups(
    w: Tensor, energy: Tensor, qparams_of: Callable[[Tensor, Tensor], QParams], group_size: int
) -> QParams:
    """Every group's (outputs, groups) scales and zero points from the weights as they are."""
    groups = [slice(start, start + group_size) for start in range(0, w.shape[1], group_size)]
    found = [qparams_of(w[:, group], energy[group]) for group in groups]
    return torch.stack([s for s, _ in found], dim=1), torch.stack([z for _, z in found], dim=1)
