"""Real accuracy offline: scikit-learn's 8x8 digits, a small CNN for them and its trained weights.

The module holds:

- :class:`DigitsCNN`, a Conv-BN-ReLU network for 1x8x8 images with Conv2d, BatchNorm2d and
  Linear layers for pruning and quantization to target;
- :func:`digits_split` and :func:`digits_batches`, a fixed, seeded, stratified 80/20 split of
  the 1797 images bundled with scikit-learn (no download);
- :func:`accuracy`, top-1 accuracy that leaves the model's training flags as it found them;
- :func:`train`, deterministic training, and :data:`CHECKPOINT`, the shipped trained weights
  (rebuilt by ``scripts/train_digits_cnn.py``).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn
from torch.nn import functional as F

from surgery.analysis.metrics import accuracy
from surgery.core.errors import ConfigError
from surgery.core.settings import whole_count
from surgery.tasks.base import Metric, Task, register_task

CHECKPOINT: Path = Path(__file__).resolve().parents[1] / "assets" / "digits_cnn.safetensors"
SPLITS = ("train", "test")
TEST_FRACTION = 0.2

Batches = Iterable[tuple[Tensor, Tensor]]


class DigitsCNN(nn.Module):
    """Two Conv-BN-ReLU blocks, a 2x2 max-pool and a two-layer Linear head, for 1x8x8 images.

    Example:
        >>> model = DigitsCNN()
        >>> model(torch.zeros(4, 1, 8, 8)).shape
        torch.Size([4, 10])
    """

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(32)
        self.fc1 = nn.Linear(32 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
        return self.fc2(F.relu(self.fc1(torch.flatten(x, 1))))


def digits_split(split: str, *, seed: int = 0) -> tuple[Tensor, Tensor]:
    """Return the images and labels of one side of the fixed, stratified 80/20 digits split.

    Images are float32 of shape (N, 1, 8, 8) scaled to [0, 1] (pixel / 16); labels are int64.
    Each class is shuffled with a torch generator seeded by ``seed`` and its first 20% goes to
    ``test``, so the split depends on neither scikit-learn's version nor global random state.

    Args:
        split: ``"train"`` or ``"test"``.
        seed: seed of the shuffle; the same seed always gives the same split.

    Raises:
        ConfigError: ``split`` is not ``train`` or ``test``, or scikit-learn is not installed.

    Example:
        >>> images, labels = digits_split("test")
        >>> images.shape, labels.dtype
        (torch.Size([359, 1, 8, 8]), torch.int64)
    """
    if split not in SPLITS:
        raise ConfigError("data.split", split, f"must be one of {', '.join(SPLITS)}")
    images, labels = _load_digits()
    generator = torch.Generator().manual_seed(seed)
    test_parts, train_parts = [], []
    for label in range(int(labels.max()) + 1):
        members = torch.nonzero(labels == label).flatten()
        members = members[torch.randperm(len(members), generator=generator)]
        cut = round(len(members) * TEST_FRACTION)
        test_parts.append(members[:cut])
        train_parts.append(members[cut:])
    index = torch.cat(test_parts if split == "test" else train_parts).sort().values
    return images[index], labels[index]


def digits_batches(
    split: str, batch_size: int, *, limit_batches: int | None = None, seed: int = 0
) -> list[tuple[Tensor, Tensor]]:
    """Cut one side of the digits split into (images, labels) batches in a fixed order.

    Args:
        split: ``"train"`` or ``"test"``.
        batch_size: samples per batch; the last batch may be smaller.
        limit_batches: keep only the first this many batches (all of them when ``None``).
        seed: seed of the split (see :func:`digits_split`).

    Raises:
        ConfigError: a bad ``split``, ``batch_size`` or ``limit_batches``.

    Example:
        >>> batches = digits_batches("test", 64, limit_batches=2)
        >>> len(batches), batches[0][0].shape
        (2, torch.Size([64, 1, 8, 8]))
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError("data.batch_size", batch_size, "must be an integer >= 1")
    if limit_batches is not None and (
        isinstance(limit_batches, bool) or not isinstance(limit_batches, int) or limit_batches < 1
    ):
        raise ConfigError("data.limit_batches", limit_batches, "must be null or an integer >= 1")
    images, labels = digits_split(split, seed=seed)
    batches = list(zip(images.split(batch_size), labels.split(batch_size), strict=True))
    return batches if limit_batches is None else batches[:limit_batches]


def train(seed: int = 0, epochs: int = 8, *, batch_size: int = 32, lr: float = 3e-3) -> DigitsCNN:
    """Train a fresh :class:`DigitsCNN` on the train split with Adam, deterministically.

    Initialisation and shuffling are seeded by ``seed``; torch's global random state is left as
    it was. Training runs on one CPU thread (restored afterwards): the model is too small to
    gain from more, a busy machine slows multi-threaded training ten-fold, and one thread fixes
    the summation order. It takes about a second. Results are repeatable on one machine; other
    machines (CPU kernels, torch versions) may differ in the last bits, not in accuracy.

    Args:
        seed: seed of the initial weights and of the per-epoch shuffle (the split itself is
            always the default one, ``seed=0``, so the test side never leaks into training).
        epochs: passes over the training images.
        batch_size: samples per optimizer step.
        lr: Adam's learning rate, decayed to zero along a cosine.

    Returns:
        The trained model, in eval mode.

    Raises:
        ConfigError: ``epochs`` or ``batch_size`` is below 1, or ``lr`` is not positive.

    Example:
        >>> model = train(seed=0)
        >>> accuracy(model, digits_batches("test", 256)) >= 0.95
        True
    """
    whole_count("train.epochs", epochs, "epochs", at_most=10_000, example=20)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError("train.batch_size", batch_size, "must be an integer >= 1")
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr > 0:
        raise ConfigError("train.lr", lr, "must be a positive number")
    images, labels = digits_split("train")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=[]):
            return _fit(images, labels, seed, epochs, batch_size, lr)
    finally:
        torch.set_num_threads(threads)


def _fit(images: Tensor, labels: Tensor, seed: int, epochs: int, batch_size: int, lr: float) -> DigitsCNN:
    """The training loop of :func:`train`; seeds and consumes torch's global random state."""
    torch.manual_seed(seed)
    model = DigitsCNN()
    shuffle = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    steps = epochs * -(-len(labels) // batch_size)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)
    model.train()
    for _ in range(epochs):
        order = torch.randperm(len(labels), generator=shuffle)
        for index in order.split(batch_size):
            optimizer.zero_grad()
            F.cross_entropy(model(images[index]), labels[index]).backward()
            optimizer.step()
            schedule.step()
    return model.eval()


@functools.lru_cache(maxsize=1)
def _load_digits() -> tuple[Tensor, Tensor]:
    """All 1797 digits from scikit-learn, as (N, 1, 8, 8) float32 in [0, 1] and int64 labels.

    Cached: callers only ever see indexed copies (:func:`digits_split`), never these tensors.
    """
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise ConfigError(
            "data.name", "digits", "needs scikit-learn, which is not installed", hint="pip install scikit-learn"
        ) from None
    bunch = load_digits()
    images = torch.from_numpy(np.asarray(bunch.images, dtype=np.float32) / 16.0).unsqueeze(1)
    return images.contiguous(), torch.from_numpy(np.asarray(bunch.target, dtype=np.int64))


register_task(
    Task(
        "digits",
        pairs=lambda data, split, batch_size, limit: digits_batches(split, batch_size, limit_batches=limit),
        metric=Metric("accuracy", accuracy, higher_is_better=True),
    )
)
