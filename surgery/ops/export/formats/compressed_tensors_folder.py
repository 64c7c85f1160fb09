"""``format="compressed-tensors"``: a Hugging Face folder (config.json with its
``quantization_config``, safetensors shards, the tokenizer when given) that transformers and vLLM
load, its integer weights packed by compressed-tensors' own compressors from surgery's grids."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from surgery.core.errors import ConfigError, ConfigTypeError
from surgery.core.hf_loading import from_pretrained, load_tokenizer, model_class
from surgery.core.safetensors_streams import write_streamed
from surgery.core.sequential import find_blocks
from surgery.ops.experts.layouts import FusedLayout, fused_experts
from surgery.ops.experts.linearizing import linearized
from surgery.ops.export.format_table import ExportFormat, register_export_format
from surgery.ops.export.formats.checkpoint_names import checkpoint_names, reverted
from surgery.ops.export.formats.compressed_tensors_experts import (
    WHY_PER_EXPERT,
    checkpoint_state,
    expert_weights,
    refuse_expert_settings,
)
from surgery.ops.export.formats.compressed_tensors_schemes import (
    FLOAT_FORMATS,
    linear_or_conv1d,
    quantization_config_of_schemes,
    schemes_of,
    stored_transposed,
    weight_arguments,
    weight_layers,
)
from surgery.ops.export.formats.requirements import required
from surgery.ops.numerics.deployment import ExportParts, WeightGrid
from surgery.ops.numerics.grid import GridSpec
from surgery.ops.numerics.number_formats import E4M3_LARGEST
from surgery.ops.numerics.weight_methods import output_axis
from surgery.ops.quantization.targets import DeployTarget

log = logging.getLogger("surgery")
OPTIONS = ("tokenizer", "max_shard_size", "activations")
TOKENIZER = "export.options.tokenizer"
ACTIVATIONS = ("static", "dynamic", "none")  # input scales: surgery's calibrated ones, per token at run time, none


_FP4_FORMATS = ("mxfp4-pack-quantized", "nvfp4-pack-quantized")


def write_compressed_tensors(parts: ExportParts, path: Path, options: dict[str, Any]) -> dict[str, Any]:
    """Write ``parts.model`` as a compressed-tensors folder at ``path`` (see the module doc)."""
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ConfigError("export.options", unknown, f"format='compressed-tensors' takes {', '.join(OPTIONS)}")
    options = _checked_options(options)
    tokenizer = options.get("tokenizer")
    model = parts.model
    if not hasattr(model, "save_pretrained") or not hasattr(model, "config"):
        raise ConfigError(
            "export.format",
            "compressed-tensors",
            f"writes a Hugging Face folder; {type(model).__name__} is not a transformers model "
            "(use format='torchao', 'onnx' or 'safetensors')",
        )
    ct = required("compressed_tensors", "compressed-tensors")
    mode = options.get("activations", parts.activation_mode)
    if mode not in ACTIVATIONS:
        raise ConfigError("export.options.activations", mode, f"must be one of {', '.join(ACTIVATIONS)}")
    schemes = schemes_of(parts, ct, mode)
    layers = [layer for _, group in schemes for layer in group]
    compressed = {}
    for scheme, group in schemes:
        refuse_expert_settings(model, group, scheme)
        compressor = _compressor(ct, scheme.format)
        compressed |= {layer: _compressed(parts, layer, compressor, scheme, mode) for layer in group}
    _refuse_tied(model, [layer for layer in layers if "weight" not in compressed[layer]])  # packed: renamed
    state = checkpoint_state(model, compressed, WHY_PER_EXPERT)
    path.mkdir(parents=True, exist_ok=True)
    max_shard_size = options.get("max_shard_size", "5GB")
    model.save_pretrained(path, state_dict=state, max_shard_size=max_shard_size, save_original_format=False)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    _add_quantization_config(path, ct, [scheme for scheme, _ in schemes], model, layers)
    dropped = mode == "none" and parts.activations
    left_out = [f"input scales of {len(parts.activations)} layer(s) (activations='none')"] if dropped else []
    # static int8 inputs round as x / scale, ours as x * (1 / scale) (fp8 ones as x / scale, as ours);
    # dynamic ones as ours for float32 (batch, tokens, features) inputs only: compressed-tensors takes
    # a 2-d input's scale over the whole tensor, and a bfloat16 one's in bfloat16
    inputs = schemes[0][0].input_activations  # every group's
    exact = inputs is None or (inputs.type == "float" and not inputs.dynamic)
    exact = exact and all(s.format not in _FP4_FORMATS for s, _ in schemes)  # FP4: bfloat16, scales ÷ a global one
    return {"exact": exact and not left_out, "left_out": left_out}


def _compressed(parts: ExportParts, layer: str, compressor: Any, scheme: Any, mode: str) -> dict[str, Tensor]:
    """``layer``'s tensors as compressed-tensors stores them, by their names inside the layer
    (``weight_packed``, ``weight_scale``, ..., ``input_scale`` for static inputs)."""
    module = parts.model.get_submodule(layer)
    local = _local_state(parts.layer_weight(layer), module.weight, stored_transposed(module))
    found = {key: value.contiguous() for key, value in compressor.compress(local, scheme).items()}
    activation = parts.activation(layer, "input")
    if activation is not None and mode == "static":
        found["input_scale"] = activation.scale.detach().float().reshape(1)
        if not activation.spec.symmetric and not activation.spec.is_float:
            offset = 1 << (activation.spec.bits - 1)
            found["input_zero_point"] = (activation.zero_point.reshape(1) - offset).to(torch.int8)
    return found


def stream_compressed_tensors(handle: Any, path: Path, options: dict[str, Any]) -> dict[str, Any]:
    """Write an offloaded model's quantized result (:func:`surgery.quantize` given
    :func:`surgery.offloaded`'s handle) as a compressed-tensors folder, a shard per block, each
    tensor read from disk as its shard is written: memory holds one block. Its tensors are named
    as the family's checkpoints name them, each quantized expert's layer written per expert, as
    the in-memory export writes them (:mod:`~surgery.ops.export.formats.compressed_tensors_experts`)."""
    if set(options) - {"tokenizer"}:
        raise ConfigError(
            "export.options", sorted(options), "an offloaded model streams to compressed-tensors with tokenizer= only"
        )
    options = _checked_options(options)
    tokenizer = options.get("tokenizer")
    model = handle.model
    if not hasattr(model, "config"):
        raise ConfigError(
            "export.format",
            "compressed-tensors",
            f"writes a Hugging Face folder; {type(model).__name__} is not a transformers model",
        )
    ct = required("compressed_tensors", "compressed-tensors")
    if not handle.grids:
        raise ConfigError(
            "export.handle", "no quantized weights", "format='compressed-tensors' holds quantized weights"
        )
    state = model.state_dict(keep_vars=True)  # the model's own names (experts fused), each read from its file
    plan = _streamed_plan(handle, model, ct)
    path.mkdir(parents=True, exist_ok=True)
    shards = _shards_by_block(model, state)
    weight_map: dict[str, str] = {}
    total = 0
    for index, names in enumerate(shards):
        tensors = _shard_state(model, {name: handle.value_of(state[name]) for name in names}, handle.grids, plan)
        file = f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
        entries = [(key, tuple(value.shape), value.dtype) for key, value in tensors.items()]
        write_streamed(path / file, entries, tensors.__getitem__, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        del tensors
    index_file = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (path / "model.safetensors.index.json").write_text(json.dumps(index_file, indent=2) + "\n")
    model.config.save_pretrained(path)
    if getattr(model, "generation_config", None) is not None and model.can_generate():
        model.generation_config.save_pretrained(path)
    _write_quantization_config(path, plan.config)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return {"exact": plan.scheme.format not in _FP4_FORMATS, "left_out": []}


@dataclass(frozen=True)
class _StreamPlan:
    """What the streamed export writes of each quantized layer (by the model's names, an expert's
    layers as a verb names them): its scheme, compressor, checkpoint name, (output axis, whether
    stored transposed), and the folder's ``quantization_config``; the fused experts' layouts."""

    spec: GridSpec
    scheme: Any
    compressor: Any
    names: dict[str, str]
    axes: dict[str, tuple[int, bool]]
    config: dict[str, Any]
    layouts: dict[str, FusedLayout]


def _streamed_plan(handle: Any, model: nn.Module, ct: Any) -> _StreamPlan:
    """The scheme and names of an offloaded model's quantized layers, refused as the in-memory
    export refuses them; its experts made per-expert layers meanwhile (placeholders: no copy)."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    layouts = fused_experts(model)
    with linearized(model):
        spec, layers = weight_layers(model, dict.fromkeys(handle.grids, handle.spec))
        _refuse_tied(model, layers)
        kinds = sorted({type(model.get_submodule(layer)).__name__ for layer in layers})
        scheme_format = FLOAT_FORMATS[spec.format] if spec.is_float else "pack-quantized"
        weights = weight_arguments(spec, QuantizationArgs)
        scheme = QuantizationScheme(targets=kinds, weights=weights, input_activations=None, format=scheme_format)
        refuse_expert_settings(model, layers, scheme)
        compressor = _compressor(ct, scheme.format)
        names = checkpoint_names(model, layers, WHY_PER_EXPERT)
        modules = {layer: model.get_submodule(layer) for layer in layers}
        axes = {layer: (output_axis(module, "weight"), stored_transposed(module)) for layer, module in modules.items()}
        config = _quantization_config_of(ct, [scheme], model, layers)
    return _StreamPlan(spec, scheme, compressor, names, axes, config, layouts)


