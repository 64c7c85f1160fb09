"""A small Llama that really learned something, for measuring calibrated methods the way the
peers do: Hugging Face's ``LlamaForCausalLM`` (RMSNorm, rotary positions, grouped key/value
heads, a gated SiLU MLP) over the bytes of the tiny-LM corpus (:mod:`surgery.tasks.tinylm`),
shipped as a Hugging Face folder (:data:`FOLDER`) that transformers and llm-compressor load.
``scripts/train_tinyllama.py`` retrains it in a few minutes on two cores."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F

from surgery.core.errors import ConfigError
from surgery.tasks.tinylm import ASSETS, CONTEXT, tokens

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
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return transformers.LlamaForCausalLM(config).eval()


def train_llama(seed: int = 0, steps: int = 2000, *, batch_size: int = 32, lr: float = 3e-3) -> Any:
    """Train :func:`build_llama` on random windows of the training bytes with AdamW and a
    one-cycle schedule, seeded; torch's global random state is left as it was."""
    for field, value in (("train.steps", steps), ("train.batch_size", batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(field, value, "must be an integer >= 1")
    data = tokens("train")
    model = build_llama(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        sampler = torch.Generator().manual_seed(seed)
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
        schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=steps)
        model.train()
        for _ in range(steps):
            starts = torch.randint(0, len(data) - CONTEXT - 1, (batch_size,), generator=sampler)
            window = torch.stack([data[s : s + CONTEXT + 1] for s in starts.tolist()])
            logits = model(window[:, :-1]).logits
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), window[:, 1:].reshape(-1))
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
    return model.eval()


def load_llama() -> Any:
    """The shipped trained byte-level Llama (:data:`FOLDER`), in eval mode."""
    import transformers

    return transformers.LlamaForCausalLM.from_pretrained(FOLDER, local_files_only=True).eval()
