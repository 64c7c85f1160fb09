"""How much each (layer, choice) would hurt, two ways:

- ``gradient`` (AutoQuantize's Fisher estimate): a few backward passes of a loss collect each
  weight's squared gradient ``F``; the score of a choice on a layer is ``½ Σ F ⊙ (W − Q(W))²``,
  ``Q(W)`` the weight as the choice leaves it (each choice applied to every layer at once with
  one verb call, read, restored);
- ``drift`` (as :func:`surgery.sensitivity`): the choice applied to that layer alone, the drift
  1 − cosine of the model's outputs from the unchanged ones on the calibration inputs, restored.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from surgery.core.errors import ConfigError
from surgery.core.inputs import run_backward_batches
from surgery.ops.planning.choices import Choice
from surgery.ops.sensitivity.sensitivity import model_outputs, output_drift, quiet_selection_logs

Scores = dict[str, dict[str, float]]  # layer -> choice name -> score


def squared_gradients(
    model: nn.Module, layers: Sequence[str], pairs: list, loss: Callable[[Any, Any], Tensor]
) -> dict[str, Tensor]:
    """Each layer's weight's squared gradient, summed over the ``(inputs, target)`` pairs."""
    weights = {layer: model.get_submodule(layer).weight for layer in layers}
    fisher = {layer: torch.zeros_like(w, dtype=torch.float32) for layer, w in weights.items()}

    def collect() -> None:
        for layer, w in weights.items():
            if w.grad is not None:
                fisher[layer] += w.grad.detach().float() ** 2

    run_backward_batches(model, pairs, loss, field="plan.calibration", progress=False, after_each=collect)
    for layer, f in fisher.items():  # a zero or non-finite Fisher would score every choice alike, silently
        if not bool(torch.isfinite(f).all()) or not bool(f.any()):
            raise ConfigError(
                "plan.estimate",
                "gradient",
                f"{layer}'s weight got {'no' if bool(torch.isfinite(f).all()) else 'a non-finite'} gradient "
                "from the loss; set estimate='drift' or exclude it",
            )
    return fisher


def gradient_scores(
    model: nn.Module, layers: list[str], choices: dict[str, Choice], options: dict[str, list[str]], context: dict
) -> Scores:
    """½ Σ F ⊙ (W − Q(W))² for every layer and the choices it can take."""
    fisher = squared_gradients(model, layers, context["pairs"], context["loss"])
    scores: Scores = {layer: {} for layer in layers}
    for name, choice in choices.items():
        chosen = [layer for layer in layers if name in options[layer]]
        if not chosen:
            continue
        before = {layer: model.get_submodule(layer).weight.detach().float().clone() for layer in chosen}
        with quiet_selection_logs():
            handle = choice.apply(model, chosen, context["calibration"], context["method"])
        try:
            for layer in chosen:
                error = before[layer] - model.get_submodule(layer).weight.detach().float()
                scores[layer][name] = float(0.5 * (fisher[layer] * error.square()).sum())
        finally:
            handle.restore()
    return scores


def drift_scores(
    model: nn.Module, layers: list[str], choices: dict[str, Choice], options: dict[str, list[str]], context: dict
) -> Scores:
    """The output drift of each choice on each layer alone, on the calibration inputs."""
    inputs = context["inputs"]
    reference = model_outputs(model, inputs)
    scores: Scores = {layer: {} for layer in layers}
    for layer in layers:
        for name in options[layer]:
            with quiet_selection_logs():
                handle = choices[name].apply(model, [layer], context["calibration"], context["method"])
            try:
                drift = output_drift(reference, model_outputs(model, inputs))
                scores[layer][name] = math.inf if math.isnan(drift) else drift
            finally:
                handle.restore()
    return scores


ESTIMATES = {"gradient": gradient_scores, "drift": drift_scores}
