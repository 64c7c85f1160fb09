"""Pruning criteria: registered scoring functions, and masks computed from their scores.

A criterion scores every entry of a weight, ``score(weight, stats) -> Tensor`` of the weight's
shape (importance: the lowest scores are pruned); ``stats`` is what calibration captured for
that layer (:class:`LayerStats`) or ``None`` without calibration. A *structured* criterion
returns one score per slice along ``dim`` and whole slices are pruned. A criterion may also
take any of the keyword arguments ``n``, ``dim``, ``scope``, ``generator`` (a seeded
``torch.Generator`` shared by all layers of one call). The built-ins register through
:func:`register_criterion` like any user criterion.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from surgery.core.errors import ConfigError, ConfigTypeError
from surgery.core.registry import Registry
from surgery.ops.second_order.reconstruction import sparsegpt

SCOPES = ("layer", "global")


@dataclass(frozen=True)
class LayerStats:
    """What calibration captured for one layer: the per-input-feature sums of squares of its
    inputs over ``rows`` rows (tokens, pixels, samples). Features are the input's channel axis
    for convolutions and its last axis otherwise (``in_features``; for Hugging Face ``Conv1D``
    that is the weight's dim 0).

    For a criterion registered with ``needs_gradients=True`` (calibration runs a loss
    backward), also ``taylor``, Σ over batches of |w ⊙ ∂L/∂w| with the weight's shape, and
    ``grad_sq``, Σ (∂L/∂w)² (the diagonal Fisher information); ``None`` otherwise."""

    name: str
    input_sq_norms: Tensor
    rows: int
    weight_axis: int = 1  # the weight's input-feature axis: 1 for Linear and convolutions, 0 for HF Conv1D
    taylor: Tensor | None = None
    grad_sq: Tensor | None = None

    @property
    def input_norms(self) -> Tensor:
        """‖X_j‖₂ per input feature (Wanda's activation norm), a 1-d tensor."""
        return self.input_sq_norms.sqrt()

    def norms_like(self, weight: Tensor) -> Tensor:
        """:attr:`input_norms` shaped to broadcast against ``weight`` along its input-feature
        axis, in float32 (as the reference code keeps them: a float16 norm overflows past 65504):
        ``weight.abs() * stats.norms_like(weight)`` is Wanda's score, in float32, for Linear,
        convolutions and Hugging Face ``Conv1D`` alike."""
        features = self.input_sq_norms.numel()
        if weight.dim() <= self.weight_axis or weight.shape[self.weight_axis] != features:
            raise ConfigError(
                "prune.calibration",
                self.name,
                f"has {features} input features but its weight "
                f"{tuple(weight.shape)} has {weight.shape[self.weight_axis] if weight.dim() > self.weight_axis else 'no'}"
                f" along axis {self.weight_axis} (a grouped convolution?); per-feature scores do not apply",
            )
        shape = [1] * weight.dim()
        shape[self.weight_axis] = features
        return self.input_norms.float().view(shape)


Score = Callable[..., Tensor]
Reconstruct = Callable[..., tuple[Tensor, Tensor]]  # (matrix, hessian, amount, *, pattern) -> (new matrix, keep)


@dataclass(frozen=True)
class Criterion:
    """A registered scoring function and how its scores are used."""

    name: str
    score: Score
    structured: bool = False  # one score per slice along ``dim``: whole slices pruned
    needs_calibration: bool = False  # raise without calibration batches instead of passing None
    needs_gradients: bool = False  # calibration runs a loss backward: LayerStats.taylor and grad_sq
    reconstruct: Reconstruct | None = None  # second-order: picks the mask and updates the weights kept
    per_output: bool = False  # ranked within each output row: every row loses ``amount`` of its entries (Wanda)

    def keywords(self, options: dict) -> dict:
        """The options this criterion's signature accepts (all of them with ``**kwargs``),
        checked against a call ``score(weight, stats, **options)``."""
        try:
            signature = inspect.signature(self.score)
        except (TypeError, ValueError):  # a builtin without a signature
            return {}
        params = signature.parameters.values()
        accepted = (
            options
            if any(p.kind is p.VAR_KEYWORD for p in params)
            else {k: v for k, v in options.items() if k in signature.parameters}
        )
        try:
            signature.bind(None, None, **accepted)
        except TypeError as err:
            raise ConfigError(
                "prune.method",
                self.name,
                f"cannot be called as score(weight, stats): {err}; it may "
                "also take n, dim, scope and generator as keywords",
            ) from None
        return accepted


CRITERIA: Registry[Criterion] = Registry("prune.method")


def register_criterion(
    name: str,
    score: Score | None,
    *,
    structured: bool = False,
    needs_calibration: bool = False,
    needs_gradients: bool = False,
    reconstruct: Reconstruct | None = None,
    per_output: bool = False,
    replace: bool = False,
) -> Criterion:
    """Make ``score(weight, stats) -> Tensor`` available as ``prune(..., method=name)`` and
    ``prune.method=name`` in recipes. ``needs_gradients`` makes calibration batches
    ``(inputs, target)`` pairs run through a loss and backward, filling ``stats.taylor`` and
    ``stats.grad_sq`` (it implies ``needs_calibration``). ``per_output`` ranks the scores
    within each output row (each row of a Linear, each filter of a convolution) instead of
    across the layer, as Wanda does: every row loses ``int(amount × row length)`` entries.

    A criterion that needs calibration (and no gradients) is calibrated layer by layer on the
    already pruned model, as SparseGPT is: each layer's statistics come from inputs that the
    pruned layers before it produced.

    A second-order method passes ``reconstruct(matrix, hessian, amount, *, pattern, name) ->
    (new matrix, keep-mask)`` instead of a score: it receives each layer's weight as an
    (outputs, input columns) matrix and the Hessian ``2XᵀX`` of its inputs, layer after layer
    with the earlier layers already pruned (:mod:`surgery.core.sequential`), and returns the
    updated weights with their mask (``"sparsegpt"`` is registered this way).

    Example:
        >>> surgery.register_criterion("wanda_like", lambda w, stats: w.abs() * stats.norms_like(w),
        ...                            needs_calibration=True)
    """
    if reconstruct is not None:
        if not callable(reconstruct):
            raise ConfigError(
                "register_criterion.reconstruct",
                reconstruct,
                "must be a function (matrix, hessian, amount, *, pattern, name) -> (new matrix, keep-mask)",
            )
        score = score or _no_score(name)
    if not callable(score):
        raise ConfigError("register_criterion.score", score, "must be a function score(weight, stats) -> Tensor")
    for flag, value in (
        ("structured", structured),
        ("needs_calibration", needs_calibration),
        ("needs_gradients", needs_gradients),
        ("per_output", per_output),
    ):
        if not isinstance(value, bool):
            raise ConfigTypeError(f"register_criterion.{flag}", value, "must be True or False")
    if per_output and (structured or reconstruct is not None):
        raise ConfigError(
            "register_criterion.per_output",
            per_output,
            "ranks single entries within each row; it does not apply to a structured or second-order criterion",
        )
    criterion = Criterion(
        name,
        score,
        structured,
        needs_calibration or needs_gradients or reconstruct is not None,
        needs_gradients,
        reconstruct,
        per_output,
    )
    return CRITERIA.register(name, criterion, replace=replace)


def _no_score(name: str) -> Score:
    def score(weight: Tensor, stats: LayerStats | None) -> Tensor:
        raise ConfigError(
            "prune.method",
            name,
            "chooses its mask while it reconstructs each layer, with the "
            "layer's input Hessian; it has no standalone score (use surgery.prune with calibration)",
        )

    return score


def as_criterion(method: str | Score | Criterion) -> Criterion:
    """The criterion for a registered name, a :class:`Criterion`, or a plain scoring function."""
    if isinstance(method, Criterion):
        return method
    if isinstance(method, str):
        return CRITERIA.get(method)
    if callable(method):
        return Criterion(getattr(method, "__name__", type(method).__name__), method)
    raise ConfigError(
        "prune.method",
        method,
        f"must be one of {', '.join(CRITERIA.names())} or a function score(weight, stats) -> Tensor",
    )


def l1_unstructured(weight: Tensor, stats: LayerStats | None) -> Tensor:
    """|w|: the smallest magnitudes are pruned."""
    return weight.abs()


def random_unstructured(weight: Tensor, stats: LayerStats | None, *, generator: torch.Generator) -> Tensor:
    """Uniform random scores from the call's seeded generator (the global RNG is untouched)."""
    return torch.rand(weight.shape, generator=generator).to(weight.device)


def ln_structured(weight: Tensor, stats: LayerStats | None, *, n: float, dim: int, scope: str) -> Tensor:
    """The Ln norm of each slice along ``dim``; with ``scope="global"`` divided by
    ``numel ** (1/n)`` of the slice so that layers of different fan-in compare fairly."""
    dims = [d for d in range(weight.dim()) if d != dim % weight.dim()]
    norms = torch.linalg.vector_norm(weight.float(), ord=n, dim=dims)
    if scope == "global" and math.isfinite(n):
        norms = norms / (weight.numel() // weight.shape[dim]) ** (1.0 / n)
    return norms


def wanda(weight: Tensor, stats: LayerStats | None) -> Tensor:
    """|W| · ‖X_j‖ (Sun et al., Wanda): a weight matters as much as the inputs it multiplies;
    ``‖X_j‖`` over calibration batches, along the weight's input-feature axis. Registered as
    ``"wanda"``, ranked within each output row as in the paper, and as ``"wanda_layer"``,
    ranked across the whole layer."""
    return weight.abs() * stats.norms_like(weight)


def taylor(weight: Tensor, stats: LayerStats | None) -> Tensor:
    """First-order Taylor importance, Σ over calibration batches of |w · ∂L/∂w| (Molchanov et
    al.): the loss change a weight's removal would cause, to first order."""
    return stats.taylor.to(weight.device)


register_criterion("l1_unstructured", l1_unstructured)
register_criterion("random_unstructured", random_unstructured)
register_criterion("ln_structured", ln_structured, structured=True)
register_criterion("wanda", wanda, needs_calibration=True, per_output=True)
register_criterion("wanda_layer", wanda, needs_calibration=True)
register_criterion("taylor", taylor, needs_gradients=True)
register_criterion("sparsegpt", None, reconstruct=sparsegpt)


def compute_scores(
    criterion: Criterion,
    weights: dict[str, Tensor],
    stats: dict[str, LayerStats | None],
    *,
    n: float = 2.0,
    dim: int = 0,
    scope: str = "layer",
    seed: int = 0,
) -> list[Tensor]:
    """One score tensor per weight, checked: the weight's shape (``(size of dim,)`` for a
    structured criterion), real numbers, no NaN."""
    options = {"n": n, "dim": dim, "scope": scope, "generator": torch.Generator().manual_seed(seed)}
    kwargs = criterion.keywords(options)
    scores = []
    for name, weight in weights.items():
        if criterion.needs_calibration and stats.get(name) is None:
            raise ConfigError(
                "prune.select",
                name,
                f"has no input statistics, which {criterion.name!r} needs (only "
                "the weight of a Linear, convolution or Conv1D layer has them); exclude it",
            )
        if criterion.needs_gradients and stats[name].taylor is None:
            raise ConfigError(
                "prune.select",
                name,
                f"received no gradient during calibration, which "
                f"{criterion.name!r} needs (frozen, or not on the loss's path); exclude it",
            )
        score = criterion.score(weight.detach().clone(), stats.get(name), **kwargs)  # a copy: the weight stays safe
        expected = (weight.shape[dim],) if criterion.structured else tuple(weight.shape)
        if not isinstance(score, Tensor) or tuple(score.shape) != expected:
            got = tuple(score.shape) if isinstance(score, Tensor) else type(score).__name__
            raise ConfigError(
                "prune.method",
                criterion.name,
                f"returned {got} for {name}; a score must have shape "
                f"{expected} ({'one per slice along dim' if criterion.structured else 'the weight'}'s)",
            )
        if score.is_complex() or score.dtype == torch.bool:
            raise ConfigError(
                "prune.method", criterion.name, f"returned dtype {score.dtype} for {name}; scores must be real numbers"
            )
        if torch.isnan(score).any():
            raise ConfigError("prune.method", criterion.name, f"returned NaN scores for {name}; a NaN cannot be ranked")
        scores.append(score)
    return scores


def compute_masks(
    weights: list[Tensor],
    amount: float,
    *,
    method: str | Score | Criterion = "l1_unstructured",
    scope: str = "layer",
    n: float = 2.0,
    dim: int = 0,
    seed: int = 0,
    stats: list[LayerStats | None] | None = None,
) -> list[Tensor]:
    """One boolean keep-mask per weight (``True`` keeps the entry) for ``method``: the
    criterion's scores (:func:`compute_scores`) ranked by :func:`masks_from_scores` (per
    output row along dim 0 for a ``per_output`` criterion). Reads the weights, never writes them."""
    criterion = as_criterion(method)
    named = {str(i): w for i, w in enumerate(weights)}
    by_name = {str(i): s for i, s in enumerate(stats or [])}
    scores = compute_scores(criterion, named, by_name, n=n, dim=dim, scope=scope, seed=seed)
    return masks_from_scores(
        weights,
        scores,
        amount,
        scope=scope,
        structured=criterion.structured,
        dim=dim,
        output_axes=[0] * len(weights) if criterion.per_output else None,
    )


def masks_from_scores(
    weights: list[Tensor],
    scores: list[Tensor],
    amount: float | list[float],
    *,
    scope: str,
    structured: bool,
    dim: int = 0,
    output_axes: list[int] | None = None,
) -> list[Tensor]:
    """One boolean keep-mask per weight (``True`` keeps the entry) from its scores.

    ``amount`` is the fraction of entries (or of slices, when ``structured``) to prune, rounded
    to the nearest whole count, or one fraction per weight (``scope="layer"``); the lowest
    scores go. With ``scope="global"`` the ranking is shared by all weights. With
    ``output_axes`` (one per weight, ``scope="layer"``), each slice along a weight's output
    axis (a row) is ranked on its own and loses ``int(amount × row length)`` entries, ties
    broken by position, as Wanda's reference code does.
    """
    if scope == "global":
        keeps = _split(_keep_smallest_pruned(torch.cat([s.flatten().float() for s in scores]), amount), scores)
    else:
        each = amount if isinstance(amount, list) else [amount] * len(scores)
        if output_axes is not None:
            return [_keep_smallest_per_row(s, a, axis) for s, a, axis in zip(scores, each, output_axes)]
        keeps = [_keep_smallest_pruned(s.flatten().float(), a).view(s.shape) for s, a in zip(scores, each)]
    if structured:
        keeps = [_expand(keep, w, dim) for keep, w in zip(keeps, weights)]
    return keeps


def parse_pattern(pattern: object, field: str = "prune.pattern") -> tuple[int, int]:
    """``"N:M"`` as ``(N, M)``: N weights kept in every group of M consecutive input features."""
    parts = pattern.split(":") if isinstance(pattern, str) else []
    if len(parts) != 2 or not all(part.strip().isdigit() for part in parts):
        raise ConfigError(field, pattern, "must be 'N:M' (N weights kept in every M consecutive inputs, e.g. '2:4')")
    kept, group = int(parts[0]), int(parts[1])
    if not 1 <= kept < group <= 1024:
        raise ConfigError(field, pattern, "needs 1 <= N < M <= 1024 (e.g. '2:4', '4:8')")
    return kept, group


def masks_n_m(scores: list[Tensor], names: list[str], axes: list[int], kept: int, group: int) -> list[Tensor]:
    """Keep-masks with the ``kept`` highest scores in every group of ``group`` consecutive
    entries along each weight's input axis (``axes``)."""
    masks = []
    for score, name, axis in zip(scores, names, axes):
        if score.dim() < 2 or score.shape[axis] % group:
            got = score.shape[axis] if score.dim() >= 2 else "no"
            raise ConfigError(
                "prune.pattern",
                f"{kept}:{group}",
                f"{name} has {got} input features along axis "
                f"{axis}, not a multiple of {group}; exclude it or pick another M",
            )
        moved = score.float().movedim(axis, -1)
        flat = moved.reshape(-1, group)
        keep = torch.zeros_like(flat, dtype=torch.bool)
        keep.scatter_(1, torch.topk(flat, kept, dim=1).indices, True)
        masks.append(keep.view(moved.shape).movedim(-1, axis).contiguous())
    return masks


def _keep_smallest_pruned(scores: Tensor, amount: float) -> Tensor:
    count = round(amount * scores.numel())
    keep = torch.ones_like(scores, dtype=torch.bool)
    if count > 0:
        keep[torch.topk(scores, count, largest=False, sorted=False).indices] = False
    return keep


def _keep_smallest_per_row(scores: Tensor, amount: float, axis: int) -> Tensor:
    rows = scores.float().movedim(axis, 0)
    flat = rows.reshape(rows.shape[0], -1)
    keep = torch.ones_like(flat, dtype=torch.bool)
    count = int(flat.shape[1] * amount)
    if count > 0:
        keep.scatter_(1, torch.sort(flat, dim=1, stable=True).indices[:, :count], False)
    return keep.view(rows.shape).movedim(0, axis).contiguous()


def _split(flat: Tensor, like: list[Tensor]) -> list[Tensor]:
    sizes = [t.numel() for t in like]
    return [part.view(t.shape) for part, t in zip(flat.split(sizes), like)]


def _expand(keep: Tensor, weight: Tensor, dim: int) -> Tensor:
    shape = [1] * weight.dim()
    shape[dim] = weight.shape[dim]
    return keep.view(shape).expand(weight.shape).clone()


def pack(mask: Tensor) -> Tensor:
    """Pack a boolean mask into a ``uint8`` tensor holding eight entries per byte."""
    flat = mask.flatten().to(torch.uint8)
    flat = torch.nn.functional.pad(flat, (0, (-flat.numel()) % 8)).view(-1, 8)
    weights = torch.arange(8, dtype=torch.uint8, device=mask.device)
    return (flat << weights).sum(dim=1, dtype=torch.uint8)


def unpack(packed: Tensor, shape: torch.Size) -> Tensor:
    """Invert :func:`pack` for a mask of the given shape."""
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    bits = (packed.unsqueeze(1) >> shifts) & 1
    return bits.flatten()[: math.prod(shape)].view(shape).bool()
