"""The Hugging Face decoder families GGUF holds, as llama.cpp's converter writes them: the
architecture name and hyperparameters (``{arch}.*`` keys), each parameter's GGUF tensor name,
and the row order of the query and key projections (llama.cpp's ``llama`` architecture rotates
consecutive channel pairs where Hugging Face rotates the two halves of each head, so the
converter permutes those rows; Qwen2/Qwen3 rotate halves, as Hugging Face does).

A family is one :class:`GgufFamily` in :data:`GGUF_FAMILIES` (``register_gguf_family``), keyed
by the config's ``model_type``."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from surgery.core.errors import ConfigError
from surgery.core.registry import Registry

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
Rule = Callable[[Any], "str | None"]  # why a config's value cannot be written (None: it can)


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
    fields: Mapping[str, Rule] = field(default_factory=dict)  # every config field it understands (FieldRules)


def _holds(_config: Any) -> str | None:
    """A field the file holds (a key, or the tensors themselves), or one inference never reads."""
    return None


def _silu(config: Any) -> str | None:
    act = getattr(config, "hidden_act", "silu")
    if act in ("silu", "swish"):  # one function under two names (transformers' ACT2FN)
        return None
    return f"is {act!r}; llama.cpp's graph computes SiLU and GGUF has no key for another"


def _default_rope(config: Any) -> str | None:
    rope = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    if rope.get("rope_type", "default") != "default":
        return f"is {rope['rope_type']!r} rotary embeddings; GGUF is written with default ones"
    extra = sorted(set(rope) - {"rope_type", "rope_theta"})
    return f"sets {', '.join(extra)}, which GGUF is not written with (default rotary embeddings)" if extra else None


def _no_window(config: Any) -> str | None:
    """A sliding window that acts (shorter than the context, on some layer) has no place in these
    architectures' llama.cpp graphs: they attend to every earlier token."""
    window, layers = getattr(config, "sliding_window", None), getattr(config, "layer_types", None)
    limit = getattr(config, "max_position_embeddings", None)
    acts = window is not None and (limit is None or window < limit)
    if acts and (layers is None or "sliding_attention" in layers):
        return (
            f"is {window} with a context of {limit}: llama.cpp's graph for this family attends to every "
            f"earlier token (no sliding window), so outputs past {window} tokens would differ; to write full "
            "attention knowingly, set model.config.sliding_window=None first (the model then computes as the file)"
        )
    return None


def _full_or_sliding(config: Any) -> str | None:
    other = sorted(set(config.layer_types or []) - {"full_attention", "sliding_attention"})
    return f"holds {', '.join(other)}; GGUF is written with full attention" if other else None


def _normalized_top_k(config: Any) -> str | None:
    return None if config.norm_topk_prob is True else "is false; llama.cpp's graph normalizes the top-k expert weights"


_DENSE = "leaves some layers dense; llama.cpp's graph routes every layer to experts"


def _every_layer_routed(config: Any) -> str | None:
    return _DENSE if getattr(config, "decoder_sparse_step", 1) != 1 else None


def _no_dense_layers(config: Any) -> str | None:
    return _DENSE if config.mlp_only_layers else None


def _no_bias(name: str, why: str) -> Rule:
    """A bias flag that must be off: ``why`` says what the file (or llama.cpp's graph) lacks."""
    return lambda config: f"is true; {why}" if getattr(config, name, False) else None


_UNCHECKED_BIAS = (
    "GGUF is written here without these biases (transformers' GGUF loader, which checks the file, drops them)"
)
_QWEN3_BIAS = _no_bias("attention_bias", "llama.cpp's graph for this family has no attention biases")


