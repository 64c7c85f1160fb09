"""Checkpoints that ship quantized, read as the model's float weights: each weight is dequantized
as it is read, to the model's dtype, as transformers' own dequantization computes it on a CPU.

A scheme is named by the folder's ``config.json`` (``quantization_config.quant_method``) and
registered in :data:`SOURCE_SCHEMES`; :class:`DequantizedFiles` puts it in front of the files
(a ``WeightFiles``): the parts a quantized weight is stored as (its values, its scales) are
hidden, and the weight is described and loaded under the model's name in the model's dtype.
Built in: ``fp8`` (DeepSeek's and Qwen's block-scaled FP8: ``weight`` in ``float8_e4m3fn``
beside ``weight_scale_inv``, one float per block), ``mxfp4`` (GPT-OSS's experts:
``<name>_blocks``, two E2M1 values a byte, and ``<name>_scales``, one E8M0 exponent per 32) and
``compressed-tensors`` (each module's serialized tensors decompressed by that library).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from surgery.core.errors import ConfigError
from surgery.core.registry import Registry
from surgery.ops.offload.offloaded_conversion import FilesView

FIELD = "offloaded.source"

Parts = dict[str, list[str]]  # a quantized weight's name -> the files' tensors it is read from, in order


@dataclass(frozen=True)
class SourceScheme:
    """How one kind of quantized checkpoint is read.

    ``quantized(files, settings)``: each quantized weight the files hold (the model's name) and the
    tensors it is stored as, in the order ``dequantize`` takes them (a weight whose parts are
    incomplete is refused there, in one line); ``shape(parts, load)``: the weight's shape from
    its parts' (name -> (shape, dtype); ``load(name)`` reads a part, for a shape stored as a tensor); ``dequantize(parts, dtype, settings)``: the float weight from its
    parts (name -> tensor) and the config's ``quantization_config``; ``hidden(name)``: a tensor
    of the files that belongs to no weight of the model (an activation scale);
    ``describe(settings)``: the scheme in a line for the report."""

    name: str
    quantized: Callable[[Any, Mapping[str, Any]], Parts]
    shape: Callable[[dict[str, tuple[tuple[int, ...], Any]], Callable[[str], Tensor]], tuple[int, ...]]
    dequantize: Callable[[dict[str, Tensor], torch.dtype, Mapping[str, Any]], Tensor]
    describe: Callable[[Mapping[str, Any]], str]
    hidden: Callable[[str], bool] = lambda name: False


SOURCE_SCHEMES: Registry[SourceScheme] = Registry("offloaded.source quantization_config.quant_method", table=True)


def register_source_scheme(scheme: SourceScheme, *, replace: bool = False) -> SourceScheme:
    """Make ``model.offload=true`` and :func:`surgery.offloaded` read folders whose config names
    ``quantization_config.quant_method = scheme.name``."""
    return SOURCE_SCHEMES.register(scheme.name, scheme, replace=replace)


def source_scheme(config: Any, config_path: Path) -> tuple[SourceScheme, dict[str, Any]] | None:
    """The scheme a model config's ``quantization_config`` names, and those settings; None
    without one; an unknown scheme refused in one line naming it."""
    found = getattr(config, "quantization_config", None)
    if found is None:
        return None
    settings = found if isinstance(found, Mapping) else found.to_dict() if hasattr(found, "to_dict") else vars(found)
    method = settings.get("quant_method")
    method = getattr(method, "value", method)  # transformers' QuantizationMethod enum
    if method not in SOURCE_SCHEMES:
        raise ConfigError(
            FIELD,
            str(config_path),
            f"is quantized with quant_method={method!r}, which surgery does not read offloaded; "
            f"it reads {', '.join(SOURCE_SCHEMES.names())} (or load the model in memory, dequantized)",
        )
    return SOURCE_SCHEMES.get(method), dict(settings)


class DequantizedFiles(FilesView):
    """``files`` (a ``WeightFiles``) with ``scheme``'s weights dequantized to ``dtype`` as they
    are read, under the model's names, their parts hidden: the interface of ``WeightFiles``."""

    def __init__(self, files: Any, scheme: SourceScheme, settings: Mapping[str, Any], dtype: torch.dtype) -> None:
        self.files, self.scheme, self.settings, self.dtype = files, scheme, settings, dtype
        self.parts = scheme.quantized(files, settings)
        self._hidden = {part for parts in self.parts.values() for part in parts} - set(self.parts)
        self._hidden |= {name for name in files.names() if scheme.hidden(name)}

    def __contains__(self, name: str) -> bool:
        return name in self.parts or (name in self.files and name not in self._hidden)

    def names(self) -> list[str]:
        stored = [name for name in self.files.names() if name not in self._hidden]
        return [*stored, *(name for name in self.parts if name not in self.files)]

    def describe(self, name: str) -> tuple[tuple[int, ...], torch.dtype | str, str]:
        if name not in self.parts:
            return self.files.describe(name)
        described = {part: self.files.describe(part) for part in self.parts[name]}
        shapes = {part: (shape, dtype) for part, (shape, dtype, _) in described.items()}
        return self.scheme.shape(shapes, self.files.load), self.dtype, next(iter(described.values()))[2]

    def load(self, name: str) -> Tensor:
        if name not in self.parts:
            return self.files.load(name)
        parts = {part: self.files.load(part) for part in self.parts[name]}
        return self.scheme.dequantize(parts, self.dtype, self.settings)


FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _fp8_block(shape: tuple[int, ...], grid: tuple[int, ...], settings: Mapping[str, Any]) -> tuple[int, int]:
    """The rows and columns one scale covers: the config's ``weight_block_size`` (the last block
    of a dimension it does not divide is shorter: DeepSeek's 576 rows in blocks of 128), else
    the weight's shape over the scale grid's (one scale per tensor: the whole weight)."""
    block = settings.get("weight_block_size")
    if block:
        return int(block[0]), int(block[1])
    rows, columns = shape[-2:]
    grid_rows, grid_columns = grid[-2:] if len(grid) >= 2 else (1, 1)
    return -(-rows // grid_rows), -(-columns // grid_columns)


def _fp8_quantized(files: Any, settings: Mapping[str, Any]) -> Parts:
    """Every weight stored in float8 with its ``weight_scale_inv``; one without it, or with a
    scale grid that does not match its blocks, is refused."""
    found: Parts = {}
    for name in files.names():
        if files.describe(name)[1] not in FP8:
            continue
        scale = f"{name}_scale_inv"
        if scale not in files:
            raise ConfigError(FIELD, name, f"is stored fp8 without its {scale.rsplit('.', 1)[-1]} in the files")
        shape, grid = files.describe(name)[0], files.describe(scale)[0]
        rows, columns = _fp8_block(shape, grid, settings)
        expected = [-(-shape[-2] // rows), -(-shape[-1] // columns)]
        if len(grid) >= 2 and list(grid[-2:]) != expected or len(grid) < 2 and grid and grid[0] != 1:
            raise ConfigError(
                FIELD,
                name,
                f"is {list(shape)} in blocks of {rows}x{columns}, which take a {expected} weight_scale_inv; "
                f"the files hold {list(grid)}",
            )
        found[name] = [name, scale]
    return found


def _fp8_dequantize(parts: dict[str, Tensor], dtype: torch.dtype, settings: Mapping[str, Any]) -> Tensor:
    """``weight`` (float8) times its block's ``weight_scale_inv``, in float32, rounded once to
    ``dtype`` (transformers' ``Fp8Dequantize`` on a CPU where the blocks divide the weight);
    ``uint8`` scales are E8M0 exponents, ``2^(byte - 127)``."""
    weight, scale = parts.values()
    factors = (scale.to(torch.float32) - 127.0).exp2() if scale.dtype == torch.uint8 else scale.to(torch.float32)
    rows, columns = weight.shape[-2:]
    block_rows, block_columns = _fp8_block(tuple(weight.shape), tuple(scale.shape), settings)
    factors = factors.reshape(-1, *(factors.shape[-2:] if factors.dim() >= 2 else (1, 1)))
    spread = factors.repeat_interleave(block_rows, -2)[..., :rows, :].repeat_interleave(block_columns, -1)
    return (weight.to(torch.float32) * spread[..., :columns].reshape(weight.shape)).to(dtype)


def _fp8_describe(settings: Mapping[str, Any]) -> str:
    block = settings.get("weight_block_size")
    fmt = settings.get("fmt", "e4m3")
    return f"fp8 ({fmt}, blocks of {block[0]}x{block[1]})" if block else f"fp8 ({fmt}, one scale per tensor)"


register_source_scheme(
    SourceScheme(
        "fp8",
        _fp8_quantized,
        lambda parts, load: next(iter(parts.values()))[0],
        _fp8_dequantize,
        _fp8_describe,
        hidden=lambda name: name.endswith((".activation_scale", ".input_scale")),
    )
)


E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)  # a nibble's value


def _mxfp4_quantized(files: Any, settings: Mapping[str, Any]) -> Parts:
    """Every ``<name>_blocks`` with its ``<name>_scales`` (one per block of 16 bytes), read as ``<name>``."""
    found: Parts = {}
    for name in files.names():
        if not name.endswith("_blocks"):
            continue
        weight = name.removesuffix("_blocks")
        scales = f"{weight}_scales"
        if scales not in files:
            raise ConfigError(FIELD, name, f"is stored mxfp4 without its {scales.rsplit('.', 1)[-1]}")
        blocks_shape, scales_shape = files.describe(name)[0], files.describe(scales)[0]
        if tuple(blocks_shape[:-1]) != tuple(scales_shape):
            raise ConfigError(
                FIELD, name, f"is {list(blocks_shape)} and its scales {list(scales_shape)}: one scale a block of bytes"
            )
        found[weight] = [name, scales]
    return found


def _mxfp4_shape(parts: dict[str, tuple[tuple[int, ...], Any]], load: Callable[[str], Tensor]) -> tuple[int, ...]:
    """``(experts, rows, groups, 16)`` blocks hold ``(experts, groups * 32, rows)`` (transposed)."""
    *prefix, rows, groups, width = next(iter(parts.values()))[0]
    return (*prefix, groups * width * 2, rows)


def _mxfp4_dequantize(parts: dict[str, Tensor], dtype: torch.dtype, settings: Mapping[str, Any]) -> Tensor:
    """Each nibble's E2M1 value in ``dtype`` (low nibble first) scaled by ``2^(scale - 127)``, the
    last two dimensions swapped: transformers' ``convert_moe_packed_tensors`` (GPT-OSS)."""
    blocks, scales = parts.values()
    if blocks.shape[:-1] != scales.shape:
        raise ConfigError(FIELD, f"{tuple(blocks.shape)}", f"blocks do not match their scales {tuple(scales.shape)}")
    table = torch.tensor(E2M1, dtype=dtype)
    packed = blocks.to(torch.uint8)
    values = torch.empty(*packed.shape[:-1], packed.shape[-1] * 2, dtype=dtype)
    values[..., 0::2] = table[(packed & 0x0F).to(torch.int)]
    values[..., 1::2] = table[(packed >> 4).to(torch.int)]
    exponents = scales.to(torch.int32).unsqueeze(-1) - 127
    torch.ldexp(values, exponents, out=values)  # in place: one copy of the expert's values, rounded once
    *prefix, rows, groups, width = values.shape
    return values.reshape(*prefix, rows, groups * width).transpose(-2, -1).contiguous()


register_source_scheme(
    SourceScheme(
        "mxfp4",
        _mxfp4_quantized,
        _mxfp4_shape,
        _mxfp4_dequantize,
        lambda settings: "mxfp4 (E2M1 values, an E8M0 scale per 32: GPT-OSS's experts)",
    )
)


CT_PARTS = ("weight", "weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_global_scale")


def _ct_quantized(files: Any, settings: Mapping[str, Any]) -> Parts:
    """Every module stored with a ``weight_scale``: its ``weight`` read from its serialized parts."""
    names = set(files.names())
    found: Parts = {}
    for name in files.names():
        if not name.endswith(".weight_scale"):
            continue
        module = name.removesuffix(".weight_scale")
        _ct_scheme(settings, module)  # its config group, one: refused when opened, not in the middle of a run
        found[f"{module}.weight"] = [f"{module}.{part}" for part in CT_PARTS if f"{module}.{part}" in names]
    return found


def _ct_shape(parts: dict[str, tuple[tuple[int, ...], Any]], load: Callable[[str], Tensor]) -> tuple[int, ...]:
    """A float-quantized weight's own shape; a packed one's as stored beside it (``weight_shape``),
    or, for FP4 packed two values a byte without it (NVFP4), its packed shape twice as wide."""
    for name, (shape, _) in parts.items():
        if name.endswith(".weight"):
            return shape
    stored = next((name for name in parts if name.endswith(".weight_shape")), None)
    if stored is not None:
        return tuple(int(n) for n in load(stored).tolist())
    packed = next(((shape, dtype) for name, (shape, dtype) in parts.items() if name.endswith(".weight_packed")), None)
    if packed is None or packed[1] != torch.uint8:
        raise ConfigError(FIELD, next(iter(parts)), "is packed without its weight_shape in the files")
    return (*packed[0][:-1], packed[0][-1] * 2)


@functools.lru_cache(maxsize=8)
def _ct_config(settings_json: str) -> Any:
    """compressed-tensors' own parse of a ``quantization_config`` (once per folder, not per read)."""
    try:
        from compressed_tensors.quantization import QuantizationConfig
    except ImportError as err:
        raise ConfigError(
            FIELD, "compressed-tensors", f"needs its library: pip install 'surgery[deploy]' ({err})"
        ) from None

    settings = json.loads(settings_json)
    return QuantizationConfig.model_validate({k: v for k, v in settings.items() if k != "quant_method"})


def _ct_scheme(settings: Mapping[str, Any], module: str) -> Any:
    """The config group quantizing ``module``: the one group, or the one whose ``re:`` target
    matches its name, or else the one targeting layers by class (``Linear``)."""
    config = _ct_config(json.dumps(settings, sort_keys=True, default=str))
    groups = list(config.config_groups.values())
    matched = [g for g in groups if any(t.startswith("re:") and re.match(t[3:], module) for t in g.targets)]
    by_class = [g for g in groups if any(not t.startswith("re:") for t in g.targets)]
    found = matched or by_class or groups
    if len(found) != 1:
        raise ConfigError(FIELD, module, f"is matched by {len(found)} compressed-tensors config groups; one is read")
    return found[0], config.format


def _ct_dequantize(parts: dict[str, Tensor], dtype: torch.dtype, settings: Mapping[str, Any]) -> Tensor:
    """The module's serialized tensors decompressed by compressed-tensors' own compressor for its
    group's format, cast to ``dtype``: what transformers' ``CompressedTensorsDequantize`` does."""
    from compressed_tensors.compressors import BaseCompressor

    module = next(iter(parts)).rsplit(".", 1)[0]
    scheme, default_format = _ct_scheme(settings, module)
    compressor = BaseCompressor.get_value_from_registry(scheme.format or default_format)
    local = {name.removeprefix(f"{module}."): tensor for name, tensor in parts.items()}
    return compressor.decompress(local, scheme)["weight"].to(dtype)


def _ct_describe(settings: Mapping[str, Any]) -> str:
    groups = settings.get("config_groups") or {}
    formats = sorted({str(g.get("format") or settings.get("format")) for g in groups.values()})
    bits = sorted({str((g.get("weights") or {}).get("num_bits")) for g in groups.values()})
    return f"compressed-tensors ({', '.join(formats)}; {'/'.join(bits)}-bit weights)"


register_source_scheme(SourceScheme("compressed-tensors", _ct_quantized, _ct_shape, _ct_dequantize, _ct_describe))
