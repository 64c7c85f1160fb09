"""PruneSpec, the settings of :func:`surgery.prune`, and the checks of its amount, method and pattern."""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from surgery.core.errors import ConfigError, ConfigTypeError
from surgery.core.inputs import present_device
from surgery.core.originals import check_place
from surgery.core.sequential import UNROUTED_POLICIES
from surgery.core.targets import Targets
from surgery.ops.sparsity.criteria import (
    CRITERIA,
    SCOPES,
    Criterion,
    as_criterion,
    parse_pattern,
)


@dataclass(frozen=True)
class PruneSpec:
    """How to prune, validated when built: ``PruneSpec(amount=9)`` raises at once.

    ``method`` is a registered criterion name (``surgery.register_criterion``) or a scoring
    function ``score(weight, stats) -> Tensor``; see :func:`prune` for the other fields.
    """

    amount: float = 0.5
    method: Any = "l1_unstructured"  # a registered criterion name, a Criterion or a Score function
    scope: str = "layer"
    n: float = 2.0
    dim: int = 0
    seed: int = 0
    pattern: str | None = None
    select: Any = None
    exclude: Any = None
    blocks: Any = None  # layer-by-layer methods: blocks calibrated in turn (None: found; False: layers)
    amounts: Any = None  # {layer: amount} overriding amount (scope="layer")
    onload: str | None = None  # layer-by-layer methods: the device each block is calibrated on (cuda)
    originals: str = "memory"  # where the weights' original values wait for restore(): memory or disk
    unrouted: str = "refuse"  # calibrated methods: a layer no calibration token reached (an expert): refuse, or "rtn"

    def __post_init__(self) -> None:
        amount, n = validate_arguments(self.amount, self.method, self.scope, self.n, self.seed)
        check_place(self.originals, "prune.originals")
        if self.unrouted not in UNROUTED_POLICIES:
            raise ConfigError(
                "prune.unrouted",
                self.unrouted,
                f"must be one of {', '.join(UNROUTED_POLICIES)} (rtn: a layer no calibration token reached is "
                "pruned by magnitude)",
            )
        layer_by_layer = self.criterion.needs_calibration and not self.criterion.needs_gradients
        if self.unrouted == "rtn" and not (layer_by_layer and self.scope == "layer"):
            why = (
                "is not calibrated: no layer misses statistics"
                if not self.criterion.needs_calibration
                else f"with scope={self.scope!r} calibrates every layer at once"
            )
            raise ConfigError(
                "prune.unrouted",
                "rtn",
                f"applies to methods calibrated layer by layer (wanda, sparsegpt with scope='layer'); "
                f"{self.criterion.name!r} {why}",
            )
        if self.onload is not None:
            present_device(self.onload, "prune.onload")
        if self.pattern is not None:
            check_pattern(self.pattern, amount, self.criterion)
        if self.criterion.per_output and self.scope != "layer":
            layer_wide = " (or method='wanda_layer')" if self.criterion.name == "wanda" else ""
            raise ConfigError(
                "prune.scope",
                self.scope,
                f"{self.criterion.name!r} ranks weights within each output row; use scope='layer'{layer_wide}",
            )
        if isinstance(self.dim, bool) or not isinstance(self.dim, int):
            raise ConfigTypeError(
                "prune.dim", self.dim, "must be an integer (the dimension whose slices a structured criterion prunes)"
            )
        object.__setattr__(self, "amount", amount)
        object.__setattr__(self, "n", n)
        object.__setattr__(self, "exclude", self.exclude or None)
        if self.amounts is not None and not isinstance(self.amounts, Mapping):
            raise ConfigTypeError(
                "prune.amounts", self.amounts, "must be a dict {layer: amount} (or an amounts YAML file in recipes)"
            )

    @property
    def criterion(self) -> Criterion:
        return as_criterion(self.method)


