"""``format="torchao"``: the model with each quantized Linear weight a torchao ``Int8Tensor`` built
from surgery's own integers and scales (weight-only, dynamic per-token activations, or static
activations with surgery's calibrated scale), pickled whole so ``torch.load`` gives it back."""

from __future__ import annotations

import copy
import pickle
from pathlib import Path
from typing import Any

import torch
from torch import nn

from surgery.core._compat import MODULE_HOOK_DICTS, drop_forward_hooks
from surgery.core.errors import ConfigError, first_line
from surgery.ops.export.format_table import ExportFormat, register_export_format
from surgery.ops.export.formats.requirements import required
from surgery.ops.numerics.deployment import ExportParts
from surgery.ops.quantization.targets import DeployTarget

ACTIVATIONS = ("static", "dynamic", "none")


FLOAT_REFUSAL = (
    "torchao's Int8Tensor holds integer weights; export it with format='compressed-tensors' (fp8_e4m3) or 'safetensors'"
)


def write_torchao(parts: ExportParts, path: Path, options: dict[str, Any]) -> dict[str, Any]:
    """Swap each quantized Linear weight of a copy of ``parts.model`` for an ``Int8Tensor``."""
    unknown = sorted(set(options) - {"activations"})
    if unknown:
        raise ConfigError("export.options", unknown, "format='torchao' takes activations")
    torchao = required("torchao", "torchao")
    mode = options.get("activations", parts.activation_mode)
    if mode not in ACTIVATIONS:
        raise ConfigError("export.options.activations", mode, f"must be one of {', '.join(ACTIVATIONS)}")
    if mode == "static" and not parts.activations:
        raise ConfigError("export.options.activations", mode, "needs activations quantized (where='input')")
    _check_dynamic(parts, mode)
    layers = _layers(parts, torchao.__version__)
    plain = copy.deepcopy(parts.model).eval()
    drop_forward_hooks(plain)
    for layer in layers:
        module = plain.get_submodule(layer)
        tensor = _int8_tensor(parts, layer, module.weight, mode)
        module.weight = nn.Parameter(tensor, requires_grad=False)
        if mode == "static":
            module.__class__ = StaticInt8Linear  # same parameters; inputs of any rank
    try:
        torch.save(plain, str(path))
    except (pickle.PicklingError, AttributeError, TypeError) as err:
        raise _unpicklable(plain, err) from None
    return {"exact": False}


def _unpicklable(model: nn.Module, err: Exception) -> ConfigError:
    """Why the model cannot be pickled whole: the first hook of the user's that pickle refuses
    (a lambda, a local function), else pickle's own reason."""
    for name, module in model.named_modules():
        for kind in MODULE_HOOK_DICTS:
            for hook in getattr(module, kind, {}).values():
                try:
                    pickle.dumps(hook)
                except Exception:  # noqa: BLE001 - any refusal of pickle's is the answer
                    where = f"layer {name!r}" if name else "the model"
                    return ConfigError(
                        "export.format",
                        "torchao",
                        f"pickles the whole model, and {where} holds a {kind.strip('_').replace('_', ' ').replace('hooks', 'hook')} "
                        f"{getattr(hook, '__qualname__', type(hook).__name__)} that cannot be pickled; remove "
                        "that hook before exporting (or register a module-level function)",
                    )
    return ConfigError(
        "export.format", "torchao", f"pickles the whole model, which pickle refuses ({first_line(err, 200)})"
    )


def _check_dynamic(parts: ExportParts, mode: str) -> None:
    """Dynamic inputs in the simulation are torchao's: 8-bit symmetric, one scale per token."""
    for (layer, where, _), grid in parts.activations.items():
        if not grid.dynamic:
            continue
        if mode == "static":
            raise ConfigError(
                "export.options.activations", mode, f"{layer}'s inputs are dynamic: they have no static scale"
            )
        if where != "input" or grid.spec.is_float or grid.spec.bits != 8 or not grid.spec.symmetric:
            raise ConfigError(
                "quantize.activations",
                f"{layer} {where}: {grid.spec.bits}-bit {'symmetric' if grid.spec.symmetric else 'affine'}",
                "torchao quantizes Linear inputs dynamically as 8-bit symmetric integers, per token",
            )
        if grid.spec.dynamic != "token":
            raise ConfigError(
                "quantize.activations.dynamic", grid.spec.dynamic, "torchao's dynamic inputs are per token"
            )