def _shard_state(
    model: nn.Module,
    values: dict[str, Tensor],
    grids: Mapping[str, tuple[Tensor, Tensor, int | None]],
    plan: _StreamPlan,
) -> dict[str, Tensor]:
    """One shard's tensors (``values``, by the model's names) under the checkpoint's names, each
    quantized layer's ``weight`` replaced by its compressed tensors, as the in-memory export does;
    only this shard's grids are read (an offloaded run's are read from its stage files)."""
    state = reverted(model, values)
    weights = {**values, **expert_weights(plan.layouts, values)}
    for key in grids:
        if key not in weights:  # another shard's
            continue
        scale, zero_point, axis = grids[key]
        layer = key.rpartition(".")[0]
        out_axis, transposed = plan.axes[layer]
        grid = WeightGrid(key, plan.spec, scale, zero_point, axis, out_axis)
        local = _local_state(grid, weights[key], transposed)
        del state[f"{plan.names[layer]}.weight"]
        compressed = plan.compressor.compress(local, plan.scheme).items()
        state.update({f"{plan.names[layer]}.{name}": value.contiguous() for name, value in compressed})
    return state


def _refuse_tied(model: nn.Module, layers: list[str]) -> None:
    """A quantized weight shared under another name (a head tied to the embeddings) is written
    once, under its first name, as transformers does, and tied again on load: a layer whose
    compressed tensors are no longer called ``weight`` (packed) would load without it."""
    names: dict[int, list[str]] = {}
    for name, value in model.state_dict(keep_vars=True).items():
        names.setdefault(id(value), []).append(name)
    for layer in layers:
        shared = [n for n in names.get(id(model.get_submodule(layer).weight), []) if n != f"{layer}.weight"]
        if shared:
            raise ConfigError(
                "quantize.select",
                layer,
                f"shares its weight with {shared[0].rpartition('.')[0]} (tied), which a compressed-tensors "
                f"folder holds once, unquantized; exclude {layer}",
            )


