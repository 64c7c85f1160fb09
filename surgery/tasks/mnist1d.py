"""Real accuracy offline, second task: MNIST-1D (Greydanus 2020) and a small 1-d CNN for it.

MNIST-1D's 40-sample signals are generated procedurally by the ``mnist1d`` package's
``make_dataset`` (no download; its ``get_dataset`` downloads and is not used): 4000 training
and 1000 test signals of ten classes, harder for small models than MNIST. The module holds
:class:`MNIST1DCNN`, :func:`mnist1d_split` / :func:`mnist1d_batches`, :func:`train` and
:data:`CHECKPOINT`, the shipped trained weights (rebuilt by ``scripts/train_mnist1d_cnn.py``).
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn
from torch.nn import functional as F

from surgery.analysis.metrics import accuracy
from surgery.core.errors import ConfigError
from surgery.core.settings import whole_count
from surgery.tasks.base import Metric, Task, register_task
from surgery.tasks.digits import SPLITS

CHECKPOINT: Path = Path(__file__).resolve().parents[1] / "assets" / "mnist1d_cnn.safetensors"
LENGTH = 40

__all__ = ["CHECKPOINT", "MNIST1DCNN", "mnist1d_batches", "mnist1d_split", "train"]


class MNIST1DCNN(nn.Module):
    """Three strided Conv1d-ReLU layers (32 channels) and a two-layer Linear head, for (N, 40)
    signals (or (N, 1, 40)).

    Example:
        >>> MNIST1DCNN()(torch.zeros(4, 40)).shape
        torch.Size([4, 10])
    """

    def __init__(self, channels: int = 32, hidden: int = 128, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(1, channels, 5, stride=2, padding=2)
        self.conv2 = nn.Conv1d(channels, channels, 3, stride=2, padding=1)
        self.conv3 = nn.Conv1d(channels, channels, 3, stride=2, padding=1)
        self.fc1 = nn.Linear(channels * LENGTH // 8, hidden)
        self.fc2 = nn.Linear(hidden, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() == 2:
            x = x.unsqueeze(1)
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.relu(self.conv3(x))
        return self.fc2(F.relu(self.fc1(torch.flatten(x, 1))))


def mnist1d_split(split: str) -> tuple[Tensor, Tensor]:
    """The signals (float32, (N, 40)) and labels (int64) of MNIST-1D's fixed ``train`` (4000)
    or ``test`` (1000) split, as ``make_dataset`` generates them with its default arguments.

    Raises:
        ConfigError: ``split`` is not ``train`` or ``test``, or ``mnist1d`` is not installed.

    Example:
        >>> signals, labels = mnist1d_split("test")
        >>> signals.shape
        torch.Size([1000, 40])
    """
    if split not in SPLITS:
        raise ConfigError("data.split", split, f"must be one of {', '.join(SPLITS)}")
    data = _generate()
    suffix = "" if split == "train" else "_test"
    return data[f"x{suffix}"].clone(), data[f"y{suffix}"].clone()


def mnist1d_batches(split: str, batch_size: int, *, limit_batches: int | None = None) -> list[tuple[Tensor, Tensor]]:
    """One split cut into (signals, labels) batches in a fixed order (the last may be smaller).

    Example:
        >>> len(mnist1d_batches("test", 250))
        4
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError("data.batch_size", batch_size, "must be an integer >= 1")
    if limit_batches is not None and (
        isinstance(limit_batches, bool) or not isinstance(limit_batches, int) or limit_batches < 1
    ):
        raise ConfigError("data.limit_batches", limit_batches, "must be null or an integer >= 1")
    signals, labels = mnist1d_split(split)
    batches = list(zip(signals.split(batch_size), labels.split(batch_size), strict=True))
    return batches if limit_batches is None else batches[:limit_batches]


def train(
    seed: int = 0, epochs: int = 60, *, batch_size: int = 100, lr: float = 3e-3, weight_decay: float = 1e-4
) -> MNIST1DCNN:
    """Train a fresh :class:`MNIST1DCNN` on the training split with AdamW and a cosine schedule,
    on one CPU thread (restored afterwards), seeded; torch's global random state is left as it
    was. About half a minute on one core.

    Example:
        >>> accuracy(train(epochs=60), mnist1d_batches("test", 500)) > 0.9
        True
    """
    whole_count("train.epochs", epochs, "epochs", at_most=10_000, example=60)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError("train.batch_size", batch_size, "must be an integer >= 1")
    signals, labels = mnist1d_split("train")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = MNIST1DCNN()
            shuffle = torch.Generator().manual_seed(seed)
            optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
            steps = epochs * -(-len(labels) // batch_size)
            schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=steps)
            model.train()
            for _ in range(epochs):
                for index in torch.randperm(len(labels), generator=shuffle).split(batch_size):
                    optimizer.zero_grad()
                    F.cross_entropy(model(signals[index]), labels[index]).backward()
                    optimizer.step()
                    schedule.step()
            return model.eval()
    finally:
        torch.set_num_threads(threads)


@functools.lru_cache(maxsize=1)
def _generate() -> dict[str, Tensor]:
    """MNIST-1D from ``make_dataset`` with the package's default arguments (seed 42), as tensors."""
    try:
        from mnist1d.data import get_dataset_args, make_dataset
    except ImportError:
        raise ConfigError(
            "data.kind",
            "mnist1d",
            "needs the mnist1d package, which is not installed",
            hint="pip install 'surgery[cli]'",
        ) from None
    data = make_dataset(get_dataset_args())
    return {
        "x": torch.from_numpy(np.asarray(data["x"], dtype=np.float32)),
        "y": torch.from_numpy(np.asarray(data["y"], dtype=np.int64)),
        "x_test": torch.from_numpy(np.asarray(data["x_test"], dtype=np.float32)),
        "y_test": torch.from_numpy(np.asarray(data["y_test"], dtype=np.int64)),
    }


register_task(
    Task(
        "mnist1d",
        pairs=lambda data, split, batch_size, limit: mnist1d_batches(split, batch_size, limit_batches=limit),
        metric=Metric("accuracy", accuracy, higher_is_better=True),
    )
)
