"""compressed-tensors' quantization schemes from surgery's grids: which layers share a scheme, their weight and input arguments, and the quantization config written beside the weights."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from surgery.core.errors import ConfigError
from surgery.core.layer_kinds import input_axis_of, is_kind
from surgery.ops.export.formats.compressed_tensors_experts import (
    ignored,
)
from surgery.ops.numerics.deployment import ExportParts
from surgery.ops.numerics.grid import GridSpec

pass
from surgery.ops.export.formats.compressed_tensors_groups import (
    group_targets,
    mixed_format,
    mixed_groups,
    refuse_pruned_floats,
    specs_by_grid,
)
from surgery.ops.numerics.deployment import ActivationGrid

FLOAT_FORMATS = {  # surgery's floating-point grid -> compressed-tensors' format
    "fp8_e4m3": "float-quantized",
    "mxfp4": "mxfp4-pack-quantized",
    "nvfp4": "nvfp4-pack-quantized",
}


def schemes_of(parts: ExportParts, ct: Any, mode: str) -> list[tuple[Any, list[str]]]:
    """A compressed-tensors scheme per weight grid of the quantized Linears and Conv1Ds, with
    its layers: one scheme targeting the layer kinds, or one per grid targeting its layers by
    name (:mod:`~surgery.ops.export.formats.compressed_tensors_groups`)."""
    from compressed_tensors.quantization import QuantizationArgs

    if any(grid.step == "kv_cache" for grid in parts.activations.values()):  # never dropped silently
        raise ConfigError(
            "kv_cache",
            "k_proj/v_proj outputs",
            "format='compressed-tensors' holds no KV-cache scales from surgery; export a run without the kv_cache step",
        )
    if parts.masks and not parts.weights:
        raise ConfigError(
            "export.format",
            "compressed-tensors",
            f"compressed-tensors {ct.__version__} has no sparse compressor (bitmask, 2:4); "
            "pruned weights are held only as zeros of quantized weights, or use format='safetensors'",
        )
    if not parts.weights:
        raise ConfigError(
            "export.handle", "no quantized weights", "format='compressed-tensors' holds quantized weights"
        )
    refuse_pruned_floats(parts.masks, parts.weights, ct.__version__)
    grids = [weight_layers(parts.model, group) for group in specs_by_grid(_weight_specs(parts))]
    layers = [layer for _, group in grids for layer in group]
    inputs = None
    if mode == "static":
        inputs = _input_args(parts, layers, QuantizationArgs)
        if inputs is None:
            raise ConfigError(
                "export.options.activations", mode, "needs activations quantized at layer inputs (where='input')"
            )
    elif mode == "dynamic":
        inputs = _dynamic_input_args(parts, layers, QuantizationArgs)
    conv1d = [layer for layer in layers if stored_transposed(parts.model.get_submodule(layer))]
    if inputs is not None and conv1d:
        raise ConfigError(
            "quantize.activations",
            f"{len(conv1d)} Conv1D layer(s) (e.g. {conv1d[0]})",
            f"transformers loads compressed-tensors {ct.__version__} Conv1D models dequantized, without input "
            "scales; export their weights only (quantize.activations=null) or use format='onnx'",
        )
    named = len(grids) > 1  # one group per grid, each naming its layers
    schemes = [(_group_scheme(parts.model, spec, group, inputs, named), group) for spec, group in grids]
    dequantized = [_dequantized(scheme, any(layer in conv1d for layer in group)) for scheme, group in schemes]
    return mixed_groups(parts.model, schemes, dequantized)


def _group_scheme(model: nn.Module, spec: GridSpec, layers: list[str], inputs: Any, named: bool) -> Any:
    """The compressed-tensors scheme of ``layers`` on ``spec`` (``inputs``: every layer's input
    setting), targeting them by name when ``named``, else by their kinds."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    weights = weight_arguments(spec, QuantizationArgs)  # refuses the float formats it does not hold
    if spec.is_float:
        scheme_format = FLOAT_FORMATS[spec.format]
    else:
        scheme_format = "int-quantized" if inputs is not None else "pack-quantized"
    kinds = sorted({type(model.get_submodule(layer)).__name__ for layer in layers})
    targets = group_targets(model, layers) if named else kinds
    return QuantizationScheme(targets=targets, weights=weights, input_activations=inputs, format=scheme_format)


