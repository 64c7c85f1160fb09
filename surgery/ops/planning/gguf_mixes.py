"""llama.cpp's mixed file types as plans: ``gguf_mix(model, "Q4_K_M")`` gives every selected
Linear the GGUF type llama.cpp's ``llama-quantize`` gives its tensor under that file type (its
``llama_tensor_get_type`` rules for a dense decoder's tensors), as a :class:`~.plans.Plan` that
``apply`` quantizes with any weight method and ``format="gguf"`` writes as one mixed file."""

from __future__ import annotations

from typing import Any

from torch import nn

from surgery.core.errors import ConfigError
from surgery.ops.export.formats.gguf.mix_types import GGUF_MIXES, mix_type, type_name
from surgery.ops.export.formats.gguf.models import family_of, tensor_name
from surgery.ops.planning.choices import choice_named
from surgery.ops.planning.plans import Plan, PlanRow
from surgery.ops.sparsity.pruning import prune_targets


def gguf_mix(model: nn.Module, mix: str, *, method: str = "rtn", select: Any = None, exclude: Any = None) -> Plan:
    """The plan of llama.cpp's file type ``mix`` (``Q4_K_M``, ``Q5_K_M``) for ``model`` (a
    Hugging Face decoder GGUF names): each selected Linear (every one but the head by default)
    on the type llama.cpp gives its tensor, quantized with ``method`` when applied."""
    type_name(mix, "plan.mix", list(GGUF_MIXES))
    family_of(getattr(model, "config", None))  # a model GGUF cannot hold is refused, not planned empty
    fused = next((name for name, p in model.named_parameters() if p.dim() == 3), None)
    if fused is not None:  # a plan of its Linear layers would leave the experts float, and say nothing
        raise ConfigError(
            "plan.mix",
            mix,
            f"plans Linear layers; {fused} is a fused mixture-of-experts weight it would leave float: "
            "quantize the model with target='gguf:<type>' instead",
        )
    targets = prune_targets(model, select, "lm_head" if select is None and exclude is None else exclude).matched
    layers = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    rows = []
    for key, target in targets.items():
        if not isinstance(target.module, nn.Linear) or target.attribute != "weight":
            continue
        choice = f"gguf:{mix_type(mix, tensor_name(key), layers or 1)}"
        shape = (target.module.out_features, target.module.in_features)
        if not choice_named(choice).fits(shape):
            raise ConfigError(
                "plan.mix", mix, f"puts {key} on {choice}, whose blocks do not tile its {shape[1]} inputs"
            )
        rows.append(PlanRow(key.rpartition(".")[0], choice, shape, int(choice_named(choice).bits(shape)) // 8, 0.0))
    choices = sorted({row.choice for row in rows})
    return Plan(rows, sum(row.bytes for row in rows), "rule", f"llama.cpp {mix}", method, choices)
