"""``surgery.plan``: one bytes budget across every knob. Each selected layer may take any of
``choices`` (a weight format, N:M sparsity, or nothing: :mod:`.choices`), and with KV-cache
choices each attention module a cache dtype; each (layer, choice) is scored (:mod:`.scores`: gradient-weighted error where a loss exists, output drift
otherwise); the plan is the one option per layer with the least summed score whose bytes fit
the budget (:mod:`.solver`). What counts: the selected layers' weights (every Linear but the
output head by default; embeddings, norms and biases are outside the budget) and, with KV-cache
choices, the cache at ``kv_tokens`` tokens."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from surgery.core.errors import ConfigError, ConfigTypeError
from surgery.core.inputs import as_call, evaluating
from surgery.core.selection import Selection
from surgery.core.verbs import VerbCall, verb
from surgery.ops.numerics.weight_methods import WEIGHT_METHODS
from surgery.ops.planning.budget import budget_bytes
from surgery.ops.planning.choices import Choice, Shape, choice_named
from surgery.ops.planning.plans import Plan, PlanRow
from surgery.ops.planning.scores import ESTIMATES
from surgery.ops.planning.solver import Option, smallest, solve
from surgery.ops.quantization.kv_cache import attention_modules
from surgery.ops.sparsity.pruning import prune_targets

log = logging.getLogger("surgery")
DEFAULT_CHOICES = ("dense", "int8", "w4g128", "w3g128")


@dataclass(frozen=True)
class PlanSpec:
    """What to plan (see :func:`plan`): the ``budget``, the ``choices`` per layer, how layers are
    scored (``estimate``) and quantized for the integer choices (``method``), the layers planned,
    and the cache's tokens for KV-cache choices."""

    budget: int | str | None = None
    choices: Sequence[str] = DEFAULT_CHOICES
    estimate: str = "auto"
    method: str = "rtn"
    select: Selection = None
    exclude: Selection = None
    kv_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.budget is None:
            raise ConfigError(
                "plan.budget", None, "pass a budget: bytes (12_000_000, '12MB') or bits per weight ('4.5bpw')"
            )