GENERIC_FIELDS = frozenset(  # PretrainedConfig's own fields and token ids: none changes a decoder's computation
    [
        "_name_or_path",
        "architectures",
        "chunk_size_feed_forward",
        "dtype",
        "torch_dtype",
        "id2label",
        "is_encoder_decoder",
        "label2id",
        "model_type",
        "output_attentions",
        "output_hidden_states",
        "problem_type",
        "return_dict",
        "transformers_version",
        "tokenizer_class",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "use_cache",
        "initializer_range",
        "attention_dropout",
    ]
)
DECODER_FIELDS: dict[str, Rule] = {  # what every family here writes (keys or tensors) or requires
    **dict.fromkeys(
        [
            "hidden_size",
            "num_hidden_layers",
            "intermediate_size",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "rms_norm_eps",
            "vocab_size",
            "max_position_embeddings",
            "tie_word_embeddings",
        ],
        _holds,
    ),
    "hidden_act": _silu,
    "rope_parameters": _default_rope,
    "rope_scaling": _default_rope,
    "rope_theta": _holds,
}
_WINDOW = {  # the window acts through sliding_window (on the layers layer_types marks): checked there
    "sliding_window": _no_window,
    "layer_types": _full_or_sliding,
    **dict.fromkeys(("use_sliding_window", "max_window_layers"), _holds),
}
_EXPERTS = {
    "norm_topk_prob": _normalized_top_k,
    "decoder_sparse_step": _every_layer_routed,
    "mlp_only_layers": _no_dense_layers,
    **dict.fromkeys(
        [
            "num_experts",
            "num_local_experts",
            "num_experts_per_tok",
            "moe_intermediate_size",
            "router_aux_loss_coef",
            "output_router_logits",
        ],
        _holds,
    ),
}

GGUF_FAMILIES: Registry[GgufFamily] = Registry("gguf family", table=True)  # config.model_type -> its family
_BUILT_IN_FAMILIES = {
    "llama": GgufFamily(
        "llama",
        permute_qk=True,
        rope_dimensions=True,
        fields=DECODER_FIELDS
        | {name: _no_bias(name, _UNCHECKED_BIAS) for name in ("attention_bias", "mlp_bias")}
        | {"pretraining_tp": _holds},
    ),
    "mistral": GgufFamily("llama", permute_qk=True, rope_dimensions=True, fields=DECODER_FIELDS | _WINDOW),
    "qwen2": GgufFamily("qwen2", permute_qk=False, fields=DECODER_FIELDS | _WINDOW),
    "qwen3": GgufFamily("qwen3", permute_qk=False, fields=DECODER_FIELDS | _WINDOW | {"attention_bias": _QWEN3_BIAS}),
    "qwen3_moe": GgufFamily(
        "qwen3moe",
        permute_qk=False,
        experts=True,
        fields=DECODER_FIELDS | _WINDOW | _EXPERTS | {"attention_bias": _QWEN3_BIAS},
    ),
}


def register_gguf_family(model_type: str, family: GgufFamily, *, replace: bool = False) -> GgufFamily:
    """Write models whose config's ``model_type`` is ``model_type`` as ``family`` (the built-ins
    are registered in :data:`GGUF_FAMILIES` the same way)."""
    return GGUF_FAMILIES.register(model_type, family, replace=replace)


for _model_type, _family in _BUILT_IN_FAMILIES.items():
    register_gguf_family(_model_type, _family)


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
    family = GGUF_FAMILIES.get(model_type)
    _check_fields(config, model_type, family)
    return family


def _check_fields(config: Any, model_type: str, family: GgufFamily) -> None:
    """Refuse, by name, a config field the family does not understand or a value its llama.cpp
    graph cannot compute: every field that changes the computation is written or refused."""
    if not family.fields:
        return  # a family registered without its field list: taken as it is
    values = config.to_dict() if hasattr(config, "to_dict") else dict(vars(config))
    for name in sorted(values):
        if name in GENERIC_FIELDS:
            continue
        rule = family.fields.get(name)
        if rule is None:
            raise ConfigError(
                "export.format",
                "gguf",
                f"writes {model_type} as llama.cpp's {family.architecture!r}, and config.{name}="
                f"{values[name]!r} is not a field it understands (it may change the computation); "
                "refused rather than dropped",
            )
        reason = rule(config)
        if reason is not None:
            raise ConfigError("export.format", "gguf", f"cannot write {model_type}: config.{name} {reason}")


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


def head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def permute_rows(name: str, config: Any) -> Callable[[Tensor], Tensor] | None:
    """For a query or key projection of a family whose rows llama.cpp orders by rotary pair:
    the permutation of a tensor's first axis (rows, or per-row scales); None for every other."""
    model_type = getattr(config, "model_type", None)
    family = (
        GGUF_FAMILIES.get(model_type) if model_type in GGUF_FAMILIES else family_of(config)
    )  # checked once, by the writer
    if not family.permute_qk or not name.endswith(("attn_q.weight", "attn_k.weight", "attn_q.bias", "attn_k.bias")):
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