def layer_amounts(selection: Targets, spec: PruneSpec, amounts: Mapping[str, float] | None) -> dict[str, float]:
    """The amount of each selected parameter: ``amounts[layer]`` where given, else ``spec.amount``."""
    per_layer = {name: spec.amount for name in selection.matched}
    if amounts is None:
        return per_layer
    if not isinstance(amounts, Mapping):
        raise ConfigTypeError(
            "prune.amounts", amounts, "must be a dict {layer: amount} (or an amounts YAML file in recipes)"
        )
    if spec.scope != "layer" or spec.pattern is not None:
        raise ConfigError("prune.amounts", dict(amounts), "sets one amount per layer: use scope='layer' and no pattern")
    layers = {target.module_name: name for name, target in selection.matched.items()}
    for layer, amount in amounts.items():
        if isinstance(amount, bool) or not isinstance(amount, (int, float)) or not 0.0 <= amount <= 1.0:
            raise ConfigError(f"prune.amounts[{layer!r}]", amount, "must be a number in [0, 1]")
        if layer not in layers:
            if amount == 0:  # amounts may list layers this run leaves dense anyway (an excluded head)
                continue
            close = difflib.get_close_matches(str(layer), list(layers), n=3)
            raise ConfigError(
                "prune.amounts",
                layer,
                "is not a selected layer",
                f"closest: {', '.join(close)}" if close else f"selected: {', '.join(list(layers)[:5])}...",
            )
        per_layer[layers[layer]] = float(amount)
    return per_layer


def group_share(amount: float, size: int, group: int, groups: int) -> float:
    """The amount for one of ``groups`` equal parts of a weight such that the parts together
    prune exactly ``round(amount × numel)`` entries (rounding once, over the whole weight)."""
    if groups == 1:
        return amount
    total = amount * size * groups
    return (round(total * (group + 1) / groups) - round(total * group / groups)) / size


def check_pattern(pattern: object, amount: float, criterion: Criterion) -> None:
    """An N:M pattern fixes the amount (``1 - N/M``) and ranks entries within groups."""
    kept, group = parse_pattern(pattern)
    if criterion.structured:
        raise ConfigError(
            "prune.pattern",
            pattern,
            f"applies to criteria that score each weight; {criterion.name!r} scores whole slices",
        )
    if abs(amount - (1 - kept / group)) > 1e-9:
        raise ConfigError(
            "prune.amount",
            amount,
            f"disagrees with pattern {pattern!r}, which prunes "
            f"{1 - kept / group:g} of every group; pass amount={1 - kept / group:g}",
        )


def validate_arguments(amount: object, method: object, scope: str, n: object, seed: object) -> tuple[float, float]:
    """Check prune's settings (also used by the CLI config); return ``(amount, norm order)``."""
    if isinstance(amount, bool) or not isinstance(amount, (int, float)):
        raise ConfigTypeError("prune.amount", amount, "must be a number in [0, 1]")
    if amount != amount or not 0.0 <= amount <= 1.0:  # NaN, or out of range (huge integers too)
        raise ConfigError("prune.amount", amount, "must be a number in [0, 1]")
    if not callable(method) and not isinstance(method, Criterion) and method not in CRITERIA:
        CRITERIA.get(method)  # raises, listing the registered criteria
    if scope not in SCOPES:
        raise ConfigError("prune.scope", scope, f"must be one of {', '.join(SCOPES)}")
    norm = {"inf": math.inf, "fro": 2.0}.get(n, n) if isinstance(n, str) else n
    if isinstance(norm, int) and not isinstance(norm, bool) and norm > 1e308:
        norm = math.inf  # an integer too large for a float: the max norm, as 'inf'
    if isinstance(norm, bool) or not isinstance(norm, (int, float)) or math.isnan(norm) or norm <= 0:
        raise ConfigError("prune.n", n, "must be a positive number, 'inf' or 'fro'")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ConfigTypeError("prune.seed", seed, "must be an integer")
    if not -(2**63) <= seed < 2**63:
        raise ConfigError("prune.seed", seed, "must fit in 64 bits")
    return float(amount), float(norm)
