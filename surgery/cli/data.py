"""Inputs for the checks: seeded synthetic images, or real labelled data (digits, MNIST-1D).

Batches are streamed: :class:`~surgery.tasks.synthetic.SyntheticBatches` makes each batch when it is reached and drops
it after use, so a run's memory does not grow with ``data.batches``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from surgery.analysis.metrics import accuracy
from surgery.cli.config import DataConfig
from surgery.core.errors import NO_VALUE, ConfigError
from surgery.tasks import TASKS, Column, Data, OnDevice, task_named

log = logging.getLogger("surgery")


def load_data(config: DataConfig) -> Data:
    """The evaluation batches of ``config``: ``config.batches`` batches of ``config.batch_size``."""
    task = task_named(config.kind)
    if task.labelled:
        pairs = placed(task(config, "test", config.batch_size, config.batches), config, pairs=True)  # the fixed split
        return Data(Column(pairs, 0), Column(pairs, 1))
    return Data(placed(task.inputs(config, config.seed, config.batches), config), None)


def calibration_batches(config: DataConfig, count: int) -> Sequence[Tensor]:
    """``count`` batches for calibration, disjoint from the evaluation batches (labelled data:
    the training split; generated inputs: from ``seed + 1``)."""
    task = task_named(config.kind)
    if task.labelled:
        return Column(placed(task(config, "train", config.batch_size, count), config, pairs=True), 0)
    return placed(task.inputs(config, config.seed + 1, count), config)


def calibration_pairs(config: DataConfig, count: int, field: str) -> list[tuple[Tensor, Tensor]]:
    """``count`` labelled training batches, for criteria that take gradients (taylor)."""
    task = task_named(config.kind)
    if not task.labelled:
        raise ConfigError(
            field,
            NO_VALUE,
            f"needs labelled batches (inputs, target) for its gradients and data.kind "
            f"is {config.kind!r}; use a labelled task: {', '.join(labelled_kinds())}",
        )
    return placed(task(config, "train", config.batch_size, count), config, pairs=True)


def training_data(
    config: DataConfig, batch_size: int
) -> tuple[list[tuple[Tensor, Tensor]], Callable[[nn.Module], float]]:
    """Labelled training batches (the training split) and an accuracy function over the
    evaluation batches, for the ``finetune`` step."""
    task = task_named(config.kind)
    if not task.labelled:
        raise ConfigError(
            "finetune",
            NO_VALUE,
            f"needs labelled training data and data.kind is {config.kind!r}; "
            f"use a labelled task: {', '.join(labelled_kinds())}",
        )
    evaluation = load_data(config)
    return placed(task(config, "train", batch_size), config, pairs=True), lambda model: accuracy(
        model, evaluation.labelled()
    )


def placed(batches: Sequence, config: DataConfig, pairs: bool = False) -> Sequence:
    """``batches`` as they are, or read through onto ``config.device`` with floating tensors in
    ``config.dtype`` (``model.device``, ``model.dtype``)."""
    if config.device == "cpu" and config.dtype == "float32":
        return batches
    dtype = None if config.dtype == "float32" else getattr(torch, config.dtype)
    return OnDevice(batches, config.device, dtype, pairs)


def labelled_kinds() -> list[str]:
    """The registered tasks with labels."""
    return [name for name in TASKS if TASKS.get(name).labelled]


def with_model_defaults(config: DataConfig, model: nn.Module) -> DataConfig:
    """``config`` with what it left to the model filled in (the vocabulary size of ``tokens``)."""
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if config.kind == "tokens" and config.vocab_size is None and isinstance(vocab, int):
        return dataclasses.replace(config, vocab_size=vocab)
    return config
