"""``surgery.sensitivity``: which layers hurt most when pruned or quantized, and per-layer amounts.

Each selected layer is pruned alone at each amount (or its weight quantized alone at each bit
width, with ``bits=``), measured, and restored exactly. The
measure is a user's ``evaluate(model) -> float`` (accuracy, perplexity) or, by default, the
drift of the model's outputs from the unpruned outputs on ``inputs`` (1 − cosine similarity).
`Sensitivity.amounts_for(target)` then picks non-uniform per-layer amounts that reach a target
sparsity over the selected layers with the least summed damage (greedy on damage per pruned
parameter), the ``amounts`` that :func:`surgery.prune` and ``prune.amounts`` accept.
"""

from __future__ import annotations

import contextlib
import logging
import math
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
from torch import nn

from surgery.core.errors import ConfigError, ConfigTypeError
from surgery.core.handles import Handle
from surgery.core.inputs import Inputs, batches, evaluating, outputs
from surgery.core.progress import tqdm
from surgery.core.selection import Selection
from surgery.core.targets import Target
from surgery.core.verbs import VerbCall, verb
from surgery.ops.experts.linearizing import linearized
from surgery.ops.numerics.grid import GridSpec
from surgery.ops.offload.offloading import Offloaded
from surgery.ops.quantization.quantization import quantize
from surgery.ops.quantization.spec import DEFAULT_WEIGHTS, QuantizeSpec
from surgery.ops.sparsity.criteria import as_criterion
from surgery.ops.sparsity.pruning import prune, prune_targets

Evaluate = Callable[[nn.Module], float]
DEPRECATED_PLAN = "Sensitivity.plan(target) is now Sensitivity.amounts_for(target); the old name goes away in 0.4"


@dataclass(frozen=True)
class SensitivityRow:
    """One layer changed alone at one setting (a pruning amount, or a weight bit width): its
    weight count and the measured score."""

    layer: str
    setting: float
    params: int
    score: float


@dataclass
class Sensitivity:
    """What :func:`sensitivity` measured: ``rows`` and the unpruned ``baseline`` score;
    ``higher_is_better`` says which way the metric points (accuracy: True; drift and
    perplexity: False)."""

    rows: list[SensitivityRow]
    metric: str
    baseline: float
    higher_is_better: bool
    kind: str = "prune"  # or "quantize": settings are weight bit widths

    @property
    def layers(self) -> list[str]:
        return list(dict.fromkeys(row.layer for row in self.rows))

    @property
    def settings(self) -> list[float]:
        return sorted({row.setting for row in self.rows})

    def damage(self, row: SensitivityRow) -> float:
        """How much worse than the baseline a row is (>= 0 when pruning hurts; NaN scores are
        infinitely bad)."""
        if math.isnan(row.score):
            return math.inf
        change = self.baseline - row.score if self.higher_is_better else row.score - self.baseline
        return change

    def as_rows(self) -> list[dict]:
        return [asdict(row) | {"damage": self.damage(row)} for row in self.rows]

    def plan(self, target: float) -> dict[str, float]:
        """:meth:`amounts_for`'s name before 0.3 (warns until 0.4)."""
        warnings.warn(DEPRECATED_PLAN, DeprecationWarning, stacklevel=2)
        return self.amounts_for(target)

    def amounts_for(self, target: float) -> dict[str, float]:
        """Per-layer amounts reaching ``target`` sparsity over the measured layers' weights.

        Starting from nothing pruned, the layer whose next measured amount costs the least
        damage per newly pruned weight is raised, until the target is reached; the last raise
        is interpolated so that the amounts prune ``target`` of the weights (to the rounding of
        whole entries). Layers are assumed to add up independently, the usual approximation.
        """
        if self.kind != "prune":
            raise ConfigError(
                "sensitivity.target_sparsity", target, f"plans pruning amounts; this table measured {self.kind}"
            )
        top = max(self.settings)
        if isinstance(target, bool) or not isinstance(target, (int, float)) or not 0.0 <= target <= top:
            raise ConfigError(
                "sensitivity.target_sparsity", target, f"must be a number in [0, {top:g}] (the largest amount measured)"
            )
        by_layer = {
            layer: sorted((r for r in self.rows if r.layer == layer), key=lambda r: r.setting) for layer in self.layers
        }
        params = {layer: rows[0].params for layer, rows in by_layer.items()}
        goal = target * sum(params.values())
        chosen = {layer: (0.0, 0.0) for layer in by_layer}  # layer -> (amount, damage)
        pruned = 0.0
        while pruned < goal - 1e-9:
            best = None
            for layer, rows in by_layer.items():
                amount, damage = chosen[layer]
                for row in rows:
                    if row.setting <= amount:
                        continue
                    gained = (row.setting - amount) * params[layer]
                    ratio = (max(self.damage(row), 0.0) - damage) / gained
                    if best is None or ratio < best[0]:
                        best = (ratio, layer, row, gained)
            if best is None:
                break
            _, layer, row, gained = best
            previous = chosen[layer][0]
            if pruned + gained > goal:  # the last raise: only as far as the target needs
                fraction = (goal - pruned) / gained
                chosen[layer] = (previous + fraction * (row.setting - previous), chosen[layer][1])
                pruned = goal
                break
            chosen[layer] = (row.setting, max(self.damage(row), 0.0))
            pruned += gained
        return {layer: round(amount, 6) for layer, (amount, _) in chosen.items()}


