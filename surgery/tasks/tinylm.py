"""Real perplexity offline: a tiny decoder-only transformer language model and its corpus.

:class:`TinyLM` is GPT-2's shape in miniature (learned positions, pre-LayerNorm blocks of
causal self-attention and a GELU MLP, a ``ModuleList`` of blocks that sequential calibration
finds) over bytes, so it needs no tokenizer. Its corpus is English prose from the docstrings
of Python's standard library, shipped gzipped (``scripts/make_tinylm_corpus.py``); the last
10 % is held out. :func:`perplexity` is the held-out measure, :data:`CHECKPOINT` the shipped
weights (``scripts/train_tinylm.py`` retrains them in a few minutes on two cores).
"""

from __future__ import annotations

import functools
import gzip
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from surgery.analysis.metrics import perplexity
from surgery.core.errors import ConfigError
from surgery.core.settings import whole_count
from surgery.tasks.base import Metric, Task, register_task
from surgery.tasks.digits import SPLITS

ASSETS = Path(__file__).resolve().parents[1] / "assets"
CHECKPOINT: Path = ASSETS / "tinylm.safetensors"
CORPUS: Path = ASSETS / "tinylm_corpus.txt.gz"
CONTEXT = 128
HELD_OUT = 0.1


class Block(nn.Module):
    """Pre-LayerNorm causal self-attention and GELU MLP, each with a residual connection."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.fc, self.out = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: Tensor) -> Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(batch, length, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, length, width))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyLM(nn.Module):
    """A byte-level decoder-only transformer: ``TinyLM()(ids)`` gives (N, T, 256) logits.

    Example:
        >>> TinyLM()(torch.zeros(2, 16, dtype=torch.long)).shape
        torch.Size([2, 16, 256])
    """

    def __init__(self, width: int = 128, layers: int = 4, heads: int = 4, num_classes: int = 256) -> None:
        super().__init__()
        self.embed = nn.Embedding(num_classes, width)
        self.position = nn.Embedding(CONTEXT, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, num_classes, bias=False)

    def forward(self, ids: Tensor) -> Tensor:
        if ids.shape[-1] > CONTEXT:
            raise ConfigError("data", f"{ids.shape[-1]} tokens", f"TinyLM reads at most {CONTEXT} tokens at once")
        x = self.embed(ids) + self.position(torch.arange(ids.shape[-1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


@functools.lru_cache(maxsize=1)
def _corpus() -> Tensor:
    with gzip.open(CORPUS, "rb") as handle:
        return torch.frombuffer(bytearray(handle.read()), dtype=torch.uint8).long()


def tokens(split: str) -> Tensor:
    """The corpus bytes of one side of the fixed 90/10 split (``train`` or ``test``), int64."""
    if split not in SPLITS:
        raise ConfigError("data.split", split, f"must be one of {', '.join(SPLITS)}")
    data = _corpus()
    cut = int(len(data) * (1 - HELD_OUT))
    return (data[:cut] if split == "train" else data[cut:]).clone()


def token_batches(
    split: str, batch_size: int, *, limit_batches: int | None = None, length: int = CONTEXT
) -> list[tuple[Tensor, Tensor]]:
    """Consecutive, non-overlapping windows of ``length`` bytes as ``(inputs, next bytes)``
    batches in a fixed order: the targets are the inputs shifted by one.

    Example:
        >>> inputs, targets = token_batches("test", 8, limit_batches=1)[0]
        >>> inputs.shape, torch.equal(inputs[0, 1:], targets[0, :-1])
        (torch.Size([8, 128]), True)
    """
    for field, value in (("data.batch_size", batch_size), ("data.limit_batches", limit_batches)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError(field, value, "must be an integer >= 1" + (" or null" if "limit" in field else ""))
    data = tokens(split)
    windows = (len(data) - 1) // length
    inputs = data[: windows * length].view(windows, length)
    targets = data[1 : windows * length + 1].view(windows, length)
    batches = list(zip(inputs.split(batch_size), targets.split(batch_size), strict=True))
    return batches if limit_batches is None else batches[:limit_batches]


def train(seed: int = 0, steps: int = 3000, *, batch_size: int = 32, lr: float = 2e-3) -> TinyLM:
    """Train a fresh :class:`TinyLM` on random windows of the training bytes (see
    :func:`train_on_corpus`)."""
    return train_on_corpus(TinyLM, seed, steps, batch_size=batch_size, lr=lr)


def seeded(build: Callable[[], nn.Module], seed: int) -> nn.Module:
    """``build()`` with its initialisation seeded by ``seed`` (the global generator left as it was), in eval mode."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build().eval()


def train_on_corpus(build: Callable[[], nn.Module], seed: int, steps: int, *, batch_size: int, lr: float) -> Any:
    """Train ``build()`` (a next-byte model: logits, or an output with ``.logits``) on random
    windows of the training bytes with AdamW and a one-cycle schedule, seeded, on the caller's
    threads; torch's global random state is left as it was."""
    whole_count("train.steps", steps, "steps", at_most=1_000_000, example=3000)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError("train.batch_size", batch_size, "must be an integer >= 1")
    data = tokens("train")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = build()
        sampler = torch.Generator().manual_seed(seed)
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
        schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=steps)
        model.train()
        for _ in range(steps):
            starts = torch.randint(0, len(data) - CONTEXT - 1, (batch_size,), generator=sampler)
            window = torch.stack([data[s : s + CONTEXT + 1] for s in starts.tolist()])
            logits = model(window[:, :-1])
            logits = getattr(logits, "logits", logits)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), window[:, 1:].reshape(-1))
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
    return model.eval()


register_task(
    Task(
        "tinylm",
        pairs=lambda data, split, batch_size, limit: token_batches(split, batch_size, limit_batches=limit),
        metric=Metric("perplexity", perplexity, higher_is_better=False),
    )
)
