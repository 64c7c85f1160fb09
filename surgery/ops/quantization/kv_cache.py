"""Key/value cache quantization: the keys and values an attention module stores for later
tokens, rounded where its key and value projections write them.

Hugging Face attention modules of the Llama family (Llama, Mistral, Qwen2, Gemma, Phi-3's
split variants, OPT, ...) compute keys and values with ``k_proj`` and ``v_proj`` Linear
layers. :func:`quantize_kv_cache` fake-quantizes both projections' outputs with static scales
from calibration (activation quantization on exactly those layers). Values are cached as the
projection writes them, so the model computes as if its cache held ``spec``'s values. Keys are
cached after the rotary embedding (a rotation of channel pairs by position; and after a key
norm in Qwen3 and Gemma 3): here they are rounded before it, with per-channel scales of the
unrotated channels, which approximates a cache quantized after it (as vLLM's is) without
being equal to it. :func:`kv_cache_bytes` gives what such a cache holds per token against one
in the model's dtype.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from surgery.core.errors import ConfigError, ConfigTypeError
from surgery.core.verbs import VerbCall, verb
from surgery.ops.numerics.grid import GridSpec
from surgery.ops.numerics.observers import VARIED_RANGES_REQUIRED
from surgery.ops.quantization.quantization import QuantizeHandle, quantize

PROJECTIONS = ("k_proj", "v_proj")
DEFAULT_KV = GridSpec(bits=8, symmetric=True, per_channel=True)  # keys vary by channel (KIVI), values less so


def kv_projections(model: nn.Module) -> dict[str, nn.Linear]:
    """The key and value projections of every attention module (a module whose children
    ``k_proj`` and ``v_proj`` are Linear layers), by qualified name."""
    found: dict[str, nn.Linear] = {}
    for name, children in attention_modules(model).items():
        found.update(zip(projection_names(name), children))
    return found


def projection_names(attention: str) -> list[str]:
    """The qualified names of an attention module's key and value projections."""
    return [f"{attention}.{child}" if attention else child for child in PROJECTIONS]


@dataclass(frozen=True)
class KvCacheSpec:
    """What the cache holds (see :func:`quantize_kv_cache`): the ``grid`` of its keys and values,
    and the ``attention`` modules quantized (their qualified names; None: every one)."""

    grid: GridSpec = DEFAULT_KV
    attention: Sequence[str] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.grid, GridSpec):
            raise ConfigTypeError("kv_cache.grid", self.grid, "must be a GridSpec (e.g. GridSpec(format='fp8_e4m3'))")


@verb("kv_cache", KvCacheSpec, positional="grid", calibration="required")
def quantize_kv_cache(model: nn.Module, spec: KvCacheSpec, call: VerbCall) -> QuantizeHandle:
    """Quantize what the key/value cache holds (see the module docstring): int8 per channel by
    default, or e.g. ``GridSpec(format="fp8_e4m3")``; of the ``attention`` modules named (their
    qualified names), every one by default. Returns the quantize handle (``restore()`` removes
    it exactly).

    ``spec``: a :class:`KvCacheSpec` holding the grid and the attention modules instead.

    Raises:
        ConfigError: the model has no attention module with ``k_proj`` and ``v_proj`` Linear
            layers (a fused ``qkv`` projection cannot be split by hooks), or ``attention`` names
            one it lacks.
    """
    attention, calibration, progress = spec.attention, call.calibration, call.progress
    layers = kv_projections(model)
    if attention is not None:
        layers = _of_attention(layers, attention)
    if not layers:
        raise ConfigError(
            "kv_cache",
            type(model).__name__,
            "has no attention module with k_proj and v_proj Linear layers (a fused qkv projection, "
            "as GPT-2's c_attn, holds keys and values in one output); quantize that layer's output "
            "with quantize(activations=..., select=...) instead",
        )
    required = VARIED_RANGES_REQUIRED.set(True)  # a constant key or value range is degenerate data
    try:
        handle = quantize(
            model, weights=None, activations=spec.grid, select=list(layers), calibration=calibration, progress=progress
        )
    except ConfigError as err:  # the activations quantize() is given are the cache's spec
        if not err.field.startswith("quantize.activations"):
            raise
        field = err.field.replace("quantize.activations", "kv_cache", 1)
        raise ConfigError(field, err.value, err.allowed, err.hint) from None
    finally:
        VARIED_RANGES_REQUIRED.reset(required)
    handle.kind = "kv_cache"
    return handle


def attention_modules(model: nn.Module) -> dict[str, tuple[nn.Linear, nn.Linear]]:
    """Every attention module with ``k_proj`` and ``v_proj`` Linear layers: its qualified name
    and the two projections."""
    found = {}
    for name, module in model.named_modules():
        children = tuple(getattr(module, child, None) for child in PROJECTIONS)
        if all(isinstance(child, nn.Linear) for child in children):
            found[name] = children
    return found


def _of_attention(layers: dict[str, nn.Linear], attention: Sequence[str]) -> dict[str, nn.Linear]:
    """The projections of the named attention modules; a name with none is refused."""
    if isinstance(attention, str):
        attention = [attention]
    if not attention:
        raise ConfigError("kv_cache.attention", list(attention), "names no attention module; pass None for every one")
    kept = {}
    for name in attention:
        found = {key: layers.get(key) for key in projection_names(name)}
        if None in found.values():
            known = sorted({key.rpartition(".")[0] for key in layers})
            raise ConfigError(
                "kv_cache.attention", name, f"is no attention module with k_proj and v_proj; these are: {known}"
            )
        kept.update(found)
    return kept


def kv_cache_bytes(model: nn.Module, spec: GridSpec | None = None) -> int:
    """Bytes the key/value cache holds per token: every key and value projection's outputs,
    at ``spec``'s element size (None: the projections' own dtype)."""
    layers = kv_projections(model)
    if not layers:
        raise ConfigError("kv_cache", type(model).__name__, "has no attention module with k_proj and v_proj")
    if spec is None:
        return sum(layer.out_features * layer.weight.element_size() for layer in layers.values())
    bits = spec.number_format.bits if spec.is_float else spec.bits
    return sum(layer.out_features for layer in layers.values()) * bits // 8
