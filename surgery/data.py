"""Inputs for the checks: seeded synthetic images, or scikit-learn's digits with labels."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from surgery.config import DataConfig


@dataclass
class Data:
    """Evaluation batches, with labels when the data set has them (for accuracy)."""

    inputs: list[Tensor]
    labels: list[Tensor] | None

    def labelled(self) -> list[tuple[Tensor, Tensor]]:
        return list(zip(self.inputs, self.labels or [], strict=True))


def load_data(config: DataConfig) -> Data:
    """The evaluation batches of ``config``: ``config.batches`` batches of ``config.batch_size``."""
    if config.kind == "digits":
        from surgery.digits import digits_batches

        pairs = digits_batches("test", config.batch_size, limit_batches=config.batches)  # the fixed split
        return Data([images for images, _ in pairs], [labels for _, labels in pairs])
    return Data(_noise(config, config.seed, config.batches), None)


def calibration_batches(config: DataConfig, count: int) -> list[Tensor]:
    """``count`` batches for calibration, disjoint from the evaluation batches (digits: the
    training split; synthetic: noise from ``seed + 1``)."""
    if config.kind == "digits":
        from surgery.digits import digits_batches

        return [images for images, _ in digits_batches("train", config.batch_size, limit_batches=count)]
    return _noise(config, config.seed + 1, count)


def _noise(config: DataConfig, seed: int, count: int) -> list[Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shape = (config.batch_size, config.channels, config.image_size, config.image_size)
    return [torch.randn(shape, generator=generator) for _ in range(count)]
