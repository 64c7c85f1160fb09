"""Image folders: a torchvision ``ImageFolder`` of class sub-folders, read lazily, scored by
top-1 accuracy."""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from surgery.analysis.metrics import accuracy
from surgery.core.errors import ConfigError
from surgery.tasks.base import Metric, Task, register_task
from surgery.tasks.synthetic import check_fits_in_memory

log = logging.getLogger("surgery")


class ImageFolderBatches(Sequence):
    """Labelled batches of an ``ImageFolder``, each read from disk when it is asked for, so
    peak memory holds one batch whatever ``data.batches`` is."""

    def __init__(self, folder: Any, indices: list[int], batch_size: int) -> None:
        self.folder, self.indices, self.batch_size = folder, indices, batch_size

    def __len__(self) -> int:
        return math.ceil(len(self.indices) / self.batch_size)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if not -len(self) <= index < len(self):
            raise IndexError(index)
        index %= len(self)
        images = [_image(self.folder, i) for i in self.indices[index * self.batch_size : (index + 1) * self.batch_size]]
        return torch.stack([x for x, _ in images]), torch.tensor([y for _, y in images])


def image_folder_batches(
    config: Any, split: str, batch_size: int, limit_batches: int | None = None
) -> ImageFolderBatches:
    """Labelled batches of a torchvision ``ImageFolder`` (resize, centre crop, normalise), in a
    fixed order: ``test`` is the first ``data.batches`` batches, ``train`` (calibration) the
    images after them, or the same ones when the folder holds no more."""
    from torchvision import datasets, transforms

    size = config.image_size
    resize = config.resize or round(size * 8 / 7)
    check_fits_in_memory((batch_size, config.channels, resize, resize), field="data.resize")
    grayscale = [transforms.Grayscale(1)] if config.channels == 1 else []
    transform = transforms.Compose(
        [
            *grayscale,
            transforms.Resize(resize),
            transforms.CenterCrop(size),
            transforms.ToTensor(),
            transforms.Normalize(config.mean, config.std),
        ]
    )
    _refuse_folder_loops(config.root)
    try:
        folder = datasets.ImageFolder(config.root, transform=transform)
    except (FileNotFoundError, OSError) as err:
        raise ConfigError("data.root", config.root, f"is not a folder of class sub-folders of images ({err})") from None
    order = _classes_interleaved([label for _, label in folder.samples])
    evaluation = min(len(folder), config.batches * batch_size)
    indices = order[:evaluation] if split == "test" else order[evaluation:] or order[:evaluation]
    if split == "test" and len({folder.samples[i][1] for i in indices}) < min(2, len(folder.classes)):
        log.warning("data.root: the evaluation images cover one class only; accuracy says little")
    if limit_batches is not None:
        indices = indices[: limit_batches * batch_size]
    return ImageFolderBatches(folder, indices, batch_size)


def _image(folder: Any, index: int) -> tuple[Tensor, int]:
    """One transformed image of an ``ImageFolder``; a file PIL cannot read (corrupt, truncated,
    or a decompression bomb past PIL's pixel limit) is named in one line."""
    from PIL import Image

    try:
        return folder[index]
    except (OSError, ValueError, Image.DecompressionBombError) as err:
        raise ConfigError(
            "data.root",
            folder.samples[index][0],
            f"cannot be read as an image ({type(err).__name__}: {' '.join(str(err).split())[:160]})",
        ) from None


def _refuse_folder_loops(root: str) -> None:
    """``ImageFolder`` follows symbolic links: a folder reached twice (a link to a parent, or
    two links to one folder) would repeat its images, or never end."""
    seen: dict[str, str] = {}
    for path, _, _ in os.walk(root, followlinks=True):
        real = os.path.realpath(path)
        if real in seen:
            raise ConfigError(
                "data.root",
                root,
                f"reaches the folder {real} twice ({seen[real]} and {path}): a "
                "symbolic link loop, or two links to one folder, would repeat its images",
            )
        seen[real] = path
        if len(seen) > 100_000:
            raise ConfigError("data.root", root, "holds more than 100000 folders")


def _classes_interleaved(labels: list[int]) -> list[int]:
    """Sample indices taking each class in turn (a folder lists its images class by class, so
    the first batches would otherwise hold one class)."""
    by_class: dict[int, list[int]] = {}
    for index, label in enumerate(labels):
        by_class.setdefault(label, []).append(index)
    queues = list(by_class.values())
    return [queue[rank] for rank in range(max(map(len, queues), default=0)) for queue in queues if rank < len(queue)]


register_task(
    Task(
        "imagefolder",
        pairs=lambda data, split, batch_size, limit: image_folder_batches(data, split, batch_size, limit),
        metric=Metric("accuracy", accuracy),
    )
)
