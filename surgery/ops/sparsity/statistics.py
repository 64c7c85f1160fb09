"""What calibrated criteria score with: each selected layer's input statistics, or its weights' gradients."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor, nn

from surgery.core.capture import gradient_statistics, input_statistics
from surgery.core.errors import ConfigError, NoCalibrationInputError
from surgery.core.inputs import Inputs, run_backward_batches, run_batches, trainable
from surgery.core.layer_kinds import input_axis_of, is_kind
from surgery.core.targets import Target, Targets
from surgery.ops.sparsity.criteria import (
    LayerStats,
)


def input_major_order(module: nn.Module, columns: int) -> Tensor | None:
    """For a convolution, the column order that puts the input channels of each kernel position
    next to each other (``N:M`` groups run along input channels); ``None`` for linear layers."""
    if not is_kind(module, lambda kind: kind.convolution):
        return None
    positions = math.prod(module.kernel_size)
    return torch.arange(columns).view(columns // positions, positions).t().flatten()


def calibrate(
    model: nn.Module, selection: Targets, calibration: Inputs, progress: bool = True
) -> dict[str, LayerStats]:
    """Run ``calibration`` through ``model`` (eval mode, no grad) and return, by parameter name,
    the input statistics of each selected layer weight (Linear, convolution, Hugging Face
    ``Conv1D``); other parameters (e.g. an LSTM's ``weight_hh_l0``) get none."""
    weights = {name: t for name, t in selection.matched.items() if t.attribute == "weight" and has_input_features(t)}
    layers = {target.module_name: target.module for target in weights.values()}
    count = []

    def run() -> None:
        count.append(run_batches(model, calibration, field="prune.calibration", progress=progress))

    seen = input_statistics(model, layers, run)
    if not count[0]:
        raise ConfigError("prune.calibration", "0 batches", "must hold at least one batch")
    stats: dict[str, LayerStats] = {}
    for name, target in weights.items():
        captured = seen.get(target.module_name)
        if captured is None:
            raise NoCalibrationInputError(
                "prune.calibration",
                target.module_name,
                "this layer received no floating-point input during calibration",
                "give batches that run through it, or exclude it",
            )
        stats[name] = LayerStats(
            target.module_name, captured["sq_norms"], captured["rows"], input_axis_of(target.module)
        )
    return stats


def calibrate_with_gradients(
    model: nn.Module, selection: Targets, pairs: Inputs, loss: Callable, progress: bool = True
) -> dict[str, LayerStats]:
    """:func:`calibrate` on ``(inputs, target)`` pairs run forward and backward through
    ``loss``: each layer's statistics also carry its weight's Taylor saliency and squared
    gradients (parameters' ``.grad`` and ``requires_grad`` are left as they were)."""
    weights = {name: t for name, t in selection.matched.items() if t.attribute == "weight" and has_input_features(t)}
    layers = {target.module_name: target.module for target in weights.values()}
    count = []

    def run() -> None:
        count.append(run_backward_batches(model, pairs, loss, field="prune.calibration", progress=progress))

    def run_with_gradients() -> None:
        nonlocal gradients
        gradients = gradient_statistics(model, layers, run)

    gradients: dict[str, dict] = {}
    with trainable(model):  # before the capture: its tensor hooks need weights that require gradients
        seen = input_statistics(model, layers, run_with_gradients)
    if not count[0]:
        raise ConfigError("prune.calibration", "0 batches", "must hold at least one (inputs, target) pair")
    stats: dict[str, LayerStats] = {}
    for name, target in weights.items():
        captured, grads = seen.get(target.module_name), gradients.get(target.module_name) or {}
        if captured is None:
            raise NoCalibrationInputError(
                "prune.calibration",
                target.module_name,
                "this layer received no floating-point input during calibration",
                "give batches that run through it, or exclude it",
            )
        stats[name] = LayerStats(
            target.module_name,
            captured["sq_norms"],
            captured["rows"],
            input_axis_of(target.module),
            grads.get("taylor"),
            grads.get("grad_sq"),
        )
    return stats


def has_input_features(target: Target) -> bool:
    """A layer whose kind has an input-channel axis (Linear, convolutions, HF Conv1D, registered kinds)."""
    return is_kind(target.module, lambda kind: kind.input_axis is not None)
