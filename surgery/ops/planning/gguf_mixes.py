"""llama.cpp's mixed file types as plans: ``gguf_mix(model, "Q4_K_M")`` gives every selected
Linear the GGUF type llama.cpp's ``llama-quantize`` gives its tensor under that file type (its
``llama_tensor_get_type`` rules for a dense decoder's tensors), as a :class:`~.plans.Plan` that
``apply`` quantizes with any weight method and ``format="gguf"`` writes as one mixed file."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from surgery.core.errors import ConfigError
from surgery.ops.export.formats.gguf_models import tensor_name
from surgery.ops.planning.choices import choice_named
from surgery.ops.planning.plans import Plan, PlanRow
from surgery.ops.sparsity.pruning import prune_targets


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


def gguf_mix(model: nn.Module, mix: str, *, method: str = "rtn", select: Any = None, exclude: Any = None) -> Plan:
    """The plan of llama.cpp's file type ``mix`` (``Q4_K_M``, ``Q5_K_M``) for ``model`` (a
    Hugging Face decoder GGUF names): each selected Linear (every one but the head by default)
    on the type llama.cpp gives its tensor, quantized with ``method`` when applied."""
    if mix not in GGUF_MIXES:
        raise ConfigError("plan.mix", mix, f"must be one of {', '.join(GGUF_MIXES)}")
    rule = GGUF_MIXES[mix]
    targets = prune_targets(model, select, "lm_head" if select is None and exclude is None else exclude).matched
    layers = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    rows = []
    for key, target in targets.items():
        if not isinstance(target.module, nn.Linear) or target.attribute != "weight":
            continue
        name = tensor_name(key)
        layer = int(name.split(".")[1]) if name.startswith("blk.") else 0
        choice = f"gguf:{rule(name, layer, layers or 1)}"
        shape = (target.module.out_features, target.module.in_features)
        if not choice_named(choice).fits(shape):
            raise ConfigError(
                "plan.mix", mix, f"puts {key} on {choice}, whose blocks do not tile its {shape[1]} inputs"
            )
        rows.append(PlanRow(key.rpartition(".")[0], choice, shape, int(choice_named(choice).bits(shape)) // 8, 0.0))
    choices = sorted({row.choice for row in rows})
    return Plan(rows, sum(row.bytes for row in rows), "rule", f"llama.cpp {mix}", method, choices)
