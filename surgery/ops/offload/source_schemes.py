"""Checkpoints that ship quantized, read as the model's float weights: each weight is dequantized
as it is read, to the model's dtype, as transformers' own dequantization computes it on a CPU.

A scheme is named by the folder's ``config.json`` (``quantization_config.quant_method``) and
registered in :data:`SOURCE_SCHEMES`; :class:`DequantizedFiles` puts it in front of the files
(a ``WeightFiles``): the scales it consumes are hidden, each quantized weight is described and
loaded in the model's dtype. Built in: ``fp8`` (DeepSeek's and Qwen's block-scaled FP8,
``weight`` in ``float8_e4m3fn`` beside ``weight_scale_inv``, one float per block).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from surgery.core.errors import ConfigError
from surgery.core.registry import Registry

FIELD = "offloaded.source"


@dataclass(frozen=True)
class SourceScheme:
    """How one kind of quantized checkpoint is read: ``companions(name)`` lists the tensors that
    hold weight ``name``'s scales (a weight stored plain has none in the files),
    ``dequantize(tensors, dtype)`` the float weight from ``name`` and its companions (in that
    order), ``hidden(name)`` whether a tensor of the files is consumed by a weight (never a
    weight of the model), ``stored`` the dtypes only a quantized weight has (one of them without
    its companions is refused), and ``describe(config)`` the scheme in a line for the report."""

    name: str
    companions: Callable[[str], list[str]]
    dequantize: Callable[[list[Tensor], torch.dtype], Tensor]
    hidden: Callable[[str], bool]
    describe: Callable[[Mapping[str, Any]], str]
    stored: tuple[torch.dtype, ...] = ()


SOURCE_SCHEMES: Registry[SourceScheme] = Registry("offloaded.source quantization_config.quant_method", table=True)


def register_source_scheme(scheme: SourceScheme, *, replace: bool = False) -> SourceScheme:
    """Make ``model.offload=true`` and :func:`surgery.offloaded` read folders whose config names
    ``quantization_config.quant_method = scheme.name``."""
    return SOURCE_SCHEMES.register(scheme.name, scheme, replace=replace)


def source_scheme(config: Any, config_path: Path) -> tuple[SourceScheme, str] | None:
    """The scheme a model config's ``quantization_config`` names, and its line for the report;
    None without one; an unknown scheme refused in one line naming it."""
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
    scheme = SOURCE_SCHEMES.get(method)
    return scheme, scheme.describe(settings)


class DequantizedFiles:
    """``files`` (a ``WeightFiles``) with ``scheme``'s weights dequantized to ``dtype`` as they
    are read and its scales hidden: the interface of ``WeightFiles`` (names, describe, load)."""

    def __init__(self, files: Any, scheme: SourceScheme, dtype: torch.dtype) -> None:
        self.files, self.scheme, self.dtype = files, scheme, dtype
        self._quantized: dict[str, list[str]] = {}
        for name in files.names():
            companions = [] if scheme.hidden(name) else scheme.companions(name)
            present = [c for c in companions if c in files]
            if companions and len(present) == len(companions):
                self._quantized[name] = companions
            elif files.describe(name)[1] in scheme.stored:
                missing = next(c for c in companions if c not in files) if companions else "scales"
                raise ConfigError(FIELD, name, f"is stored {scheme.name} without its {missing} in the files")

    @property
    def paths(self) -> list[Path]:
        return self.files.paths

    @property
    def digest(self) -> str | None:
        return self.files.digest

    def identity(self) -> list[dict[str, Any]]:
        return self.files.identity()

    def __contains__(self, name: str) -> bool:
        return name in self.files and not self.scheme.hidden(name)

    def names(self) -> list[str]:
        return [name for name in self.files.names() if not self.scheme.hidden(name)]

    def describe(self, name: str) -> tuple[tuple[int, ...], torch.dtype | str, str]:
        shape, dtype, file = self.files.describe(name)
        return (shape, self.dtype, file) if name in self._quantized else (shape, dtype, file)

    def load(self, name: str) -> Tensor:
        if name not in self._quantized:
            return self.files.load(name)
        tensors = [self.files.load(name), *(self.files.load(c) for c in self._quantized[name])]
        return self.scheme.dequantize(tensors, self.dtype)


def _fp8_companions(name: str) -> list[str]:
    return [f"{name}_scale_inv"] if name.endswith(".weight") else []


def _fp8_dequantize(tensors: list[Tensor], dtype: torch.dtype) -> Tensor:
    """``weight`` (float8) times its block's ``weight_scale_inv``, in float32, rounded once to
    ``dtype``: transformers' ``Fp8Dequantize`` on a CPU (blocks from the scale grid's shape)."""
    weight, scale = tensors
    if weight.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ConfigError(FIELD, str(weight.dtype), "is no fp8 weight dtype beside a weight_scale_inv")
    rows, columns = weight.shape[-2:]
    scale_rows, scale_columns = scale.shape[-2:] if scale.dim() >= 2 else (1, 1)
    if rows % scale_rows or columns % scale_columns:
        raise ConfigError(
            FIELD,
            f"{tuple(weight.shape)}",
            f"is not tiled by its weight_scale_inv grid {tuple(scale.shape)} (one scale per block)",
        )
    values = weight.to(torch.float32).reshape(
        -1, scale_rows, rows // scale_rows, scale_columns, columns // scale_columns
    )
    scales = scale.to(torch.float32).reshape(-1, scale_rows, scale_columns).unsqueeze(-1).unsqueeze(2)
    return (values * scales).to(dtype).reshape(weight.shape)


def _fp8_hidden(name: str) -> bool:
    return name.endswith((".weight_scale_inv", ".activation_scale", ".input_scale"))


def _fp8_describe(settings: Mapping[str, Any]) -> str:
    block = settings.get("weight_block_size")
    fmt = settings.get("fmt", "e4m3")
    return f"fp8 ({fmt}, blocks of {block[0]}x{block[1]})" if block else f"fp8 ({fmt}, one scale per tensor)"


register_source_scheme(
    SourceScheme(
        "fp8",
        _fp8_companions,
        _fp8_dequantize,
        _fp8_hidden,
        _fp8_describe,
        (torch.float8_e4m3fn, torch.float8_e5m2),
    )
)