@dataclass(frozen=True)
class SensitivitySpec:
    """What to measure (see :func:`sensitivity`): the pruning ``amounts`` (or weight ``bits``)
    tried on each layer, the pruning ``method`` or the ``weights`` grid, the layers, and which
    way a user's metric points."""

    amounts: Sequence[float] = (0.25, 0.5, 0.75, 0.9)
    higher_is_better: bool = True
    method: str = "l1_unstructured"
    select: Selection = None
    exclude: Selection = None
    bits: Sequence[int] | None = None
    weights: GridSpec | None = None
    quantize_method: Any = None  # with bits: the weight method, as quantize(method=) takes it (default rtn)


@verb(
    "sensitivity",
    SensitivitySpec,
    positional="amounts",
    offloaded=True,
    extras={"evaluate": None},
    renamed={"inputs": "calibration"},
    unwrap_compiled=False,
)
def sensitivity(model: nn.Module, spec: SensitivitySpec, call: VerbCall) -> Sensitivity:
    """Prune (or quantize) each selected layer alone at each setting, measure, restore.

    Args:
        model: the model; it is left exactly as it was (every change is restored). An
            offloaded model's handle (:func:`surgery.offloaded`) works too: each trial
            compresses the block holding the layer and the metric runs offloaded.
        amounts: the pruning amounts to try on each layer, each in (0, 1].
        calibration: batches for the default metric, the drift 1 − cosine(outputs, unchanged
            outputs), and for calibrated methods (before 0.3 the metric's were ``inputs=``).
        evaluate: ``evaluate(model) -> float`` instead (accuracy, perplexity...), with
            ``higher_is_better`` saying which way it points.
        method, select, exclude: as for :func:`surgery.prune` (layer scope).
        spec: a :class:`SensitivitySpec` holding the settings (the keywords are a shorthand for it).
        bits: quantize instead of pruning: each layer's weight alone at each of these bit
            widths, with the other settings of ``weights`` (default symmetric per channel).
        quantize_method: with ``bits``, the weight method (``"gptq"``, ``GptqSettings(...)``, as
            :func:`surgery.quantize`'s ``method``); a calibrated one uses ``calibration``.
        progress: a progress bar over the (layer, setting) trials (on a terminal).

    Example:
        >>> table = surgery.sensitivity(model, calibration=batches)
        >>> surgery.prune(model, 0.5, amounts=table.amounts_for(0.5))
    """
    amounts, higher_is_better, method, bits, weights = (
        spec.amounts,
        spec.higher_is_better,
        spec.method,
        spec.bits,
        spec.weights,
    )
    select, exclude, calibration, evaluate, progress = (
        spec.select,
        spec.exclude,
        call.calibration,
        call.extras["evaluate"],
        call.progress,
    )
    inputs = calibration
    source = model  # an offloaded model's handle: each trial compresses one block of it
    model = model.model if isinstance(model, Offloaded) else model
    settings = _check_bits(bits) if bits is not None else _check_amounts(amounts)
    if evaluate is None and inputs is None:
        raise ConfigError(
            "sensitivity.calibration",
            None,
            "pass calibration batches (for output drift) or evaluate=fn(model) -> float",
        )
    if evaluate is not None and not callable(evaluate):
        raise ConfigTypeError("sensitivity.evaluate", evaluate, "must be a function model -> float")
    if evaluate is None:
        reference = model_outputs(model, inputs)
        evaluate, higher_is_better, metric = (
            (lambda m: output_drift(reference, model_outputs(m, inputs))),
            False,
            "drift",
        )
    else:
        metric = getattr(evaluate, "__name__", "score")
    if bits is None and spec.quantize_method is not None:
        raise ConfigError(
            "sensitivity.quantize_method", spec.quantize_method, "applies with bits (quantize each layer)"
        )
    quantizing = QuantizeSpec(weights=weights or DEFAULT_WEIGHTS, method=spec.quantize_method)
    template, quantize_method = quantizing.weights, quantizing.method

    calibrated = as_criterion(method).needs_calibration if bits is None else None

    def change(target: Target, setting: float) -> Handle:
        if bits is not None:
            grid = replace(template, bits=int(setting))
            return quantize(
                source,
                weights=grid,
                method=quantize_method,
                select=[target.name],
                progress=False,
                calibration=calibration if quantizing.weight_method.needs_calibration else None,
            )
        batches = calibration if calibrated else None  # the metric's batches are no criterion's statistics
        return prune(source, setting, method=method, select=[target.name], calibration=batches, progress=False)

    with contextlib.nullcontext() if isinstance(source, Offloaded) else linearized(model):  # each expert a row
        targets = prune_targets(model, select, exclude).matched
        baseline = _score(evaluate, model, "baseline")
        rows: list[SensitivityRow] = []
        trials = [(target, setting) for target in targets.values() for setting in settings]
        for target, setting in tqdm(
            trials, unit="trial", desc="sensitivity", leave=False, disable=None if progress else True
        ):
            with quiet_selection_logs():  # one selection log line per trial would drown the table
                handle = change(target, setting)
            try:
                score = _score(evaluate, model, f"{target.module_name} at {setting:g}")
            finally:
                handle.restore()
            rows.append(SensitivityRow(target.module_name, setting, target.param.numel(), score))
    return Sensitivity(rows, metric, baseline, higher_is_better, "prune" if bits is None else "quantize")


