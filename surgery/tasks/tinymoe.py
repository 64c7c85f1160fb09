"""A small mixture-of-experts model that really learned something, for measuring expert pruning:
Hugging Face's ``Qwen3MoeForCausalLM`` (8 experts a layer, each token routed to 2) over the bytes of
the tiny-LM corpus (:mod:`surgery.tasks.tinylm`), shipped as a Hugging Face folder (:data:`FOLDER`,
``model=hf model.path=shipped model.name=tinymoe``). ``scripts/train_tinymoe.py`` retrains it in a
few minutes on two cores."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from surgery.core.hf_loading import from_pretrained
from surgery.tasks.tinylm import ASSETS, CONTEXT, seeded, train_on_corpus

FOLDER: Path = ASSETS / "tinymoe"
SHAPE = {
    "vocab_size": 256,  # bytes
    "hidden_size": 64,
    "intermediate_size": 128,  # unused: every layer is a mixture-of-experts layer
    "moe_intermediate_size": 64,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 2 * CONTEXT,
    "tie_word_embeddings": False,
}


def build_moe(seed: int = 0) -> Any:
    """A freshly initialised byte-level Qwen3-MoE of :data:`SHAPE` (seeded)."""
    import transformers

    config = transformers.Qwen3MoeConfig(
        **SHAPE, architectures=["Qwen3MoeForCausalLM"], bos_token_id=None, eos_token_id=None, pad_token_id=None
    )
    return seeded(lambda: transformers.Qwen3MoeForCausalLM(config), seed)


def train_moe(seed: int = 0, steps: int = 400, *, batch_size: int = 16, lr: float = 3e-3) -> Any:
    """Train :func:`build_moe` on random windows of the training bytes (see
    :func:`~surgery.tasks.tinylm.train_on_corpus`)."""
    return train_on_corpus(lambda: build_moe(seed), seed, steps, batch_size=batch_size, lr=lr)


def load_moe() -> Any:
    """The shipped trained byte-level Qwen3-MoE (:data:`FOLDER`), in eval mode."""
    import transformers

    return from_pretrained(transformers.Qwen3MoeForCausalLM, FOLDER, "tinymoe").eval()
