"""The knapsack: exact against brute force, within the budget, the Lagrangian close behind."""

from __future__ import annotations

import itertools
import random

from surgery.ops.planning import solver
from surgery.ops.planning.solver import Option, smallest, solve


def random_problem(seed: int, layers: int = 6, choices: int = 4) -> list[list[Option]]:
    rng = random.Random(seed)
    return [[Option(rng.randint(1, 40), rng.random()) for _ in range(choices)] for _ in range(layers)]


def brute_force(options: list[list[Option]], budget: int) -> float:
    best = float("inf")
    for picks in itertools.product(*(range(len(layer)) for layer in options)):
        size = sum(options[i][k].bytes for i, k in enumerate(picks))
        if size <= budget:
            best = min(best, sum(options[i][k].score for i, k in enumerate(picks)))
    return best


def test_the_exact_solve_equals_brute_force_and_keeps_the_budget():
    for seed in range(20):
        options = random_problem(seed)
        budget = smallest(options) + random.Random(seed).randint(0, 80)
        picks, how = solve(options, budget)
        assert how == "exact"
        assert sum(options[i][k].bytes for i, k in enumerate(picks)) <= budget
        assert abs(sum(options[i][k].score for i, k in enumerate(picks)) - brute_force(options, budget)) < 1e-12


def test_the_lagrangian_keeps_the_budget_and_stays_near_the_optimum(monkeypatch):
    monkeypatch.setattr(solver, "FRONT_LIMIT", 1)  # the front outgrows it at once
    for seed in range(20):
        options = random_problem(seed)
        budget = smallest(options) + 60
        picks, how = solve(options, budget)
        assert how == "lagrangian"
        assert sum(options[i][k].bytes for i, k in enumerate(picks)) <= budget
        # a relaxation plus greedy fill: measured within 35 % of the optimum on these problems
        assert sum(options[i][k].score for i, k in enumerate(picks)) <= 1.35 * brute_force(options, budget) + 1e-9
