"""The fake-quantization arithmetic: scale and zero point from a range, weights and activations
rounded onto a grid (per tensor, channel or group; one or two levels of scales)."""

from __future__ import annotations

import torch
from torch import Tensor

from surgery.core.errors import ConfigError
from surgery.ops.numerics.grid import SCALE_DTYPES, GridSpec


def stored_scale(scale: Tensor, spec: GridSpec) -> Tensor:
    """``scale`` rounded to ``spec.scale_dtype`` (kept in float32, at least that dtype's
    smallest normal so it stays positive); as it is without one."""
    if spec.scale_dtype is None:
        return scale
    dtype = SCALE_DTYPES[spec.scale_dtype]
    return _in_range(scale.to(dtype).float().clamp_min(torch.finfo(dtype).smallest_normal), scale, spec, "scale")


def _in_range(stored: Tensor, given: Tensor, spec: GridSpec, what: str) -> Tensor:
    """``stored``, unless rounding to ``scale_dtype`` overflowed a finite value: refused in one line."""
    overflow = torch.isinf(stored) & torch.isfinite(given)
    if bool(overflow.any()):
        largest = torch.finfo(SCALE_DTYPES[spec.scale_dtype]).max
        raise ConfigError(
            "quantize.weights.scale_dtype",
            spec.scale_dtype,
            f"cannot hold a group's {what} {float(given[overflow].flatten()[0]):.6g} (its largest is {largest:g}): "
            "a weight is too large for this grid; exclude its layer or rescale it",
        )
    return stored


def super_grouped(scale: Tensor, spec: GridSpec) -> Tensor:
    """(outputs, groups) ``scale`` on ``spec``'s two-level grid: every ``super_group`` inputs'
    groups share ``d`` (their largest scale over ``2^scale_bits - 1``, in ``scale_dtype``), the
    largest group ``d`` times that top level and every other ``d`` times the nearest integer in
    [1, 2^scale_bits - 1] (as llama.cpp's K-quants; exact in float32)."""
    return _on_two_levels(scale, spec, 1)


def super_grouped_offsets(offset: Tensor, spec: GridSpec) -> Tensor:
    """(outputs, groups) float offsets on the two-level grid, as :func:`super_grouped` puts the
    scales, under one ``dmin`` a super group, each an integer in [0, 2^scale_bits - 1] times it."""
    return _on_two_levels(offset, spec, 0)


def _on_two_levels(values: Tensor, spec: GridSpec, least: int) -> Tensor:
    if spec.super_group is None:
        return values
    top = (1 << spec.scale_bits) - 1
    rows, groups = values.shape
    per = spec.super_group // spec.group_size
    if groups % per:
        raise ConfigError(
            "quantize.weights.super_group",
            spec.super_group,
            f"needs weights whose inputs are a multiple of it ({groups * spec.group_size} inputs)",
        )
    blocks = values.float().reshape(rows, -1, per)
    largest = blocks.amax(-1, keepdim=True)
    d = super_scale(largest, spec)
    at_top = (blocks == largest) & (largest > 0)  # a super group of zero offsets keeps them zero
    levels = torch.where(at_top, top, torch.clamp(torch.round(blocks / d), least, top))
    return (d * levels).reshape(rows, groups)


def stored_offset(offset: Tensor, spec: GridSpec) -> Tensor:
    """A float offset rounded to ``spec.scale_dtype`` (zero stays zero); as it is without one."""
    if spec.scale_dtype is None:
        return offset
    return _in_range(offset.to(SCALE_DTYPES[spec.scale_dtype]).float(), offset, spec, "offset")


def fake_quantize_offset(x: Tensor, scale: Tensor, offset: Tensor, spec: GridSpec) -> Tensor:
    """``x`` on a float-offset grid: ``q = clamp(round((x + offset) / scale))``, then ``scale × q
    - offset`` in float32, as GGUF's dequantizers compute it (``scale``, ``offset`` broadcast)."""
    low, high = spec.quant_range
    q = torch.clamp(torch.round((x.float() + offset) / scale), low, high)
    return (q * scale - offset).to(x.dtype)


def super_scale(largest: Tensor, spec: GridSpec) -> Tensor:
    """The stored scale ``d`` of super groups whose largest group scale is ``largest``: over
    the top level, in ``scale_dtype`` (a subnormal where small, as llama.cpp stores it; never 0)."""
    dtype = SCALE_DTYPES[spec.scale_dtype]
    info = torch.finfo(dtype)
    return (largest / ((1 << spec.scale_bits) - 1)).to(dtype).float().clamp_min(info.smallest_normal * info.eps)


