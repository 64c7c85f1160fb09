"""A user's step, one file: prune a random share of every layer's weights, seeded."""

from dataclasses import dataclass

import surgery
from surgery.cli.steps import Step, StepReport, register_step


@dataclass(frozen=True)
class RandomPruneSettings:
    amount: float = 0.5
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.amount <= 1:
            raise surgery.ConfigError("random_prune.amount", self.amount, "must be a number in [0, 1]")


class RandomPruneReport(StepReport):
    def report(self, handle, settings, run, report):
        report["random_prune"] = {"amount": settings.amount, "seed": settings.seed}

    def summary(self, report):
        section = report.get("random_prune")
        return [f"random_prune: {section['amount']:.0%} of each weight, seed {section['seed']}"] if section else []


class RandomPrune(Step):
    name, settings = "random_prune", RandomPruneSettings
    reporting = RandomPruneReport()

    def apply(self, model, settings, run):
        return surgery.prune(model, settings.amount, method="random_unstructured", seed=settings.seed)


register_step(RandomPrune())
