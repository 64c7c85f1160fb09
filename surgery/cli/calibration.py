"""What a recipe's steps are given from its data, in memory or offloaded alike: each step's
calibration batches (a warning when the data holds fewer than asked) and the task's metric."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from torch import nn

from surgery.cli.config import RunConfig
from surgery.cli.data import Data, calibration_batches, calibration_pairs
from surgery.cli.steps import step_named
from surgery.tasks import task_named

log = logging.getLogger("surgery")
Metric = tuple[str, Callable[[nn.Module], float], bool]  # (name, evaluate(model), higher is better)


def step_calibration(config: RunConfig, step: str) -> Any:
    """The calibration batches ``step`` asks for (None: it needs none)."""
    need = step_named(step).calibration(config.settings(step))
    if need is None:
        return None
    if need.labelled:
        batches = calibration_pairs(config.data, need.batches, need.field)
    else:
        batches = calibration_batches(config.data, need.batches)
    if len(batches) < need.batches:
        log.warning(
            "%s.calibration_batches=%d: the %s training split holds %d batches of %d; using those",
            step,
            need.batches,
            config.data.kind,
            len(batches),
            config.data.batch_size,
        )
    return batches


def task_metric(config: RunConfig, data: Data) -> Metric | None:
    """The task's metric on the evaluation batches; None: the task has none or the data no
    labels (output drift measures)."""
    metric = task_named(config.data.kind).metric
    if metric is None or data.labels is None:
        return None
    return metric.name, lambda m: metric.evaluate(m, list(data.labelled())), metric.higher_is_better


def perplexity_of(metric: Metric | None) -> Callable[[nn.Module], float] | None:
    """The evaluation of a language model's perplexity (None for any other metric: accuracy has
    its own section, from the labels)."""
    return metric[1] if metric is not None and metric[0] == "perplexity" else None
