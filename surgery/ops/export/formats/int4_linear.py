"""``format="int4"``: a bfloat16 model with each 4-bit Linear replaced by :class:`Int4Linear`,
which holds surgery's integers packed by torch's own CPU layout
(``_convert_weight_to_int4pack_for_cpu``) and multiplies with torch's
``_weight_int4pack_mm_for_cpu``, pickled whole so ``torch.load`` gives it back: plain PyTorch
with 4-bit weights on a CPU, where torchao has no CPU int4 kernel.

torch's kernel computes ``(u - 8) x scale + zero`` from unsigned nibbles ``u`` and a bfloat16
scale and zero per group; surgery's ``scale x (q - zero point)`` is that with ``u = q - qmin``
and ``zero = scale x (8 + qmin - zero point)`` (0 for a symmetric grid), rounded to bfloat16.
Measured on this CPU, one thread, 2048 -> 8192, bfloat16: a token at a time (decode) 1.9x
faster than the dense bfloat16 matmul; 16 tokens at once 2.3x slower; float32 activations far
slower, so only bfloat16 models are written."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from surgery.core.errors import ConfigError
from surgery.ops.export.format_table import ExportFormat, register_export_format
from surgery.ops.export.formats.swapped_modules import save_swapped
from surgery.ops.numerics.deployment import ExportParts, WeightGrid

GROUP_SIZES = (32, 64, 128, 256)  # what torch's CPU kernel takes


class Int4Linear(nn.Module):
    """A Linear computing ``x W^T (+ b)`` from 4-bit weights in torch's CPU int4 layout."""

    def __init__(
        self, packed: Tensor, scales_and_zeros: Tensor, group_size: int, shape: tuple[int, int], bias: Tensor | None
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = shape
        self.group_size = group_size
        self.register_buffer("packed", packed)
        self.register_buffer("scales_and_zeros", scales_and_zeros)  # (inputs / group, outputs, 2), bfloat16
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    def forward(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed, self.group_size, self.scales_and_zeros)
        if self.bias is not None:
            out = out + self.bias
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}"


def int4_linear(module: nn.Linear, grid: WeightGrid) -> Int4Linear:
    """``module``'s weight (on ``grid``) in torch's CPU int4 layout."""
    integers = grid.integers(module.weight)  # (outputs, inputs), on the CPU
    low, _ = grid.spec.quant_range
    rows, groups = integers.shape[0], integers.shape[1] // grid.group_size
    scale = grid.scale.float().cpu().reshape(rows, groups)
    zero = scale * (8 + low - grid.zero_point.cpu().reshape(rows, groups).float())
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu((integers - low).to(torch.int32).contiguous(), 1)
    scales_and_zeros = torch.stack([scale.t(), zero.t()], dim=-1).to(torch.bfloat16).contiguous()
    bias = None if module.bias is None else module.bias.detach().cpu()
    return Int4Linear(packed, scales_and_zeros, grid.group_size, tuple(integers.shape), bias)


def write_int4(parts: ExportParts, path: Path, options: dict[str, Any]) -> dict[str, Any]:
    """Swap each 4-bit Linear of a copy of ``parts.model`` for an :class:`Int4Linear`."""
    if options:
        raise ConfigError("export.options", sorted(options), "format='int4' takes no options")
    replacements = {
        layer: lambda module, grid=grid: int4_linear(module, grid) for layer, grid in _layers(parts).items()
    }
    return save_swapped(parts.model, path, replacements)


def _layers(parts: ExportParts) -> dict[str, WeightGrid]:
    if not parts.weights:
        raise ConfigError("export.handle", "no quantized weights", "format='int4' holds 4-bit Linear weights")
    if parts.activations:
        raise ConfigError(
            "quantize.activations",
            next(iter(parts.activations))[0],
            "format='int4' runs float inputs; leave them float",
        )
    found = {}
    for key, grid in parts.weights.items():
        layer, _, attribute = key.rpartition(".")
        module = parts.model.get_submodule(layer)
        if attribute != "weight" or not isinstance(module, nn.Linear):
            raise ConfigError("export.handle", key, "format='int4' replaces nn.Linear weights only")
        if module.weight.dtype != torch.bfloat16:
            raise ConfigError(
                "export.format",
                "int4",
                f"{layer} is {module.weight.dtype}: torch's CPU int4 kernel is fast with bfloat16 inputs only; "
                "quantize a bfloat16 model",
            )
        if module.out_features % 16:
            raise ConfigError(
                "export.handle",
                f"{layer} ({module.in_features} -> {module.out_features})",
                "torch's CPU int4 layout takes outputs in multiples of 16; exclude the layer from quantize",
            )
        spec = grid.spec
        if (
            spec.is_float
            or spec.bits != 4
            or spec.group_size not in GROUP_SIZES
            or module.in_features % spec.group_size
        ):
            raise ConfigError(
                "quantize.weights",
                f"{key}: {spec.format if spec.is_float else f'{spec.bits}-bit'} group {spec.group_size}",
                f"format='int4' holds 4-bit integer weights in groups of {', '.join(map(str, GROUP_SIZES))} "
                "that tile each row",
            )
        found[layer] = grid
    return found


def load_int4(path: Path) -> nn.Module:
    """The pickled model, in eval mode."""
    return torch.load(str(path), weights_only=False).eval()


register_export_format(
    ExportFormat("int4", write_int4, load=load_int4, suffix="pt", takes_parts=True, exact=False, bound=0.9999)
)
