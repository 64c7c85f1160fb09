"""Tasks: a data set (labelled batches of a fixed split, or generated inputs) and the metric
a model is scored by. ``data.kind`` in a recipe names a registered task; digits, MNIST-1D,
the tiny LM, image folders, tokens and synthetic inputs register the way a user's task does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from surgery.core.errors import ConfigTypeError
from surgery.core.inputs import cast_floating, moved
from surgery.core.registry import Registry

Pairs = Callable[[Any, str, int, "int | None"], Sequence[tuple[Any, Tensor]]]  # (data, split, batch_size, limit)
Inputs = Callable[[Any, int, int], Sequence[Any]]  # (data, seed, count)


class Metric(NamedTuple):
    """How a task scores a model on labelled batches: ``evaluate(model, pairs) -> float``."""

    name: str
    evaluate: Callable[[nn.Module, Sequence[tuple[Any, Tensor]]], float]
    higher_is_better: bool = True


@dataclass(frozen=True)
class Task:
    """A registered task. A labelled task gives ``pairs(data, split, batch_size, limit)``:
    ``(inputs, labels)`` batches of its fixed ``"test"`` (evaluation) and ``"train"``
    (calibration, training) splits; an unlabelled one gives ``inputs(data, seed, count)``.
    ``data`` is the run's data settings (batch size, image size, paths...)."""

    name: str
    pairs: Pairs | None = None
    inputs: Inputs | None = None
    metric: Metric | None = None

    def __post_init__(self) -> None:
        if (self.pairs is None) == (self.inputs is None):
            raise ConfigTypeError(f"task {self.name!r}", None, "needs exactly one of pairs= and inputs=")

    def __call__(self, data: Any, split: str, batch_size: int, limit: int | None = None) -> Any:
        return self.pairs(data, split, batch_size, limit)

    @property
    def labelled(self) -> bool:
        return self.pairs is not None


TASKS: Registry[Task] = Registry("data.kind")


def register_task(task: Task, *, replace: bool = False) -> Task:
    """Make ``task`` available as ``data.kind=<task.name>`` (and ``data=<name>`` with a config file).

    Example:
        >>> register_task(Task("blobs", pairs=blob_batches, metric=Metric("accuracy", accuracy)))
    """
    if not isinstance(task, Task):
        raise ConfigTypeError("task", task, "must be a surgery.tasks.Task")
    return TASKS.register(task.name, task, replace=replace)


def task_named(name: object) -> Task:
    """The task registered as ``name``; a one-line error listing the registered ones otherwise."""
    return TASKS.get(name)


@dataclass
class Data:
    """Evaluation batches, with labels when the data set has them (for accuracy)."""

    inputs: Sequence[Tensor]
    labels: Sequence[Tensor] | None

    def labelled(self) -> Iterator[tuple[Tensor, Tensor]]:
        if isinstance(self.inputs, Column) and self.inputs.pairs is getattr(self.labels, "pairs", None):
            return iter(self.inputs.pairs)  # one read of each batch, not one for inputs and one for labels
        return zip(self.inputs, self.labels or [], strict=True)


class OnDevice(Sequence):
    """Batches (tensors, or tuples, lists and dicts of them) read through and each moved to
    ``device`` as it is read, floating tensors cast to ``dtype`` where given (with ``pairs``,
    the inputs of each (inputs, labels) pair only): a lazily loaded data set stays lazy."""

    def __init__(
        self, batches: Sequence[Any], device: str | torch.device, dtype: torch.dtype | None = None, pairs: bool = False
    ) -> None:
        self.batches, self.device, self.dtype, self.pairs = batches, torch.device(device), dtype, pairs

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        found = moved(self.batches[index], self.device)
        if self.dtype is None:
            return found
        if self.pairs:  # (inputs, labels): the labels keep their dtype (soft or regression targets)
            return (cast_floating(found[0], self.dtype), *found[1:])
        return cast_floating(found, self.dtype)


class Column(Sequence):
    """One side (0: inputs, 1: labels) of a sequence of ``(inputs, labels)`` batches, read
    through: a lazily loaded data set stays lazy."""

    def __init__(self, pairs: Sequence[tuple[Tensor, Tensor]], side: int) -> None:
        self.pairs, self.side = pairs, side

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        return self.pairs[index][self.side]
