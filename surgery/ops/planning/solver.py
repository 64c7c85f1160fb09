"""The multiple-choice knapsack behind a plan: one option per layer, the summed score least,
the summed bytes within the budget.

Exact by dynamic programming over the Pareto front of (bytes, score) partial plans, layer
after layer (a partial plan that costs more and scores no better than another is dropped).
When the front outgrows :data:`FRONT_LIMIT` (many layers, many distinct sizes), a Lagrangian
relaxation instead: bisect the price λ of a byte so that each layer's cheapest
``score + λ · bytes`` option fits, then spend what is left greedily on the upgrades that buy
the most score per byte."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

FRONT_LIMIT = 50_000


@dataclass(frozen=True)
class Option:
    """One option of a layer: its bytes and score (lower is better)."""

    bytes: int
    score: float


def smallest(options: Sequence[Sequence[Option]]) -> int:
    """The fewest bytes any plan reaches: every layer at its smallest option."""
    return sum(min(o.bytes for o in layer) for layer in options)


def solve(options: Sequence[Sequence[Option]], budget: int) -> tuple[list[int], str]:
    """The index of the chosen option of each layer, and ``"exact"`` or ``"lagrangian"``;
    the budget must be reachable (:func:`smallest`)."""
    exact = _pareto(options, budget)
    if exact is not None:
        return exact, "exact"
    return _lagrangian(options, budget), "lagrangian"


def _pareto(options: Sequence[Sequence[Option]], budget: int) -> list[int] | None:
    """Exact DP over the Pareto front; None when the front grows past FRONT_LIMIT."""
    rest = [0] * (len(options) + 1)  # the fewest bytes the layers after each one need
    for i in range(len(options) - 1, -1, -1):
        rest[i] = rest[i + 1] + min(o.bytes for o in options[i])
    front: list[tuple[int, float, tuple]] = [(0, 0.0, ())]  # (bytes, score, choice path as nested pairs)
    for i, layer in enumerate(options):
        grown = [
            (b + o.bytes, s + o.score, (path, k))
            for b, s, path in front
            for k, o in enumerate(layer)
            if b + o.bytes + rest[i + 1] <= budget
        ]
        grown.sort(key=lambda item: (item[0], item[1]))
        front = []
        for item in grown:  # keep only those scoring better than every cheaper one
            if not front or item[1] < front[-1][1]:
                front.append(item)
        if len(front) > FRONT_LIMIT:
            return None
    best = min(front, key=lambda item: (item[1], item[0]))[2]
    picks: list[int] = []
    while best:
        best, k = best
        picks.append(k)
    return picks[::-1]


def _cheapest(options: Sequence[Sequence[Option]], price: float) -> list[int]:
    return [
        min(range(len(layer)), key=lambda k: (layer[k].score + price * layer[k].bytes, layer[k].bytes))
        for layer in options
    ]


def _lagrangian(options: Sequence[Sequence[Option]], budget: int) -> list[int]:
    """Bisect the byte price until the relaxed plan fits, then fill the slack greedily."""

    def size(picks: list[int]) -> int:
        return sum(options[i][k].bytes for i, k in enumerate(picks))

    low, high = 0.0, 1.0
    while size(_cheapest(options, high)) > budget and high < 1e30:
        high *= 4
    for _ in range(100):
        middle = (low + high) / 2
        low, high = (middle, high) if size(_cheapest(options, middle)) > budget else (low, middle)
    picks = _cheapest(options, high)
    if size(picks) > budget:  # the price could not bring it down: every layer at its smallest
        picks = [min(range(len(layer)), key=lambda k: layer[k].bytes) for layer in options]
    return _fill(options, picks, budget - size(picks))


def _fill(options: Sequence[Sequence[Option]], picks: list[int], slack: int) -> list[int]:
    """Spend ``slack`` bytes on the upgrades gaining the most score per byte, while any fits."""
    while True:
        best = None
        for i, layer in enumerate(options):
            now = layer[picks[i]]
            for k, o in enumerate(layer):
                extra, gain = o.bytes - now.bytes, now.score - o.score
                if gain > 0 and extra <= slack:
                    ratio = gain / max(extra, 1e-9)
                    if best is None or ratio > best[0]:
                        best = (ratio, i, k, extra)
        if best is None:
            return picks
        _, i, k, extra = best
        picks[i], slack = k, slack - extra