def _weight_specs(parts: ExportParts) -> dict[str, GridSpec]:
    """Each quantized weight's grid, by its key."""
    return {key: grid.spec for key, grid in parts.weights.items()}


def weight_layers(model: nn.Module, specs: dict[str, GridSpec]) -> tuple[GridSpec, list[str]]:
    """The one weight setting of the quantized layers, and those layers (each checked to be a
    Linear or Conv1D weight compressed-tensors can lay out, in whole groups)."""
    layers = []
    for key, spec in specs.items():
        layer, _, attribute = key.rpartition(".")
        module = model.get_submodule(layer)
        if attribute != "weight" or not linear_or_conv1d(module):
            raise ConfigError("export.handle", key, "compressed-tensors holds quantized Linear and Conv1D weights only")
        if stored_transposed(module) and (
            spec.group_size or not (spec.symmetric or spec.is_float)
        ):  # floats: no zero point
            setting = f"group_size={spec.group_size}" if spec.group_size else "symmetric=False"
            raise ConfigError(
                "quantize.weights",
                setting,
                f"{layer} is a Conv1D (its weight stored inputs x outputs), whose groups and zero points "
                "compressed-tensors cannot lay out; quantize Conv1D layers symmetric, per channel",
            )
        layers.append(layer)
    if len(set(specs.values())) > 1:
        raise ConfigError(
            "export.handle", len(set(specs.values())), "weight settings differ between layers; one scheme is held"
        )
    spec = next(iter(specs.values()))
    for layer in layers:
        dtype = model.get_submodule(layer).weight.dtype
        if spec.format in ("mxfp4", "nvfp4") and dtype != torch.bfloat16:
            raise ConfigError(
                "quantize.weights.format",
                spec.format,
                f"{layer} is {dtype}; compressed-tensors unpacks FP4 weights to bfloat16, which a {dtype} "
                "model cannot multiply: export a bfloat16 model (model.to(torch.bfloat16) before quantizing)",
            )
        columns = model.get_submodule(layer).weight.shape[1]
        if spec.group_size and columns % spec.group_size:
            raise ConfigError(
                "quantize.weights.group_size",
                spec.group_size,
                f"does not divide {layer}'s {columns} inputs; compressed-tensors needs whole groups",
            )
    return spec, layers


def weight_arguments(spec: GridSpec, arguments: type) -> Any:
    strategy = "group" if spec.group_size else "channel" if spec.per_channel else "tensor"
    if spec.is_float:
        if spec.format not in FLOAT_FORMATS:
            raise ConfigError(
                "quantize.weights.format",
                spec.format,
                f"surgery writes these floating-point weights to compressed-tensors: {', '.join(FLOAT_FORMATS)}",
            )
        if spec.format == "mxfp4":  # E2M1 in blocks of 32, E8M0 scales stored as their exponents
            return arguments(
                num_bits=4, type="float", symmetric=True, strategy="group", group_size=32, scale_dtype=torch.uint8
            )
        if spec.format == "nvfp4":  # E2M1 in blocks of 16, FP8 scales under one global scale
            return arguments(
                num_bits=4,
                type="float",
                symmetric=True,
                strategy="tensor_group",
                group_size=16,
                scale_dtype=torch.float8_e4m3fn,
            )
        return arguments(num_bits=8, type="float", symmetric=True, strategy=strategy, group_size=spec.group_size)
    return arguments(
        num_bits=spec.bits, type="int", symmetric=spec.symmetric, strategy=strategy, group_size=spec.group_size
    )


