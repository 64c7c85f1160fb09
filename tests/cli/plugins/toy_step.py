"""A user's step, one file: prune a random share of every layer's weights, seeded."""

from dataclasses import dataclass

import surgery
from surgery.cli.steps import Step, register_step


@dataclass(frozen=True)
class RandomPruneSettings:
    amount: float = 0.5
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.amount <= 1:
            raise surgery.ConfigError("random_prune.amount", self.amount, "must be a number in [0, 1]")


class RandomPrune(Step):
    name, settings = "random_prune", RandomPruneSettings

    def apply(self, model, settings, run):
        return surgery.prune(model, settings.amount, method="random_unstructured", seed=settings.seed)


register_step(RandomPrune())