@verb("plan", PlanSpec, positional=("budget", "choices"), calibration="required", extras={"loss": None})
def plan(model: nn.Module, spec: PlanSpec, call: VerbCall) -> Plan:
    """Choose one of ``choices`` for every selected layer: least summed score within ``budget``.

    Args:
        model: left exactly as it was (every trial is restored).
        spec: a :class:`PlanSpec` holding every setting instead (then no setting is given as a keyword).
        budget: bytes (``12_000_000``, ``"12MB"``, ``"3.5MiB"``) or bits per weight
            (``"4.5bpw"``) over the selected layers' weights; with KV-cache choices, bytes of
            the weights and the cache together.
        choices: registered choice names (:func:`register_choice`): ``dense``, ``int8``,
            ``w4g128``, ``w3g128``, ``fp8``, ``mxfp4``, ``nvfp4``, ``2:4`` for the weights;
            ``kv16``, ``kv_int8``, ``kv_int4``, ``kv_fp8`` for each attention module's cache.
        calibration: input batches; with ``loss``, ``(inputs, target)`` pairs.
        loss: ``loss(output, target) -> scalar``: gradient scores. Without it, a model whose
            output holds a ``loss`` (a Hugging Face model given labels) gives gradient scores
            too; any other, drift scores.
        estimate: ``"auto"`` (as above), ``"gradient"`` or ``"drift"``.
        method: the integer choices' weight method (``rtn``, ``gptq``...).
        select, exclude: the layers planned (see :func:`surgery.select`); default every
            Linear and convolution but the model's output head.
        kv_tokens: the tokens a deployment caches (context x batch), which KV-cache choices
            need to count the cache's bytes.

    Example:
        >>> p = surgery.plan(model, "4.5bpw", ["w4g128", "w3g128", "int8"], calibration=batches)
        >>> handle = p.apply(model, calibration=batches); p.save("plan.json")
    """
    budget, choices, estimate, method, kv_tokens = spec.budget, spec.choices, spec.estimate, spec.method, spec.kv_tokens
    select, exclude, calibration, loss = spec.select, spec.exclude, call.calibration, call.extras["loss"]
    picked = _choices(choices, method)
    if calibration is None or isinstance(calibration, (str, bytes)) or not list(calibration):
        raise ConfigError(
            "plan.calibration", None, "pass calibration batches (inputs; with loss, (inputs, target) pairs)"
        )
    weights = _layers(model, select, exclude)
    options = {
        name: [c for c, choice in picked.items() if choice.target == "weight" and choice.fits(shape)]
        for name, shape in weights.items()
    }
    empty = next((name for name, fit in options.items() if not fit), None)
    if empty is not None:
        raise ConfigError("plan.choices", list(picked), f"none fits {empty} {weights[empty]}; add e.g. 'dense'")
    caches = _caches(model, picked, kv_tokens)
    options.update({name: [c for c, choice in picked.items() if choice.target == "kv_cache"] for name in caches})
    shapes = {**weights, **caches}
    limit = _check_budget(budget, weights, shapes, options, picked, kv=bool(caches))
    context = _context(model, calibration, loss, estimate, method)
    context["caches"] = list(caches)
    scores = ESTIMATES[context["estimate"]](model, list(shapes), picked, options, context)
    table = [[Option(picked[c].bytes_of(shapes[n]), scores[n][c]) for c in options[n]] for n in shapes]
    picks, solver = solve(table, limit)
    rows = [
        PlanRow(
            name,
            options[name][k],
            shapes[name],
            table[i][k].bytes,
            table[i][k].score,
            "kv_cache" if name in caches else "weight",
        )
        for i, (name, k) in enumerate(zip(shapes, picks))
    ]
    return Plan(rows, limit, context["estimate"], solver, method, list(picked), kv_tokens if caches else None)


def _choices(choices: object, method: object) -> dict[str, Choice]:
    if isinstance(choices, (str, bytes)) or not isinstance(choices, Sequence) or not choices:
        raise ConfigTypeError("plan.choices", choices, "must be a non-empty list of choice names")
    if method not in WEIGHT_METHODS:
        raise ConfigError("plan.method", method, f"must be one of {', '.join(WEIGHT_METHODS.names())}")
    return {name: choice_named(name) for name in choices}


def _layers(model: nn.Module, select: Selection, exclude: Selection) -> dict[str, Shape]:
    """The planned layers and their weights' (outputs, inputs) shapes."""
    if select is None and exclude is None:
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        exclude = [name for name, module in model.named_modules() if head is not None and module is head] or None
    targets = prune_targets(model, select, exclude).matched
    found = {}
    for target in targets.values():
        if target.param.dim() >= 2:
            found[target.module_name] = (target.param.shape[0], target.param[0].numel())
    if not found:
        raise ConfigError("plan.select", select, "matches no layer with a weight matrix")
    _say_experts_left(model)
    return found


def _say_experts_left(model: nn.Module) -> None:
    """A mixture-of-experts model's fused expert weights (3-D parameters) are not planned: say so,
    with their share of the weights, rather than let a plan look like it covered the model."""
    experts = {name: p.numel() for name, p in model.named_parameters() if p.dim() == 3}
    if experts:
        share = sum(experts.values()) / sum(p.numel() for p in model.parameters() if p.dim() >= 2)
        log.warning(
            "plan: %d fused expert weight(s) (%.0f%% of the weights, e.g. %s) are not planned and stay as they are",
            len(experts),
            100 * share,
            next(iter(experts)),
        )