def compute_qparams(
    low: Tensor, high: Tensor, spec: GridSpec, tensor_amax: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Scale and zero point for the range [low, high], with torch.ao's formulas; on a
    floating-point grid, the format's scale of ``max(|low|, |high|)`` and a zero point of 0
    (``tensor_amax``: the whole tensor's, for formats with a per-tensor scale above the blocks');
    with ``float_offset``, the float offset ``-low`` in the zero point's place."""
    if spec.is_float:
        amax = torch.maximum(-low.float(), high.float()).clamp(min=0)
        scale = spec.number_format.scale_of(amax, tensor_amax)
        return scale, torch.zeros_like(scale, dtype=torch.int32)
    quant_min, quant_max = spec.quant_range
    low = torch.minimum(low.float(), torch.zeros_like(low, dtype=torch.float32))
    high = torch.maximum(high.float(), torch.zeros_like(high, dtype=torch.float32))
    eps = torch.tensor(torch.finfo(torch.float32).eps)
    if spec.float_offset:  # the group's minimum, as a float: value = scale x q - offset
        scale = stored_scale(torch.maximum((high - low) / float(quant_max - quant_min), eps), spec)
        return scale, stored_offset(-low, spec)
    if spec.symmetric:
        scale = stored_scale(torch.maximum(torch.maximum(-low, high) / (float(quant_max - quant_min) / 2), eps), spec)
        zero_point = torch.zeros_like(scale, dtype=torch.int32)
    else:
        scale = stored_scale(torch.maximum((high - low) / float(quant_max - quant_min), eps), spec)
        zero_point = torch.clamp(quant_min - torch.round(low / scale).to(torch.int32), quant_min, quant_max)
        if spec.observer == "full_range":  # its zero point by the larger side, an all-zero range's too
            half = (quant_max + 1) // 2
            zero_point = torch.where(-low > high, half, half - 1).to(torch.int32)
    return scale, zero_point.to(torch.int32)


def fake_quantize_groups(
    x: Tensor, scale: Tensor, zero_point: Tensor, axis: int, spec: GridSpec, g_idx: Tensor | None = None
) -> Tensor:
    """Group-wise fake quantization of a weight: ``scale`` and ``zero_point`` are (outputs,
    groups) for groups of ``spec.group_size`` consecutive entries of ``x.movedim(axis, 0)``'s
    rows (the last group may be shorter); with ``g_idx`` (``actorder="group"``), column ``j``
    is in group ``g_idx[j]`` instead (each group ``group_size`` columns, as :func:`check_g_idx` says)."""
    moved = x.movedim(axis, 0)
    rows = moved.reshape(moved.shape[0], -1)
    if g_idx is not None:  # the columns sorted by group (stably) are contiguous groups
        order = torch.argsort(g_idx.to(rows.device), stable=True)
        grouped = fake_quantize_groups(rows[:, order], scale, zero_point, 0, spec)
        return torch.empty_like(grouped).index_copy_(1, order, grouped).reshape(moved.shape).movedim(0, axis)
    size = spec.group_size
    columns = rows.shape[1]
    padded = torch.nn.functional.pad(rows, (0, (-columns) % size)).reshape(-1, size)
    if spec.is_float:
        rounded = spec.number_format.fake_quantize(padded, scale.reshape(-1, 1).to(padded.device))
    elif spec.float_offset:
        scale, offset = scale.reshape(-1, 1).to(padded.device), zero_point.reshape(-1, 1).to(padded.device)
        rounded = fake_quantize_offset(padded, scale, offset, spec)
    else:
        quant_min, quant_max = spec.quant_range
        rounded = torch.fake_quantize_per_channel_affine(
            padded, scale.reshape(-1), zero_point.reshape(-1), 0, quant_min, quant_max
        )
    return rounded.reshape(rows.shape[0], -1)[:, :columns].reshape(moved.shape).movedim(0, axis)


def g_idx_problem(g_idx: Tensor, columns: int, group_size: int) -> str | None:
    """Why ``g_idx`` is not a group index of ``columns`` inputs in groups of ``group_size`` (an
    integer tensor, one entry per column, every group ``group_size`` columns as contiguous
    groups would have them, the last one possibly fewer), or None when it is."""
    if g_idx.is_floating_point() or g_idx.is_complex() or g_idx.dtype == torch.bool:
        return f"has dtype {g_idx.dtype}; it must be an integer tensor"
    if tuple(g_idx.shape) != (columns,):
        return f"has shape {tuple(g_idx.shape)}; it must be ({columns},), one group per input column"
    if not torch.equal(torch.sort(g_idx.cpu().long()).values, torch.arange(columns) // group_size):
        return f"does not put exactly {group_size} columns in each group (groups 0 to {(columns - 1) // group_size})"
    return None


class Grid:
    """A weight's quantization grid seen as an (outputs, columns) matrix, for solvers that
    round it a slice at a time (GPTQ): scales per row (per channel or per group) or one."""

    def __init__(self, spec: GridSpec, per_row: bool, tensor_amax: Tensor | None = None) -> None:
        self.spec, self.per_row, self.tensor_amax = spec, per_row, tensor_amax

    def qparams_of(self, columns: Tensor, importance: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Scale and zero point of an (outputs, k) slice: one per row, or one for all
        (``importance``: one weight per column, or shaped as ``columns``, for a weighted observer)."""
        flat = columns.float() if self.per_row else columns.float().reshape(1, -1)
        weighted = importance is not None and self.spec.weighted
        weights = importance.float().to(flat.device).expand(columns.shape) if weighted else None
        low, high = self.spec.observe(flat, None, None if weights is None else weights.reshape(flat.shape))
        scale, zero_point = compute_qparams(low, high, self.spec, self.tensor_amax)
        return (scale, zero_point) if self.per_row else (scale.reshape(()), zero_point.reshape(()))

    def group_qparams(self, rows: Tensor, importance: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """(outputs, groups) scales and zero points for round-to-nearest by groups (a last,
        shorter group is observed on its own entries only); ``importance``: one weight per
        column, for a weighted observer."""
        size = self.spec.group_size
        whole = rows.shape[1] // size * size
        parts = []
        if self.spec.is_float and self.tensor_amax is None:  # a per-tensor scale over the blocks' (nvfp4)
            return Grid(self.spec, self.per_row, rows.detach().abs().amax().float()).group_qparams(rows, importance)
        weighted = importance is not None and self.spec.weighted
        weights = importance.float().to(rows.device).expand(rows.shape) if weighted else None
        if whole:
            scale, zero_point = self.qparams_of(
                rows[:, :whole].float().reshape(-1, size),
                None if weights is None else weights[:, :whole].reshape(-1, size),
            )
            parts.append((scale.view(rows.shape[0], -1), zero_point.view(rows.shape[0], -1)))
        if whole < rows.shape[1]:
            scale, zero_point = self.qparams_of(
                rows[:, whole:].float(), None if weights is None else weights[:, whole:]
            )
            parts.append((scale.view(-1, 1), zero_point.view(-1, 1)))
        zero_point = torch.cat([p[1] for p in parts], dim=1)
        if self.spec.float_offset:
            zero_point = super_grouped_offsets(zero_point, self.spec)
        return super_grouped(torch.cat([p[0] for p in parts], dim=1), self.spec), zero_point

    def round(self, column: Tensor, scale: Tensor, zero_point: Tensor) -> Tensor:
        """One column rounded onto the grid (``scale``: one per row, or one)."""
        if self.spec.is_float:
            return self.spec.number_format.fake_quantize(column, scale)
        if self.spec.float_offset:
            return fake_quantize_offset(column, scale, zero_point, self.spec)
        quant_min, quant_max = self.spec.quant_range
        rows = column.shape[0]
        return torch.fake_quantize_per_channel_affine(
            column.unsqueeze(1),
            scale.expand(rows).contiguous(),
            zero_point.expand(rows).contiguous(),
            0,
            quant_min,
            quant_max,
        ).squeeze(1)


def fake_quantize(x: Tensor, scale: Tensor, zero_point: Tensor, axis: int | None, spec: GridSpec) -> Tensor:
    """PyTorch's fused fake-quantization op for the given parameters (on a floating-point grid,
    the format's rounding of ``x / scale``)."""
    if spec.is_float:
        shape = [1] * x.dim()
        if axis is not None:
            shape[axis] = -1
        return spec.number_format.fake_quantize(x, scale.reshape(shape) if axis is not None else scale)
    if spec.float_offset:
        shape = [1] * x.dim()
        if axis is not None:
            shape[axis] = -1
        return fake_quantize_offset(x, scale.reshape(shape), zero_point.reshape(shape), spec)
    quant_min, quant_max = spec.quant_range
    if axis is None:
        return torch.fake_quantize_per_tensor_affine(x, scale, zero_point, quant_min, quant_max)
    return torch.fake_quantize_per_channel_affine(x, scale, zero_point, axis, quant_min, quant_max)


def fake_quantize_dynamic(x: Tensor, spec: GridSpec) -> tuple[Tensor, Tensor]:
    """``x`` fake-quantized with scales taken from itself (``spec.dynamic``: one per token, each
    row of the last dimension, or one for the whole tensor), rounded as ``spec.rounding`` says
    (``round(x / scale)``: bit-equal to what llm-compressor and vLLM compute; ``round(x * (1 /
    scale))``: torchao's); gradients pass
    straight through. Returns it and the scales (non-finite where ``x`` is)."""
    if x.numel() == 0:
        return x, torch.ones(0)
    rows = x.reshape(-1, x.shape[-1]) if spec.dynamic == "token" and x.dim() else x.reshape(1, -1)
    values = rows.detach().float()
    scale, zero_point = compute_qparams(values.amin(1), values.amax(1), spec)
    scale, zero_point = scale.to(x.device).reshape(-1, 1), zero_point.to(x.device).reshape(-1, 1)
    if spec.is_float:
        rounded = spec.number_format.fake_quantize(rows, scale)
    else:
        quant_min, quant_max = spec.quant_range
        scaled = rows * (1.0 / scale.to(rows.dtype)) if spec.rounding == "reciprocal" else rows / scale.to(rows.dtype)
        integers = torch.clamp(torch.round(scaled + zero_point), quant_min, quant_max)
        rounded = ((integers - zero_point) * scale.to(rows.dtype)).to(rows.dtype)
    if rows.requires_grad:
        rounded = rows + (rounded - rows).detach()
    return rounded.reshape(x.shape), scale.reshape(-1)
