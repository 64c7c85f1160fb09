"""A small dense Qwen3 that really learned something, a second family beside the tiny Llama for
measuring calibrated methods: Hugging Face's ``Qwen3ForCausalLM`` (the Llama's shape plus an
RMSNorm on every head's queries and keys) over the bytes of the tiny-LM corpus
(:mod:`surgery.tasks.tinylm`), shipped as a Hugging Face folder (:data:`FOLDER`,
``model=hf model.path=shipped model.name=tinyqwen3``) that transformers and llm-compressor load.
``scripts/train_tinyqwen3.py`` retrains it in a few minutes on two cores."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from surgery.core.hf_loading import from_pretrained
from surgery.tasks.tinyllama import SHAPE as LLAMA_SHAPE
from surgery.tasks.tinylm import ASSETS, seeded, train_on_corpus

FOLDER: Path = ASSETS / "tinyqwen3"
SHAPE = {**LLAMA_SHAPE, "head_dim": 32}  # the tiny Llama's shape; Qwen3's head_dim is explicit


def build_qwen3(seed: int = 0) -> Any:
    """A freshly initialised byte-level dense Qwen3 of :data:`SHAPE` (seeded)."""
    import transformers

    config = transformers.Qwen3Config(
        **SHAPE, architectures=["Qwen3ForCausalLM"], bos_token_id=None, eos_token_id=None, pad_token_id=None
    )
    return seeded(lambda: transformers.Qwen3ForCausalLM(config), seed)


def train_qwen3(seed: int = 0, steps: int = 2000, *, batch_size: int = 32, lr: float = 3e-3) -> Any:
    """Train :func:`build_qwen3` on random windows of the training bytes (see
    :func:`~surgery.tasks.tinylm.train_on_corpus`)."""
    return train_on_corpus(lambda: build_qwen3(seed), seed, steps, batch_size=batch_size, lr=lr)


def load_qwen3() -> Any:
    """The shipped trained byte-level dense Qwen3 (:data:`FOLDER`), in eval mode."""
    import transformers

    return from_pretrained(transformers.Qwen3ForCausalLM, FOLDER, "tinyqwen3").eval()
