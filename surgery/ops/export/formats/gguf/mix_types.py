"""llama.cpp's mixed file types (``Q4_K_M``, ``Q5_K_M``): the GGUF type its ``llama-quantize``
gives each tensor of a dense decoder under that file type (its ``llama_tensor_get_type`` rules),
by the tensor's GGUF name, its block and the model's number of blocks."""

from __future__ import annotations

from collections.abc import Callable

from surgery.core.errors import ConfigError


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's choice of the layers whose value and down projections get more bits: the
    first and last eighth, and every third layer between (integer division, as in C)."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def _k_mix(base: str) -> Callable[[str, int, int], str]:
    """``Q4_K_M``/``Q5_K_M``: ``base`` everywhere, ``Q6_K`` for the output head and for the
    value and down projections of :func:`use_more_bits` layers."""

    def kind(name: str, layer: int, layers: int) -> str:
        if name == "output.weight":
            return "Q6_K"
        more = name.endswith(("attn_v.weight", "ffn_down.weight")) and use_more_bits(layer, layers)
        return "Q6_K" if more else base

    return kind


GGUF_MIXES: dict[str, Callable[[str, int, int], str]] = {"Q4_K_M": _k_mix("Q4_K"), "Q5_K_M": _k_mix("Q5_K")}


def mix_type(mix: str, name: str, layers: int) -> str:
    """The type llama.cpp's file type ``mix`` gives the tensor of GGUF name ``name``."""
    layer = int(name.split(".")[1]) if name.startswith("blk.") else 0
    return GGUF_MIXES[mix](name, layer, layers)


def type_name(value: object, field: str, allowed: list[str]) -> str:
    """``value`` as one of the names ``allowed`` (a GGUF type or llama.cpp file type): anything
    else, a list or a number included, refused in one line naming ``field``."""
    if not isinstance(value, str) or value not in allowed:
        raise ConfigError(field, value, f"must be one of {', '.join(allowed)} (one name, a string)")
    return value