def _caches(model: nn.Module, picked: dict[str, Choice], kv_tokens: object) -> dict[str, Shape]:
    """With KV-cache choices, every attention module's cache as (values per token, kv_tokens)."""
    names = [name for name, choice in picked.items() if choice.target == "kv_cache"]
    if not names:
        if kv_tokens is not None:
            raise ConfigError("plan.kv_tokens", kv_tokens, "counts a KV cache; add KV-cache choices (kv16, kv_int8...)")
        return {}
    if isinstance(kv_tokens, bool) or not isinstance(kv_tokens, int) or kv_tokens < 1:
        raise ConfigError(
            "plan.kv_tokens",
            kv_tokens,
            f"must be the tokens the cache holds (context x batch, e.g. 4096) to count {', '.join(names)}",
        )
    found = {name: (k.out_features + v.out_features, kv_tokens) for name, (k, v) in attention_modules(model).items()}
    if not found:
        raise ConfigError(
            "plan.choices", names, f"{type(model).__name__} has no attention module with k_proj and v_proj Linears"
        )
    return found


def _check_budget(
    budget: object,
    weights: dict[str, Shape],
    shapes: dict[str, Shape],
    options: dict[str, list[str]],
    picked: dict,
    kv: bool = False,
) -> int:
    """The budget in bytes; one no plan can meet raises, naming the smallest reachable one."""
    count = sum(rows * columns for rows, columns in weights.values())
    if kv and isinstance(budget, str) and budget.strip().lower().endswith("bpw"):
        raise ConfigError(
            "plan.budget", budget, "must be bytes (e.g. '12MB') when the plan counts a KV cache as well as weights"
        )
    limit = budget_bytes(budget, count)
    sizes = [[picked[c].bytes_of(shapes[n]) for c in options[n]] for n in shapes]
    least = smallest([[Option(b, 0.0) for b in row] for row in sizes])
    if limit < least:
        smallest_choice = {min(options[n], key=lambda c: picked[c].bytes_of(shapes[n])) for n in weights}
        how = f"every layer at {smallest_choice.pop()}" if len(smallest_choice) == 1 else "each layer at its smallest"
        if kv:
            caches = {min(options[n], key=lambda c: picked[c].bytes_of(shapes[n])) for n in shapes if n not in weights}
            how += f", every cache at {caches.pop()}" if len(caches) == 1 else ", each cache at its smallest"
        reach = f"{least:,} bytes" if kv else f"{8 * least / count:.2f} bpw ({least:,} bytes)"
        raise ConfigError("plan.budget", budget, f"no plan fits; smallest reachable: {reach} with {how}")
    return limit


def _context(model: nn.Module, calibration: Sequence, loss: Any, estimate: str, method: str) -> dict[str, Any]:
    """Which estimate runs, and what it needs: the verbs' input batches, the (inputs, target) pairs and the loss."""
    if estimate not in ("auto", *ESTIMATES):
        raise ConfigError("plan.estimate", estimate, "must be one of auto, gradient, drift")
    batches = list(calibration)
    inputs = [pair[0] for pair in batches] if loss is not None else batches
    pairs = batches if loss is not None else [(batch, None) for batch in batches]
    if loss is None and estimate != "drift" and _gives_loss(model, batches[0]):
        loss = lambda output, _: output.loss  # noqa: E731
    if estimate == "gradient" and loss is None:
        raise ConfigError(
            "plan.estimate", estimate, "needs a loss: pass loss=fn(output, target), or a model giving one"
        )
    chosen = estimate if estimate != "auto" else "gradient" if loss is not None else "drift"
    return {
        "estimate": chosen,
        "inputs": inputs,
        "pairs": pairs,
        "loss": loss,
        "method": method,
        "calibration": inputs,  # a choice whose method needs none (rtn) drops it
    }


def _gives_loss(model: nn.Module, batch: Any) -> bool:
    """Whether the model's output for ``batch`` holds a ``loss`` tensor (Hugging Face, given labels)."""
    with evaluating(model), torch.no_grad():
        output = as_call(batch, "plan.calibration")(model)
    return isinstance(getattr(output, "loss", None), Tensor)
