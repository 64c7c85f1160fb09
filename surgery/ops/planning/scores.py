"""How much each (layer, choice) would hurt, two ways:

- ``gradient`` (AutoQuantize's Fisher estimate): a few backward passes of a loss collect each
  weight's squared gradient ``F``; the score of a choice on a layer is ``½ Σ F ⊙ (W − Q(W))²``,
  ``Q(W)`` the weight as the choice leaves it (each choice applied to every layer at once with
  one verb call, read, restored); a KV-cache choice on an attention module scores the same sum
  over what its key and value projections write, ``½ Σ g² ⊙ (a − Q(a))²`` with ``g`` the loss's
  gradient at each calibration batch's outputs ``a`` (the choice on every attention at once,
  its rounding read between the projection and its quantizer, restored);
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
from surgery.core.inputs import as_call, evaluating, run_backward_batches
from surgery.core.registry import Registry
from surgery.ops.planning.choices import Choice
from surgery.ops.quantization.kv_cache import projection_names
from surgery.ops.sensitivity.sensitivity import model_outputs, output_drift, quiet_selection_logs

Scores = dict[str, dict[str, float]]  # layer -> choice name -> score


def squared_gradients(
    model: nn.Module,
    layers: Sequence[str],
    pairs: list,
    loss: Callable[[Any, Any], Tensor],
    outputs: Sequence[str] = (),
) -> tuple[dict[str, Tensor], dict[str, list[Tensor]]]:
    """Each layer's weight's squared gradient, summed over the ``(inputs, target)`` pairs; and of
    each of the ``outputs`` layers, the squared gradient at its output, one tensor a call."""
    weights = {layer: model.get_submodule(layer).weight for layer in layers}
    fisher = {layer: torch.zeros_like(w, dtype=torch.float32) for layer, w in weights.items()}
    at_outputs: dict[str, list[Tensor]] = {layer: [] for layer in outputs}

    def collect() -> None:
        for layer, w in weights.items():
            if w.grad is not None:
                fisher[layer] += w.grad.detach().float() ** 2

    def keep(layer: str) -> Callable:
        def hook(module: nn.Module, args: Any, output: Tensor) -> None:
            kept = torch.zeros_like(output, dtype=torch.float32)
            at_outputs[layer].append(kept)

            def read(gradient: Tensor) -> None:  # returns nothing: the gradient flows on unchanged
                kept.copy_(gradient.detach().float() ** 2)

            output.register_hook(read)

        return hook

    hooks = [model.get_submodule(layer).register_forward_hook(keep(layer)) for layer in outputs]
    try:
        run_backward_batches(model, pairs, loss, field="plan.calibration", progress=False, after_each=collect)
    finally:
        for hook in hooks:
            hook.remove()
    for layer, f in fisher.items():  # a zero or non-finite Fisher would score every choice alike, silently
        if not bool(torch.isfinite(f).all()) or not bool(f.any()):
            raise ConfigError(
                "plan.estimate",
                "gradient",
                f"{layer}'s weight got {'no' if bool(torch.isfinite(f).all()) else 'a non-finite'} gradient "
                "from the loss; set estimate='drift' or exclude it",
            )
    for layer, found in at_outputs.items():
        if not any(bool(g.any()) for g in found):
            raise ConfigError(
                "plan.estimate", "gradient", f"{layer}'s output got no gradient from the loss; set estimate='drift'"
            )
    return fisher, at_outputs


def gradient_scores(
    model: nn.Module, layers: list[str], choices: dict[str, Choice], options: dict[str, list[str]], context: dict
) -> Scores:
    """½ Σ F ⊙ (W − Q(W))² for every layer and the choices it can take (of a KV cache, over the
    key and value projections' outputs)."""
    caches = context.get("caches", [])
    weights = [layer for layer in layers if layer not in caches]
    projections = [layer for name in caches for layer in projection_names(name)]
    fisher, at_outputs = squared_gradients(model, weights, context["pairs"], context["loss"], projections)
    scores: Scores = {layer: {} for layer in layers}
    for name, choice in choices.items():
        chosen = [layer for layer in layers if name in options[layer]]
        if not chosen:
            continue
        if choice.target == "kv_cache":
            for layer, score in _cache_scores(model, choice, chosen, at_outputs, context).items():
                scores[layer][name] = score
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


def _cache_scores(
    model: nn.Module, choice: Choice, caches: list[str], at_outputs: dict[str, list[Tensor]], context: dict
) -> dict[str, float]:
    """½ Σ g² ⊙ (Q(a) − a)² of ``choice`` on every one of ``caches`` (attention modules), the
    rounding read on the calibration inputs between each projection and its quantizer."""
    with quiet_selection_logs():
        handle = choice.apply(model, caches, context["calibration"], context["method"])
    totals: dict[str, Any] = dict.fromkeys(caches, 0.0)
    calls: dict[str, int] = {}
    unrounded: dict[str, Tensor] = {}

    def before(layer: str) -> Callable:
        def hook(module: nn.Module, args: Any, output: Tensor) -> None:
            unrounded[layer] = output.detach().float()

        return hook

    def after(cache: str, layer: str) -> Callable:
        def hook(module: nn.Module, args: Any, output: Tensor) -> None:
            index = calls.get(layer, 0)
            calls[layer] = index + 1
            error = output.detach().float() - unrounded.pop(layer)
            totals[cache] = totals[cache] + 0.5 * (at_outputs[layer][index] * error.square()).sum()  # no sync a call

        return hook

    hooks = []
    try:
        for cache in caches:
            for layer in projection_names(cache):
                module = model.get_submodule(layer)
                hooks.append(module.register_forward_hook(before(layer), prepend=True))
                hooks.append(module.register_forward_hook(after(cache, layer)))
        with evaluating(model), torch.no_grad():
            for index, batch in enumerate(context["inputs"]):
                as_call(batch, "plan.calibration", index)(model)
    finally:
        for hook in hooks:
            hook.remove()
        handle.restore()
    return {cache: float(total) for cache, total in totals.items()}


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


ESTIMATES: Registry[Callable[..., Any]] = Registry("plan.estimate")  # how each layer's choices are scored
ESTIMATES.register("gradient", gradient_scores)
ESTIMATES.register("drift", drift_scores)