def _shards_by_block(model: nn.Module, state: dict[str, Tensor]) -> list[list[str]]:
    """The state's names in order, a shard per block (and one per run of names outside blocks);
    a tensor shared under two names (tied embeddings) is written once, as transformers does."""
    blocks = find_blocks(model)
    shards: list[list[str]] = []
    current, seen = None, set()
    for name, value in state.items():
        if id(value) in seen:
            continue
        seen.add(id(value))
        group = next((block for block in blocks if name.startswith(block + ".")), "")
        if not shards or group != current:
            shards.append([])
            current = group
        shards[-1].append(name)
    return shards


def _add_quantization_config(path: Path, ct: Any, schemes: list[Any], model: nn.Module, layers: list[str]) -> None:
    _write_quantization_config(path, _quantization_config_of(ct, schemes, model, layers))


def _quantization_config_of(ct: Any, schemes: list[Any], model: nn.Module, layers: list[str]) -> dict[str, Any]:
    """The folder's ``quantization_config``: ``schemes`` for ``layers``, the other layers ignored."""
    conv1d = any(stored_transposed(model.get_submodule(layer)) for layer in layers)
    return quantization_config_of_schemes(ct, schemes, model, layers, conv1d)


def _write_quantization_config(path: Path, found: dict[str, Any]) -> None:
    """``found`` written into the folder's config.json as its ``quantization_config``."""
    config_file = path / "config.json"
    config = json.loads(config_file.read_text())
    config["quantization_config"] = found
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _local_state(grid: WeightGrid, weight: Tensor, conv1d: bool = False) -> dict[str, Tensor]:
    """The layer's tensors as the compressor takes them: the weight exactly on the grid (float64,
    so that its re-quantization gives back our integers), scales and signed zero points. A
    Conv1D keeps its (inputs, outputs) layout, with one scale per column: (1, outputs)."""
    if grid.spec.is_float:
        exact = weight.detach().float()
    else:  # back in the weight's own layout, whatever the grid (a Conv1D's per-tensor one too)
        exact = grid.in_layout(grid.dequantized(grid.integers(weight), torch.float64), weight.shape)
    scale = grid.scale.float()
    scale = scale.reshape(1) if grid.axis is None else scale.reshape(scale.shape[0], -1)  # (outputs, 1 or groups)
    if conv1d and scale.dim() == 2:  # symmetric, per channel (schemes_of refuses the rest): a scale per column
        scale = scale.t().contiguous()
    local = {"weight": exact, "weight_scale": scale.to(weight.dtype)}
    if grid.spec.format == "nvfp4":
        local.update(_nvfp4_scales(grid))
    if not grid.spec.symmetric and not grid.spec.is_float:  # compressed-tensors' integers are signed: shift ours
        offset = 1 << (grid.spec.bits - 1)
        zero_point = grid.zero_point.reshape(scale.shape) - offset
        local["weight_zero_point"] = zero_point.to(torch.int8)
    return local


