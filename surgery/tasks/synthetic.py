"""Synthetic inputs: seeded Gaussian images, made batch by batch (no labels, no metric: runs
are scored by output drift)."""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from surgery.core.errors import ConfigError
from surgery.tasks.base import Task, register_task


class SyntheticBatches(Sequence):
    """``count`` seeded Gaussian batches of ``shape``, made again on every pass (the same values
    each time), one at a time."""

    def __init__(self, shape: tuple[int, ...], seed: int, count: int) -> None:
        self.shape, self.seed, self.count = shape, seed, count

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[Tensor]:
        generator = torch.Generator().manual_seed(self.seed)
        for _ in range(self.count):
            yield torch.randn(self.shape, generator=generator)

    def __getitem__(self, index: int) -> Tensor:  # type: ignore[override]
        if not -self.count <= index < self.count:
            raise IndexError(index)
        for position, batch in enumerate(self):
            if position == index % self.count:
                return batch
        raise IndexError(index)


def noise(config: Any, seed: int, count: int) -> SyntheticBatches:
    shape = (config.batch_size, config.channels, config.image_size, config.image_size)
    check_fits_in_memory(shape)
    return SyntheticBatches(shape, seed, count)


def check_fits_in_memory(shape: tuple[int, ...], itemsize: int = 4, field: str | None = None) -> None:
    """Refuse a batch larger than a quarter of this machine's memory before allocating it
    (``field``: the setting to name, when it is not image_size or batch_size)."""
    needed = math.prod(shape) * itemsize
    try:
        available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return
    if needed > available // 4:
        if len(shape) == 2:  # token ids
            field = "data.seq_len" if shape[1] >= shape[0] else "data.batch_size"
            raise ConfigError(
                field,
                shape[1] if field == "data.seq_len" else shape[0],
                f"one batch of {shape} token "
                f"ids needs {needed / 2**30:.1f} GiB, more than a quarter of this machine's "
                f"{available / 2**30:.1f} GiB",
            )
        field = field or ("data.image_size" if shape[2] * shape[3] >= shape[0] * shape[1] else "data.batch_size")
        raise ConfigError(
            field,
            shape[0] if field == "data.batch_size" else shape[2],
            f"one batch of shape {shape} needs {needed / 2**30:.1f} GiB, more than a quarter of this "
            f"machine's {available / 2**30:.1f} GiB; use smaller batches or images",
        )


register_task(Task("synthetic", inputs=noise))
