"""Tasks: data sets with their metric, behind a registry (:mod:`.base`); the built-ins —
digits, MNIST-1D, the tiny LM, image folders, tokens, synthetic inputs — each one file that
registers itself."""

from surgery.tasks import digits, image_folders, mnist1d, synthetic, tinylm, tokens  # noqa: F401
from surgery.tasks.base import TASKS, Column, Data, Metric, OnDevice, Task, register_task, task_named

__all__ = ["TASKS", "Column", "Data", "Metric", "OnDevice", "Task", "register_task", "task_named"]
