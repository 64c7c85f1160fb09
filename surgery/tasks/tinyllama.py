"""A small Llama that really learned something, for measuring calibrated methods the way the
peers do: Hugging Face's ``LlamaForCausalLM`` (RMSNorm, rotary positions, grouped key/value
heads, a gated SiLU MLP) over the bytes of the tiny-LM corpus (:mod:`surgery.tasks.tinylm`),
shipped as a Hugging Face folder (:data:`FOLDER`) that transformers and llm-compressor load.
``scripts/train_tinyllama.py`` retrains it in a few minutes on two cores."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from surgery.core.hf_loading import from_pretrained
from surgery.tasks.tinylm import ASSETS, CONTEXT, seeded, train_on_corpus

FOLDER: Path = ASSETS / "tinyllama"
SHAPE = {
    "vocab_size": 256,  # bytes
    "hidden_size": 128,
    "intermediate_size": 384,  # three groups of 128 into down_proj
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2 * CONTEXT,
    "tie_word_embeddings": False,
}


def build_llama(seed: int = 0) -> Any:
    """A freshly initialised byte-level Llama of :data:`SHAPE` (seeded)."""
    import transformers

    config = transformers.LlamaConfig(**SHAPE, architectures=["LlamaForCausalLM"], bos_token_id=None, eos_token_id=None)
    return seeded(lambda: transformers.LlamaForCausalLM(config), seed)


def train_llama(seed: int = 0, steps: int = 2000, *, batch_size: int = 32, lr: float = 3e-3) -> Any:
    """Train :func:`build_llama` on random windows of the training bytes (see
    :func:`~surgery.tasks.tinylm.train_on_corpus`)."""
    return train_on_corpus(lambda: build_llama(seed), seed, steps, batch_size=batch_size, lr=lr)


def load_llama() -> Any:
    """The shipped trained byte-level Llama (:data:`FOLDER`), in eval mode."""
    import transformers

    return from_pretrained(transformers.LlamaForCausalLM, FOLDER, "tinyllama").eval()
