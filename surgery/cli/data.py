"""Inputs for the checks: seeded synthetic images, or real labelled data (digits, MNIST-1D).

Batches are streamed: :class:`SyntheticBatches` makes each batch when it is reached and drops
it after use, so a run's memory does not grow with ``data.batches``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from surgery.cli.config import DataConfig
from surgery.core.errors import NO_VALUE, ConfigError


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


@dataclass
class Data:
    """Evaluation batches, with labels when the data set has them (for accuracy)."""

    inputs: Sequence[Tensor]
    labels: list[Tensor] | None

    def labelled(self) -> Iterator[tuple[Tensor, Tensor]]:
        return zip(self.inputs, self.labels or [], strict=True)


LabelledBatches = Callable[..., list[tuple[Tensor, Tensor]]]  # (split, batch_size, *, limit_batches)


def labelled_source(kind: str) -> LabelledBatches | None:
    """The batch function of a labelled data set (its fixed train/test split), or None."""
    if kind == "digits":
        from surgery.cli.digits import digits_batches

        return digits_batches
    if kind == "mnist1d":
        from surgery.cli.mnist1d import mnist1d_batches

        return mnist1d_batches
    if kind == "tinylm":
        from surgery.cli.tinylm import token_batches

        return token_batches
    return None


def load_data(config: DataConfig) -> Data:
    """The evaluation batches of ``config``: ``config.batches`` batches of ``config.batch_size``."""
    source = labelled_source(config.kind)
    if source is not None:
        pairs = source("test", config.batch_size, limit_batches=config.batches)  # the fixed split
        return Data([inputs for inputs, _ in pairs], [labels for _, labels in pairs])
    return Data(_noise(config, config.seed, config.batches), None)


def calibration_batches(config: DataConfig, count: int) -> Sequence[Tensor]:
    """``count`` batches for calibration, disjoint from the evaluation batches (labelled data:
    the training split; synthetic: noise from ``seed + 1``)."""
    source = labelled_source(config.kind)
    if source is not None:
        return [inputs for inputs, _ in source("train", config.batch_size, limit_batches=count)]
    return _noise(config, config.seed + 1, count)


def calibration_pairs(config: DataConfig, count: int, field: str) -> list[tuple[Tensor, Tensor]]:
    """``count`` labelled training batches, for criteria that take gradients (taylor)."""
    source = labelled_source(config.kind)
    if source is None:
        raise ConfigError(field, NO_VALUE, f"needs labelled batches (inputs, target) for its gradients and data.kind "
                          f"is {config.kind!r}; use data=digits, mnist1d or tinylm")
    return source("train", config.batch_size, limit_batches=count)


def training_data(config: DataConfig, batch_size: int) -> tuple[list[tuple[Tensor, Tensor]], Callable[[nn.Module], float]]:
    """Labelled training batches (the training split) and an accuracy function over the
    evaluation batches, for the ``finetune`` step."""
    source = labelled_source(config.kind)
    if source is None:
        raise ConfigError("finetune", NO_VALUE, f"needs labelled training data and data.kind is {config.kind!r}; "
                          "use data=digits, mnist1d or tinylm")
    from surgery.cli.digits import accuracy

    evaluation = load_data(config)
    return source("train", batch_size), lambda model: accuracy(model, evaluation.labelled())


def _noise(config: DataConfig, seed: int, count: int) -> SyntheticBatches:
    shape = (config.batch_size, config.channels, config.image_size, config.image_size)
    _check_fits_in_memory(shape)
    return SyntheticBatches(shape, seed, count)


def _check_fits_in_memory(shape: tuple[int, ...]) -> None:
    """Refuse a batch larger than a quarter of this machine's memory before allocating it."""
    needed = math.prod(shape) * 4
    try:
        available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return
    if needed > available // 4:
        field = "data.image_size" if shape[2] * shape[3] >= shape[0] * shape[1] else "data.batch_size"
        raise ConfigError(field, shape[2] if field == "data.image_size" else shape[0],
                          f"one batch of shape {shape} needs {needed / 2**30:.1f} GiB, more than a quarter of this "
                          f"machine's {available / 2**30:.1f} GiB; use smaller batches or images")
