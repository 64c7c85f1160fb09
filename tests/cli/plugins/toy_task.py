"""A user's task, one file: three Gaussian blobs in 2-d, scored by accuracy, and a model for it."""

import torch
from torch import nn

from surgery.analysis.metrics import accuracy
from surgery.tasks import Metric, Task, register_task


def blob_batches(data, split, batch_size, limit):
    generator = torch.Generator().manual_seed(0 if split == "test" else 1)
    count = limit or 4
    labels = torch.randint(0, 3, (count, batch_size), generator=generator)
    centres = torch.tensor([[0.0, 3.0], [3.0, 0.0], [-3.0, -3.0]])
    points = centres[labels] + torch.randn(count, batch_size, 2, generator=generator)
    return [(points[i], labels[i]) for i in range(count)]


def blob_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Linear(16, 3))


register_task(Task("blobs", pairs=blob_batches, metric=Metric("accuracy", accuracy)))