def _check_bits(bits: object) -> list[float]:
    if isinstance(bits, (str, bytes)) or not isinstance(bits, Sequence) or not bits:
        raise ConfigTypeError("sensitivity.bits", bits, "must be a non-empty list of bit widths in [2, 8]")
    for width in bits:
        if isinstance(width, bool) or not isinstance(width, int) or not 2 <= width <= 8:
            raise ConfigError("sensitivity.bits", width, "each bit width must be an integer in [2, 8]")
    return sorted({float(b) for b in bits}, reverse=True)


@contextlib.contextmanager
def quiet_selection_logs() -> Iterator[None]:
    """Within the block, the surgery logger says only warnings (one selection line per trial would drown a table)."""
    logger = logging.getLogger("surgery")
    level = logger.level
    logger.setLevel(max(level, logging.WARNING))
    try:
        yield
    finally:
        logger.setLevel(level)


def _check_amounts(amounts: object) -> list[float]:
    if isinstance(amounts, (str, bytes)) or not isinstance(amounts, Sequence) or not amounts:
        raise ConfigTypeError("sensitivity.amounts", amounts, "must be a non-empty list of numbers in (0, 1]")
    for amount in amounts:
        if isinstance(amount, bool) or not isinstance(amount, (int, float)) or not 0.0 < amount <= 1.0:
            raise ConfigError("sensitivity.amounts", amount, "each amount must be a number in (0, 1]")
    return sorted({float(a) for a in amounts})


def _score(evaluate: Evaluate, model: nn.Module, what: str) -> float:
    value = evaluate(model)
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigTypeError(
            "sensitivity.evaluate", type(value).__name__, f"returned this for {what}; it must return one number"
        )
    if math.isnan(value):
        raise ConfigError(
            "sensitivity.evaluate",
            value,
            f"returned NaN for {what}; a NaN score cannot be ranked (an infinite one can)",
        )
    return float(value)


def model_outputs(model: nn.Module, inputs: Inputs) -> list[torch.Tensor]:
    """The model's outputs on each batch, in eval mode without gradients."""
    with evaluating(model), torch.no_grad():
        return [
            t.detach().float().flatten()
            for call in batches(inputs, "sensitivity.calibration")
            for t in outputs(model, call)
        ]


def output_drift(reference: list[torch.Tensor], candidate: list[torch.Tensor]) -> float:
    """1 − cosine similarity of all outputs together (0: unchanged); NaN if any is not finite."""
    a, b = torch.cat(reference), torch.cat(candidate)
    if not torch.isfinite(b).all():
        return math.nan
    if torch.equal(a, b):
        return 0.0  # float32 cosine of a vector with itself can exceed 1 by an ulp
    return max(0.0, float(1.0 - torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=0)))
