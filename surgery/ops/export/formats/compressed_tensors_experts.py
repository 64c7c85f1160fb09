"""A compressed-tensors folder of a mixture-of-experts model: each quantized expert layer written
per expert under the name its family's checkpoints use (transformers merges them into its fused
experts as it loads them, dequantized), the routers float and named in the ``ignore`` list."""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from surgery.core.errors import ConfigError
from surgery.ops.experts.layouts import FusedLayout
from surgery.ops.experts.linear_experts import split_tensors
from surgery.ops.experts.routing import linear_experts_in, routers
from surgery.ops.export.formats.checkpoint_names import checkpoint_names, reverted

WHY_PER_EXPERT = "compressed-tensors holds each quantized layer as a Linear weight of its own"


def expert_layers(model: nn.Module, layers: list[str]) -> list[str]:
    """The layers of ``layers`` that are layers of an expert."""
    owners = list(linear_experts_in(model))
    return [layer for layer in layers if any(layer.startswith(f"{name}.") for name in owners)]


def checkpoint_state(model: nn.Module, compressed: dict[str, dict[str, Tensor]], why: str) -> dict[str, Tensor]:
    """The model's state under its checkpoint's names, each quantized layer's ``weight`` replaced
    by its ``compressed`` tensors (by their names inside the layer: ``weight_packed``, ...)."""
    names = checkpoint_names(model, list(compressed), why)
    state = reverted(model, {k: v.detach().cpu().clone() for k, v in model.state_dict().items()})
    for layer, tensors in compressed.items():
        del state[f"{names[layer]}.weight"]
        state.update({f"{names[layer]}.{key}": value for key, value in tensors.items()})
    return state


def expert_weights(layouts: dict[str, FusedLayout], values: dict[str, Tensor]) -> dict[str, Tensor]:
    """The weight of each expert's layer (``{experts}.3.gate_proj.weight``, as a verb names what it
    quantized) split from the fused experts tensors among ``values`` (by the model's names; views);
    ``layouts``: the model's fused experts modules by name."""
    found: dict[str, Tensor] = {}
    for name, layout in layouts.items():
        params = [layout.up_name, "down_proj"] + ([f"{layout.up_name}_bias", "down_proj_bias"] if layout.bias else [])
        if all(f"{name}.{param}" in values for param in params):
            parts = split_tensors(layout, {param: values[f"{name}.{param}"] for param in params})
            found |= {f"{name}.{key}": value for key, value in parts.items() if key.endswith(".weight")}
    return found


def ignored(model: nn.Module, layers: list[str], holds: Any) -> list[str]:
    """The float layers of ``model`` that a loader would otherwise quantize (``holds``: the
    layers the format quantizes; the quantized ``layers`` left out) and its routers, each by its
    module name (transformers matches those) and its checkpoint name (loaders building their
    modules from the checkpoint match those); a layer of an expert by its checkpoint name only."""
    quantized = set(layers)
    floats = [name for name, m in model.named_modules() if holds(m) and name not in quantized]
    floats += [name for name in routers(model) if name not in quantized]
    names = checkpoint_names(model, floats, None)
    inside = set(expert_layers(model, floats))
    found = {names[name] for name in floats if name in names}
    return sorted(found | {name for name in floats if name not in inside})


def refuse_expert_settings(model: nn.Module, layers: list[str], scheme: Any) -> None:
    """Refuse in one line what transformers cannot load into quantized experts: it dequantizes
    them as it merges them (``CompressedTensorsDequantize``), from their packed weights and
    scales alone, so input scales, zero points and NVFP4's global scales would be lost."""
    experts = expert_layers(model, layers)
    if not experts:
        return
    checkpoint_names(model, experts, WHY_PER_EXPERT)  # a family whose checkpoints keep experts fused first
    _refuse_some_experts(model, experts)
    lost = _lost(scheme)
    if lost:
        field, setting, what = lost
        raise ConfigError(
            field,
            setting,
            f"transformers loads compressed-tensors experts ({experts[0]}, ...) dequantized from packed weights "
            f"and scales alone, without {what}; quantize the experts otherwise or leave them float "
            "(exclude='**.experts')",
        )


def _lost(scheme: Any) -> tuple[str, object, str] | None:
    """What of ``scheme`` transformers' expert loading drops: (field, setting, what), or None."""
    if scheme.input_activations is not None:
        return "quantize.activations", "quantized inputs", "input scales (weight-only: quantize.activations=null)"
    if scheme.format == "nvfp4-pack-quantized":
        return "quantize.weights.format", "nvfp4", "NVFP4's per-tensor global scales (mxfp4 or int weights load)"
    if not scheme.weights.symmetric:
        return "quantize.weights.symmetric", False, "zero points (symmetric weights load)"
    return None


def _refuse_some_experts(model: nn.Module, quantized: list[str]) -> None:
    """transformers converts every experts module of a model one way as it loads it (a quantized
    checkpoint: every expert entry dequantized and merged), so a folder with some expert layers
    float and others quantized does not load: every expert layer is quantized, or none."""
    chosen = set(quantized)
    every = [
        f"{name}.{e}.{layer}"
        for name, experts in linear_experts_in(model).items()
        for e, expert in enumerate(experts)
        for layer in ("gate_proj", "up_proj", "down_proj")
        if hasattr(expert, layer)
    ]
    left = [layer for layer in every if layer not in chosen]
    if left:
        raise ConfigError(
            "export.format",
            "compressed-tensors",
            f"transformers loads a model's quantized experts all one way, so every expert layer is quantized "
            f"or none; {left[0]} (and {len(left) - 1} more of {len(every)}) stay float: select every expert "
            "layer, or leave them all float (exclude='**.experts')",
        )
