"""``format="fp8"``: the model with each FP8-quantized Linear replaced by :class:`Float8Linear`,
which stores its weight in ``torch.float8_e4m3fn`` (a quarter of float32) and multiplies with
torch's scaled FP8 matmul (``torch._scaled_mm``: cuBLASLt's FP8 kernels on a GPU, torch's own
on a CPU), pickled whole so ``torch.load`` gives it back.

The weights are surgery's FP8 values and scales, per tensor or per output channel. The inputs
are rounded to FP8 as the simulation rounds them: with its static per-tensor scale, or per
token as they run (``dynamic="token"``). A kernel multiplies FP8 by FP8, so FP8 weights without
FP8 inputs are refused, as are block scales the kernel does not take."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from surgery.core.errors import ConfigError
from surgery.ops.export.format_table import ExportFormat, register_export_format
from surgery.ops.export.formats.swapped_modules import save_swapped
from surgery.ops.numerics.deployment import ActivationGrid, ExportParts, WeightGrid
from surgery.ops.numerics.number_formats import E4M3_LARGEST
from surgery.ops.quantization.targets import DeployTarget


class Float8Linear(nn.Module):
    """A Linear computing ``x W`` with FP8 weights and FP8 inputs in one scaled matmul.

    ``weight`` is (outputs, inputs) in ``float8_e4m3fn``; ``weight_scale`` is one scale or one
    per output; ``input_scale`` is a static per-tensor scale, or None: each token's own,
    ``amax / 448``, as it runs."""

    def __init__(self, weight: Tensor, weight_scale: Tensor, bias: Tensor | None, input_scale: Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.register_buffer("weight", weight)
        self.register_buffer("weight_scale", weight_scale.float().reshape(1, -1))  # (1, 1) or (1, outputs)
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self.register_buffer("input_scale", None if input_scale is None else input_scale.float().reshape(1, 1))

    def forward(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.input_scale is not None:
            scale = self.input_scale
        else:  # per token: compressed-tensors' and the simulation's dynamic FP8 scale
            amax = rows.detach().abs().amax(dim=1, keepdim=True).float()
            scale = torch.where(amax > 0, amax / E4M3_LARGEST, torch.ones_like(amax))
        quantized = (rows.float() / scale).clamp(-E4M3_LARGEST, E4M3_LARGEST).to(torch.float8_e4m3fn)
        if scale.numel() == 1 and self.weight_scale.numel() == 1:  # tensor-wise: two scalars
            input_scale, weight_scale = scale.reshape(()), self.weight_scale.reshape(())
        else:  # row-wise: one scale per token and one per output, both given whole
            input_scale = scale.expand(rows.shape[0], 1).contiguous()
            weight_scale = self.weight_scale.expand(1, self.out_features).contiguous()
        # half-precision models take their own dtype out (row-wise scales give float32 only on some GPUs)
        out_dtype = x.dtype if x.dtype in (torch.bfloat16, torch.float16) else torch.float32
        out = torch._scaled_mm(
            quantized, self.weight.t(), scale_a=input_scale, scale_b=weight_scale, out_dtype=out_dtype
        )
        out = out.to(x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        inputs = "static" if self.input_scale is not None else "dynamic per token"
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 inputs {inputs}"


def write_fp8(parts: ExportParts, path: Path, options: dict[str, Any]) -> dict[str, Any]:
    """Swap each FP8-quantized Linear of a copy of ``parts.model`` for a :class:`Float8Linear`."""
    if options:
        raise ConfigError("export.options", sorted(options), "format='fp8' takes no options")
    replacements = {layer: lambda module, layer=layer: _float8_linear(parts, layer, module) for layer in _layers(parts)}
    return save_swapped(parts.model, path, replacements)


def _float8_linear(parts: ExportParts, layer: str, module: nn.Module) -> Float8Linear:
    """``module`` (the copy's ``layer``) on its FP8 grid, with its inputs' scale."""
    grid, inputs = parts.layer_weight(layer), parts.activation(layer, "input")
    device = module.weight.device  # the grids are on the CPU, the model's copy where the model is
    weight_scale = grid.scale.float().reshape(-1, 1).to(device)
    values = (module.weight.detach().float() / weight_scale).to(torch.float8_e4m3fn)
    input_scale = None if inputs.dynamic else inputs.scale.detach().float().to(device)
    return Float8Linear(values, weight_scale.reshape(-1), module.bias, input_scale)


def _layers(parts: ExportParts) -> list[str]:
    if not parts.weights:
        raise ConfigError("export.handle", "no quantized weights", "format='fp8' holds FP8 Linear weights")
    layers = []
    for key, grid in parts.weights.items():
        layer, _, attribute = key.rpartition(".")
        if attribute != "weight" or not isinstance(parts.model.get_submodule(layer), nn.Linear):
            raise ConfigError("export.handle", key, "format='fp8' replaces nn.Linear weights only")
        _check_weights(key, grid)
        module = parts.model.get_submodule(layer)
        if module.in_features % 16 or module.out_features % 16:
            raise ConfigError(
                "export.handle",
                f"{layer} ({module.in_features} -> {module.out_features})",
                "the FP8 kernels take inputs and outputs in multiples of 16; exclude the layer from quantize",
            )
        _check_inputs(layer, parts.activation(layer, "input"), parts)
        layers.append(layer)
    return layers


def _check_weights(key: str, grid: WeightGrid) -> None:
    if grid.spec.format != "fp8_e4m3" or grid.group_size:
        raise ConfigError(
            "quantize.weights",
            f"{key}: {grid.spec.format}{f' group {grid.group_size}' if grid.group_size else ''}",
            "format='fp8' holds fp8_e4m3 weights with one scale per tensor or per output channel",
        )


def _check_inputs(layer: str, grid: ActivationGrid | None, parts: ExportParts) -> None:
    if parts.activation(layer, "output") is not None:
        raise ConfigError(
            "quantize.where", "output", "the FP8 kernel rounds Linear inputs; quantize with where='input'"
        )
    if grid is None or grid.spec.format != "fp8_e4m3" or grid.axis is not None or grid.spec.dynamic == "tensor":
        raise ConfigError(
            "quantize.activations",
            layer,
            "the FP8 kernel multiplies FP8 by FP8: quantize the inputs as fp8_e4m3, with one static scale or "
            "dynamic='token'",
        )


def load_fp8(path: Path) -> nn.Module:
    """The pickled model, in eval mode."""
    return torch.load(str(path), weights_only=False).eval()


def _target_check(model: nn.Module, spec: Any, matched: dict[str, Any]) -> None:
    """What ``quantize(target="fp8")`` refuses when it starts: a Linear whose sizes the kernels do not take."""
    for key, target in matched.items():
        module = target.module
        if isinstance(module, nn.Linear) and (module.in_features % 16 or module.out_features % 16):
            raise ConfigError(
                "quantize.target",
                "fp8",
                f"cannot hold {key} ({module.in_features} -> {module.out_features}): the FP8 kernels take inputs "
                "and outputs in multiples of 16; exclude the layer",
            )


register_export_format(
    ExportFormat(
        "fp8",
        write_fp8,
        load=load_fp8,
        suffix="pt",
        takes_parts=True,
        holds_hooks=True,
        exact=False,
        bound=0.9999,
        target=DeployTarget(
            layers=(nn.Linear,),
            weights={"format": "fp8_e4m3", "group_size": None},
            activations={"format": "fp8_e4m3", "per_channel": False},
            check=_target_check,
        ),
    )
)