class StaticInt8Linear(nn.Linear):
    """A Linear whose weight is a static-activation ``Int8Tensor``: inputs of any rank are
    flattened to 2-d around it, the rank torchao's per-tensor static scale takes."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x.reshape(-1, x.shape[-1]))
        return out.reshape(*x.shape[:-1], out.shape[-1])


def _layers(parts: ExportParts, version: str) -> list[str]:
    if not parts.weights:
        raise ConfigError("export.handle", "no quantized weights", "format='torchao' holds quantized Linear weights")
    layers = []
    for key, grid in parts.weights.items():
        layer, _, attribute = key.rpartition(".")
        if attribute != "weight" or not isinstance(parts.model.get_submodule(layer), nn.Linear):
            raise ConfigError("export.handle", key, "torchao's int8 tensors replace nn.Linear weights only")
        if grid.spec.bits == 4 and not torch.cuda.is_available():
            raise ConfigError(
                "quantize.weights.bits",
                4,
                f"torchao {version} has no int4 CPU kernel for float32 models; export 8-bit weights",
            )
        if grid.spec.is_float:
            raise ConfigError(
                "quantize.weights.format",
                grid.spec.format,
                f"is a floating-point grid; {FLOAT_REFUSAL}",
            )
        if grid.spec.bits != 8 or not grid.spec.symmetric or grid.group_size:
            raise ConfigError(
                "quantize.weights",
                f"{key}: {grid.spec.bits}-bit {'symmetric' if grid.spec.symmetric else 'affine'}",
                "torchao's Int8Tensor holds 8-bit symmetric weights, per channel or per tensor",
            )
        if parts.activation(layer, "output") is not None:
            raise ConfigError(
                "quantize.where", "output", "torchao quantizes Linear inputs; quantize with where='input'"
            )
        layers.append(layer)
    return layers


def _int8_tensor(parts: ExportParts, layer: str, weight: torch.Tensor, mode: str) -> Any:
    from torchao.quantization import Int8Tensor, MappingType, PerRow, PerTensor
    from torchao.quantization.quantize_.workflows import QuantizeTensorToInt8Kwargs

    grid = parts.layer_weight(layer)
    integers = grid.integers(weight).to(device=weight.device, dtype=torch.int8)  # where the model's copy is
    rows, columns = integers.shape
    scale = grid.scale.float().reshape(-1, 1).expand(rows, 1).contiguous().to(weight.device)
    extra: dict[str, Any] = {}
    if mode == "dynamic":
        extra["act_quant_kwargs"] = QuantizeTensorToInt8Kwargs(granularity=PerRow(), mapping_type=MappingType.SYMMETRIC)
    elif mode == "static":
        activation = parts.activation(layer, "input")
        if activation is None or activation.axis is not None or activation.spec.is_float or activation.spec.bits != 8:
            raise ConfigError("quantize.activations", layer, "static torchao activations need one 8-bit input scale")
        symmetric = activation.spec.symmetric
        extra["act_quant_kwargs"] = QuantizeTensorToInt8Kwargs(
            granularity=PerTensor(), mapping_type=MappingType.SYMMETRIC if symmetric else MappingType.ASYMMETRIC
        )
        extra["act_quant_scale"] = activation.scale.float().reshape(1, 1).to(weight.device)
        if not symmetric:  # torchao's integers are signed: shift ours by 128
            shifted = activation.zero_point.reshape(1, 1) - 128
            extra["act_quant_zero_point"] = shifted.to(device=weight.device, dtype=torch.int8)
    return Int8Tensor(integers.contiguous(), scale, [1, columns], weight.dtype, zero_point=None, **extra)


def load_torchao(path: Path) -> nn.Module:
    """The pickled model (its classes must be importable), in eval mode."""
    required("torchao", "torchao")
    return torch.load(str(path), weights_only=False).eval()


register_export_format(
    ExportFormat(
        "torchao",
        write_torchao,
        load=load_torchao,
        suffix="pt",
        takes_parts=True,
        holds_hooks=True,
        exact=False,
        bound=0.9999,
        target=DeployTarget(
            layers=(nn.Linear,),
            weights={"bits": 8, "symmetric": True, "group_size": None},
            activations={"bits": 8, "symmetric": True, "per_channel": False, "rounding": "reciprocal"},
        ),
    )
)
