"""A user's runnable export format that computes something else: the pickled model, one bias moved."""

import copy

import torch

import surgery
from surgery.ops.export.format_table import run_module


def write_lossy(model, path, options):
    changed = copy.deepcopy(model)
    with torch.no_grad():
        next(p for name, p in changed.named_parameters() if name.endswith("bias")).add_(1.0)
    torch.save(changed, path)


def run_lossy(deployable, call):
    return run_module(deployable, call)


surgery.register_export_format(surgery.ExportFormat(
    "lossy", write_lossy, load=lambda path: torch.load(path, weights_only=False), suffix="pt", holds_hooks=True,
    run=run_lossy, exact=False,
))  # fmt: skip
