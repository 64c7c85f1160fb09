"""The dry run (``+select_only=true``): what each step of a recipe would select and skip, and
why, printed as a table; the model is built but nothing is changed or written."""

from __future__ import annotations

from torch import nn

from surgery.cli.build import rules_from_config
from surgery.cli.config import RunConfig
from surgery.cli.models import ModelBuilder
from surgery.cli.steps import Row, step_named


def preview_rows(model: nn.Module, config: RunConfig) -> list[Row]:
    """(step, matched/skipped, name, type, detail) for every step of ``config``, resolved by the
    same functions the verbs use."""
    rows: list[Row] = []
    for name in config.steps:
        step = step_named(name)
        rows += step.checking.preview(model, config.settings(name)) or [
            (name, "matched", "(model)", type(model).__name__, "the whole model")
        ]
    return rows


def preview(config: RunConfig) -> str:
    """Build the model of ``config`` and return the table of what its steps would select."""
    model = ModelBuilder(config.model, config.seed, rules_from_config(config.build))()
    rows = preview_rows(model, config)
    header = ("step", "", "name", "type", "detail")
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(4)]
    lines = [f"{config.recipe}: what each step selects in {config.model.name} (nothing was changed or written)"]
    lines += [
        "  " + "  ".join(str(cell).ljust(width) for cell, width in zip(row[:4], widths)) + "  " + row[4]
        for row in [header, *rows]
    ]
    if not rows:
        lines.append(
            "  no runtime steps: the recipe changes the model with build: rules while it is built, or only inspects it"
        )
    counts = {(step, kind): sum(1 for r in rows if r[:2] == (step, kind)) for step, kind, *_ in rows}
    lines.append("  " + "; ".join(f"{step}: {n} {kind}" for (step, kind), n in counts.items()))
    return "\n".join(lines)
