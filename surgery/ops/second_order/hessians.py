"""Layer Hessians for second-order compression: ``H = 2 XᵀX / rows`` of each layer's inputs.

SparseGPT and GPTQ see a layer as a matrix ``W`` (outputs × input columns) applied to input
columns ``X``; the layer-wise reconstruction error ``‖WX − ŴX‖²`` has the Hessian ``2XXᵀ``.
:func:`input_columns` turns what a layer receives into those columns: the last axis for
``nn.Linear`` and Hugging Face ``Conv1D``, the unfolded patches (``C·k`` per position, the
order of ``weight.reshape(out, -1)``) for ``nn.Conv1d``/``nn.Conv2d``, one set per group of a
grouped convolution. :class:`HessianReducer` is a capture reducer (``reduce="hessian"``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from surgery.core import distributed
from surgery.core._compat import conv_padding
from surgery.core.capture import register_reduction
from surgery.core.errors import ConfigError
from surgery.core.layer_kinds import LAYER_KINDS, input_axis_of, is_kind


def supports_hessian(module: nn.Module) -> bool:
    """Whether :func:`input_columns` handles this layer: a kind marked ``hessian`` in
    :mod:`surgery.core.layer_kinds` (Linear, Conv1d, Conv2d, HF Conv1D; not Conv3d)."""
    return is_kind(module, lambda kind: kind.hessian)


def _transposed(module: nn.Module) -> bool:
    """A matrix-like weight stored ``(in, out)`` (HF ``Conv1D``), as its kind says."""
    return not is_kind(module, lambda kind: kind.convolution) and input_axis_of(module) == 0


def weight_matrix(module: nn.Module, weight: Tensor) -> Tensor:
    """``weight`` as the (outputs, input columns) matrix the Hessian's columns match (a copy
    for HF ``Conv1D``, whose weight is stored transposed; a view otherwise)."""
    if _transposed(module):
        return weight.t()
    return weight.reshape(weight.shape[0], -1)


def from_matrix(module: nn.Module, matrix: Tensor, like: Tensor) -> Tensor:
    """Invert :func:`weight_matrix`: the (outputs, columns) matrix in the weight's own shape."""
    if _transposed(module):
        return matrix.t().contiguous().to(like.dtype)
    return matrix.reshape(like.shape).to(like.dtype)


def groups_of(module: nn.Module) -> int:
    """How many independent Hessians a layer has: a convolution's ``groups``, else 1."""
    return module.groups if is_kind(module, lambda kind: kind.convolution) else 1