def _nvfp4_scales(grid: WeightGrid) -> dict[str, Tensor]:
    """Our NVFP4 scales (FP8 block scales times one per-tensor scale, multiplied out) as
    compressed-tensors stores them: the FP8 block scales and the reciprocal of the per-tensor
    scale (``weight_global_scale``). The largest block scale is the FP8 maximum (448), which
    gives the per-tensor scale back to float32 rounding (so the runtime's weights, block scale
    ÷ global scale, are ours to an ulp of the scale); refused if it does not give every block
    scale back."""
    scale = grid.scale.float()
    outer = scale.max() / E4M3_LARGEST
    inner = (scale / outer).to(torch.float8_e4m3fn)
    if not torch.allclose(inner.float() * outer, scale, rtol=1e-6, atol=0):
        raise ConfigError(
            "quantize.weights.format",
            "nvfp4",
            f"{grid.key}'s block scales do not share one per-tensor scale (scales loaded or set by hand?); "
            "quantize it again with format nvfp4",
        )
    return {"weight_scale": inner.float(), "weight_global_scale": (1.0 / outer).reshape(1)}


def _compressor(ct: Any, name: str) -> Any:
    from compressed_tensors.compressors import BaseCompressor

    try:
        return BaseCompressor.get_value_from_registry(name)
    except Exception:
        raise ConfigError(
            "export.format", "compressed-tensors", f"compressed-tensors {ct.__version__} has no {name!r} compressor"
        ) from None


def _checked_options(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` with the tokenizer loaded; a ``max_shard_size`` transformers cannot read or a
    ``tokenizer`` that is not a tokenizer folder is refused before anything is written."""
    size = options.get("max_shard_size", "5GB")
    if isinstance(size, bool) or not isinstance(size, (int, str)) or (isinstance(size, int) and size < 1):
        raise ConfigError("export.options.max_shard_size", size, "must be a size such as '5GB' or a number of bytes")
    if isinstance(size, str):
        from transformers.utils.hub import convert_file_size_to_int

        try:
            convert_file_size_to_int(size)
        except ValueError:
            raise ConfigError(
                "export.options.max_shard_size", size, "must be a size such as '5GB', '500MB' or a number of bytes"
            ) from None
    tokenizer = options.get("tokenizer")
    if tokenizer is None or hasattr(tokenizer, "save_pretrained"):
        return options
    if not isinstance(tokenizer, (str, Path)):
        raise ConfigTypeError("export.options.tokenizer", type(tokenizer).__name__, "must be a tokenizer or its folder")
    return {**options, "tokenizer": _tokenizer(tokenizer)}


def _tokenizer(tokenizer: Any) -> Any:
    """The tokenizer to save beside the weights, a folder loaded before anything is written (one
    asking to run its own code refused); None for none."""
    return load_tokenizer(tokenizer, TOKENIZER) if isinstance(tokenizer, (str, Path)) else tokenizer


def load_compressed_tensors(path: Path) -> nn.Module:
    """The folder loaded by transformers (its architecture from config.json), in eval mode."""
    import transformers

    config = from_pretrained(transformers.AutoConfig, path, "export.load")
    architecture = config.architectures[0] if config.architectures else None
    loader = (
        transformers.AutoModel if architecture is None else model_class(transformers, architecture, "export.load", path)
    )
    model, info = from_pretrained(loader, path, "export.load", output_loading_info=True)
    wrong = sorted(
        str(k) for kind in ("missing_keys", "unexpected_keys", "mismatched_keys") for k in info.get(kind, [])
    )
    if wrong:
        raise ConfigError(
            "export.load", str(path), f"transformers loaded it with {len(wrong)} wrong key(s): {wrong[0]}"
        )
    return model.eval()


register_export_format(
    ExportFormat(
        "compressed-tensors",
        write_compressed_tensors,
        load=load_compressed_tensors,
        suffix="",
        takes_parts=True,
        folder=True,
        holds_hooks=True,
        exact=False,
        bound=0.9999,
        target=DeployTarget(layers=linear_or_conv1d, activations={"bits": 8, "per_channel": False}),
        stream=stream_compressed_tensors,
    )
)
