"""The Hugging Face decoder families GGUF holds, as llama.cpp's converter writes them: the
architecture name and hyperparameters (``{arch}.*`` keys), each parameter's GGUF tensor name,
and the row order of the query and key projections (llama.cpp's ``llama`` architecture rotates
consecutive channel pairs where Hugging Face rotates the two halves of each head, so the
converter permutes those rows; Qwen2/Qwen3 rotate halves, as Hugging Face does).

A family is one :class:`GgufFamily` in :data:`GGUF_FAMILIES` (``register_gguf_family``), keyed
by the config's ``model_type``."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from surgery.core.errors import ConfigError

LAYER_NAMES = {  # inside model.layers.N: Hugging Face -> GGUF (blk.N.*)
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",  # a mixture-of-experts layer's router (its experts: gguf_entries)
}
MODEL_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")


@dataclass(frozen=True)
class GgufFamily:
    """How one Hugging Face ``model_type`` is written: its llama.cpp ``architecture``, whether the
    query and key rows are permuted to llama.cpp's rotary pair order, and whether the rotary
    dimension count is written (llama.cpp's ``llama`` reads it); ``experts``: every layer a
    mixture of experts, as llama.cpp's graph for it computes (top-k weights normalized)."""

    architecture: str
    permute_qk: bool
    rope_dimensions: bool = False
    experts: bool = False  # a mixture-of-experts family: every layer routes to experts (normalized top-k)


GGUF_FAMILIES: dict[str, GgufFamily] = {
    "llama": GgufFamily("llama", permute_qk=True, rope_dimensions=True),
    "mistral": GgufFamily("llama", permute_qk=True, rope_dimensions=True),
    "qwen2": GgufFamily("qwen2", permute_qk=False),
    "qwen3": GgufFamily("qwen3", permute_qk=False),
    "qwen3_moe": GgufFamily("qwen3moe", permute_qk=False, experts=True),
}


def register_gguf_family(model_type: str, family: GgufFamily, *, replace: bool = False) -> GgufFamily:
    """Write models whose config's ``model_type`` is ``model_type`` as ``family`` (the built-ins
    are registered in :data:`GGUF_FAMILIES` the same way)."""
    if model_type in GGUF_FAMILIES and not replace:
        raise ConfigError("register_gguf_family", model_type, "is already registered; pass replace=True")
    GGUF_FAMILIES[model_type] = family
    return family


def family_of(config: Any) -> GgufFamily:
    """The family of a Hugging Face ``config``; a model GGUF cannot hold here is refused in one line."""
    model_type = getattr(config, "model_type", None)
    if model_type not in GGUF_FAMILIES:
        raise ConfigError(
            "export.format",
            "gguf",
            f"writes the decoder families {', '.join(sorted(GGUF_FAMILIES))}; this model is "
            f"{model_type or 'not a Hugging Face model (no config.model_type)'}",
        )
    if GGUF_FAMILIES[model_type].experts:
        _check_experts(config)
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if rope.get("rope_type", "default") != "default":
        raise ConfigError(
            "export.format", "gguf", f"writes default rotary embeddings; this model's are {rope['rope_type']!r}"
        )
    return GGUF_FAMILIES[model_type]


def tensor_name(name: str) -> str:
    """The GGUF name of a Hugging Face parameter (``model.layers.3.mlp.up_proj.weight`` ->
    ``blk.3.ffn_up.weight``); one GGUF has no name for is refused in one line."""
    found = _LAYER.match(name)
    if found and found.group(2) in LAYER_NAMES:
        return f"blk.{found.group(1)}.{LAYER_NAMES[found.group(2)]}.{found.group(3)}"
    module, _, kind = name.rpartition(".")
    if module in MODEL_NAMES:
        return f"{MODEL_NAMES[module]}.{kind}"
    raise ConfigError("export.format", "gguf", f"has no tensor name for {name} (a module llama.cpp's graph lacks)")


def _check_experts(config: Any) -> None:
    """llama.cpp's mixture-of-experts graph: every layer routed, the top-k weights normalized."""
    if getattr(config, "norm_topk_prob", True) is not True:
        raise ConfigError(
            "export.format", "gguf", "holds experts whose top-k weights are normalized; this model's are not"
        )
    if getattr(config, "mlp_only_layers", None) or getattr(config, "decoder_sparse_step", 1) != 1:
        raise ConfigError("export.format", "gguf", "holds models whose every layer is a mixture of experts")


def head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def permute_rows(name: str, config: Any) -> Callable[[Tensor], Tensor] | None:
    """For a query or key projection of a family whose rows llama.cpp orders by rotary pair:
    the permutation of a tensor's first axis (rows, or per-row scales); None for every other."""
    if not family_of(config).permute_qk or not name.endswith(
        ("attn_q.weight", "attn_k.weight", "attn_q.bias", "attn_k.bias")
    ):
        return None
    heads = config.num_attention_heads if ".attn_q." in name else config.num_key_value_heads

    def permute(x: Tensor) -> Tensor:
        rows = x.shape[0]
        return x.reshape(heads, 2, rows // heads // 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)

    return permute


def metadata(config: Any, family: GgufFamily) -> list[tuple[str, Any]]:
    """The ``{arch}.*`` hyperparameters llama.cpp (and transformers' GGUF loader) read, as
    (gguf writer method, value) pairs."""
    rope = getattr(config, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    found = [
        ("add_context_length", int(config.max_position_embeddings)),
        ("add_embedding_length", int(config.hidden_size)),
        ("add_block_count", int(config.num_hidden_layers)),
        ("add_feed_forward_length", int(config.intermediate_size)),
        ("add_head_count", int(config.num_attention_heads)),
        ("add_head_count_kv", int(config.num_key_value_heads or config.num_attention_heads)),
        ("add_layer_norm_rms_eps", float(config.rms_norm_eps)),
        ("add_rope_freq_base", float(theta)),
        ("add_vocab_size", int(config.vocab_size)),
        ("add_key_length", head_dim(config)),
        ("add_value_length", head_dim(config)),
    ]
    if family.rope_dimensions:
        found.append(("add_rope_dimension_count", head_dim(config)))
    if family.experts:
        found.append(("add_expert_count", int(config.num_experts)))
        found.append(("add_expert_used_count", int(config.num_experts_per_tok)))
        found.append(("add_expert_feed_forward_length", int(config.moe_intermediate_size)))
    return found


def is_float_tensor(name: str, value: Tensor) -> bool:
    """What llama.cpp keeps in F32 whatever the file type: 1-D tensors (norms, biases), routers."""
    return value.dim() < 2 or name.endswith(("_norm.weight", ".bias", "ffn_gate_inp.weight"))