def input_columns(module: nn.Module, name: str, x: Tensor) -> Tensor:
    """The columns a layer multiplies by its weight, as ``(groups, rows, columns per group)``."""
    if not supports_hessian(module):
        raise ConfigError(
            "calibration",
            name,
            f"is a {type(module).__name__}; second-order methods need a layer kind they can unfold: "
            f"{', '.join(k for k in LAYER_KINDS if LAYER_KINDS.get(k).hessian)} (exclude the layer)",
        )
    x = x.detach().float()
    if not is_kind(module, lambda kind: kind.convolution):
        return x.reshape(1, -1, x.shape[-1])
    dims = len(module.kernel_size)
    if x.dim() == dims + 1:  # unbatched
        x = x.unsqueeze(0)
    x = _pad(module, x)
    kernel, dilation, stride = module.kernel_size, module.dilation, module.stride
    if dims == 1:  # a 1-d convolution is a 2-d one of height 1
        x, kernel, dilation, stride = x.unsqueeze(2), (1, *kernel), (1, *dilation), (1, *stride)
    patches = F.unfold(x, kernel, dilation=dilation, stride=stride)  # (N, C·k, L), channel-major
    groups = module.groups
    n, features, positions = patches.shape
    return (
        patches.view(n, groups, features // groups, positions)
        .permute(1, 0, 3, 2)
        .reshape(groups, -1, features // groups)
    )


def _pad(module: nn.Module, x: Tensor) -> Tensor:
    """``x`` padded as the convolution pads it, so that unfolding needs no padding."""
    if module.padding_mode != "zeros":
        return F.pad(x, conv_padding(module), mode=module.padding_mode)
    if module.padding == "valid":
        return x
    if module.padding == "same":
        pads: list[int] = []
        for k, d in zip(reversed(module.kernel_size), reversed(module.dilation)):
            total = d * (k - 1)
            pads += [total // 2, total - total // 2]
        return F.pad(x, pads)
    return F.pad(x, [p for p in reversed(module.padding) for _ in range(2)])


class HessianReducer:
    """Streaming ``2 XᵀX / rows`` of a layer's input columns (float32, one per group)."""

    def __init__(self, name: str = "", module: nn.Module | None = None) -> None:
        self.name, self.module = name, module
        self.sum: Tensor | None = None
        self.rows = 0
        self.found: dict[str, Any] | None = None  # the result, once asked for (no more updates then)

    def update(self, tensor: Tensor) -> None:
        if self.found is not None:
            raise RuntimeError(
                f"capture: {self.name}'s Hessian was read while the model still ran; read the results after the with block"
            )
        columns = input_columns(self.module, self.name, tensor)  # NaN or Inf carries into the sum: checked once
        product = columns.transpose(1, 2) @ columns
        self.sum = product if self.sum is None else self.sum.add_(product)  # in place: one n-by-n less at the peak
        self.rows += columns.shape[1]

    def result(self) -> dict[str, Any] | None:
        if self.found is not None or self.sum is None:
            return self.found
        if not torch.isfinite(torch.stack(torch.aminmax(self.sum))).all():  # one sync a layer; NaN carries into both
            raise ConfigError("calibration", self.name, "NaN or Inf reached this layer; clean the calibration data")
        rows = distributed.summed_count(self.rows)  # over the processes calibrating together, if any
        total = distributed.summed(self.sum)
        hessian = total.mul_(2.0 / rows) if total is not self.sum else total * (2.0 / rows)
        self.sum, self.found = None, {"hessian": hessian, "rows": rows}  # the sum made the Hessian: one n-by-n each
        return self.found


register_reduction("hessian", HessianReducer)


def asymmetric_hessians(name: str, module: nn.Module, floats: list[Tensor], inputs: list[Tensor]) -> dict[str, Any]:
    """GPTAQ's statistics of a layer (a ``run_sequential`` pairing): the Hessian ``2 XᵀX / rows``
    of its inputs here and ``2 (X̃ − X)ᵀX / rows``, ``X̃`` its inputs in the model before
    compression, row for row (one per group)."""
    if len(floats) != len(inputs) or any(f.shape != x.shape for f, x in zip(floats, inputs, strict=False)):
        raise ConfigError(
            "calibration",
            name,
            "received other inputs in the model before compression than after it (a router chose other "
            "experts), so GPTAQ cannot pair them row for row; run every token through every expert "
            "(with surgery.every_expert_calibrated(): ...) or use method='gptq'",
        )
    hessian = asymmetry = None
    rows = 0
    for original, given in zip(floats, inputs, strict=True):
        columns = input_columns(module, name, given)  # NaN or Inf carries into the sums: checked once
        shift = input_columns(module, name, original) - columns
        product, cross = columns.transpose(1, 2) @ columns, shift.transpose(1, 2) @ columns
        hessian = product if hessian is None else hessian.add_(product)
        asymmetry = cross if asymmetry is None else asymmetry.add_(cross)
        rows += columns.shape[1]
    if (
        hessian is not None
        and not torch.isfinite(torch.stack([*torch.aminmax(hessian), *torch.aminmax(asymmetry)])).all()
    ):
        raise ConfigError("calibration", name, "NaN or Inf reached this layer; clean the calibration data")
    rows = distributed.summed_count(rows)
    scale = 2.0 / rows
    return {
        "hessian": distributed.summed(hessian) * scale,
        "asymmetry": distributed.summed(asymmetry) * scale,
        "rows": rows,
    }