def _dynamic_input_args(parts: ExportParts, layers: list[str], arguments: type) -> Any:
    """The simulation's dynamic inputs (int or fp8_e4m3, per token or per tensor); int8 per
    token for inputs the simulation left alone or calibrated."""
    grids = _input_grids(parts, layers) if parts.activation_mode == "dynamic" else []
    if not grids:
        return arguments(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True)
    spec = grids[0].spec
    if any(g.spec != spec for g in grids) or (spec.is_float and spec.format not in FLOAT_FORMATS):
        raise ConfigError(
            "quantize.activations",
            spec.as_dict(),
            f"compressed-tensors holds one dynamic input setting, int or {', '.join(FLOAT_FORMATS)}",
        )
    kind = "float" if spec.is_float else "int"
    bits = 8 if spec.is_float else spec.bits
    return arguments(num_bits=bits, type=kind, symmetric=spec.symmetric, strategy=spec.dynamic, dynamic=True)


def _input_grids(parts: ExportParts, layers: list[str]) -> list[ActivationGrid]:
    """The input grid of each layer (none: an empty list), refusing outputs and gaps."""
    if any(where == "output" for _, where, _ in parts.activations):
        raise ConfigError(
            "quantize.where",
            "output",
            "compressed-tensors quantizes the inputs of Linear layers; quantize with where='input' "
            "(or target='compressed-tensors')",
        )
    grids = [parts.activation(layer, "input") for layer in layers]
    if all(g is None for g in grids):
        return []
    missing = [layer for layer, g in zip(layers, grids) if g is None]
    if missing:
        raise ConfigError(
            "export.handle", missing[0], "has quantized weights but unquantized inputs; one scheme is held"
        )
    return grids


def _input_args(parts: ExportParts, layers: list[str], arguments: type) -> Any:
    grids = _input_grids(parts, layers)
    if not grids:
        return None
    if grids[0].dynamic:
        raise ConfigError(
            "export.options.activations", "static", f"{layers[0]}'s inputs are dynamic: they have no static scale"
        )
    spec = grids[0].spec
    if spec.is_float and spec.format in FLOAT_FORMATS and not spec.per_channel and all(g.spec == spec for g in grids):
        return arguments(num_bits=8, type="float", symmetric=True, strategy="tensor", dynamic=False)
    if spec.is_float or spec.bits != 8 or spec.per_channel or any(g.spec != spec for g in grids):
        raise ConfigError(
            "quantize.activations",
            spec.as_dict(),
            "compressed-tensors holds 8-bit per-tensor input scales, the same for every layer",
        )
    return arguments(num_bits=8, type="int", symmetric=spec.symmetric, strategy="tensor", dynamic=False)


def quantization_config_of_schemes(
    ct: Any, schemes: list[Any], model: nn.Module, layers: list[str], conv1d: bool
) -> dict[str, Any]:
    from compressed_tensors.quantization import QuantizationConfig

    ignore = ignored(model, layers, linear_or_conv1d)
    groups = {f"group_{index}": scheme for index, scheme in enumerate(schemes)}
    config = QuantizationConfig(
        config_groups=groups, ignore=ignore, format=mixed_format(schemes), quantization_status="compressed"
    )
    found = {"quant_method": "compressed-tensors", "version": ct.__version__}
    found |= config.model_dump(exclude=["quant_method"])
    if any(_dequantized(scheme, conv1d) for scheme in schemes):  # one scheme (schemes_of refuses a mix)
        found["dequantize"] = True
    return found


def _dequantized(scheme: Any, conv1d: bool) -> bool:
    """Whether transformers must load ``scheme``'s layers dequantized: compressed-tensors 0.20
    builds the model on meta without packing the zero point, so a plain from_pretrained of an
    asymmetric packed folder fails; and its compressed modules are Linear-shaped, where a Conv1D
    is (inputs, outputs). Dequantizing on load serves both."""
    return conv1d or (scheme.format == "pack-quantized" and not scheme.weights.symmetric)


def linear_or_conv1d(module: nn.Module, name: str = "") -> bool:
    """The layers compressed-tensors holds, by the layer-kind table: ``nn.Linear`` and transformers' ``Conv1D``."""
    return is_kind(module, lambda kind: kind.name in ("linear", "hf_conv1d"))


linear_or_conv1d.__name__ = "Linear|Conv1D"


def stored_transposed(module: nn.Module) -> bool:
    """A weight stored ``(in, out)`` (HF ``Conv1D``), as its layer kind says."""
    return input_axis_of(module) == 0
