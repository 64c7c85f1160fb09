"""Inputs for the checks: seeded synthetic batches (real data sets come in later issues)."""

from __future__ import annotations

import torch
from torch import Tensor

from surgery.config import DataConfig


def calibration_batches(config: DataConfig, count: int) -> list[Tensor]:
    """``count`` batches for calibration, distinct from the evaluation batches (seed + 1)."""
    generator = torch.Generator().manual_seed(config.seed + 1)
    shape = (config.batch_size, config.channels, config.image_size, config.image_size)
    return [torch.randn(shape, generator=generator) for _ in range(count)]


def make_batches(config: DataConfig) -> list[Tensor]:
    """Return ``config.batches`` seeded Gaussian image batches of shape (B, C, H, W)."""
    generator = torch.Generator().manual_seed(config.seed)
    shape = (config.batch_size, config.channels, config.image_size, config.image_size)
    return [torch.randn(shape, generator=generator) for _ in range(config.batches)]
