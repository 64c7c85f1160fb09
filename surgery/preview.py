"""The dry run (``+select_only=true``): what each step of a recipe would select and skip, and
why, printed as a table; the model is built but nothing is changed or written."""

from __future__ import annotations

from torch import nn

from surgery.build import rules_from_config
from surgery.config import RunConfig
from surgery.models import ModelBuilder
from surgery.selection import select
from surgery.targets import default_layer, select_parameters


def preview_rows(model: nn.Module, config: RunConfig) -> list[tuple[str, str, str, str, str]]:
    """(step, matched/skipped, name, type, detail) for every step of ``config``."""
    rows: list[tuple[str, str, str, str, str]] = []
    for step in config.steps:
        settings = getattr(config, step)
        exclude = settings.exclude or None
        if step == "rewrite" and settings.select is None:
            rows.append((step, "matched", "(root)", type(model).__name__, "the model's own inputs"))
            continue
        if step in ("prune", "quantize") and (step == "prune" or settings.weights is not None):
            activations = step == "quantize" and settings.activations is not None
            targets = select_parameters(model, settings.select, exclude, verb=step, min_dim=2 if step == "prune" else 1,
                                        required=not activations)
            rows += [(step, "matched", name, type(t.module).__name__, f"{t.attribute} {tuple(t.param.shape)}")
                     for name, t in targets.matched.items()]
            rows += [(step, "skipped", s.name, s.type, s.reason) for s in targets.skipped]
        if step == "rewrite" or step == "quantize" and settings.activations is not None:
            default = default_layer if step == "quantize" and settings.select is None else settings.select
            layers = select(model, default, exclude=exclude, field=f"{step}.select", exclude_field=f"{step}.exclude")
            what = "inputs rewritten" if step == "rewrite" else f"{settings.where} activations"
            rows += [(step, "matched", name or "(root)", type(m).__name__, what) for name, m in layers.items()]
    return rows


def preview(config: RunConfig) -> str:
    """Build the model of ``config`` and return the table of what its steps would select."""
    model = ModelBuilder(config.model, config.seed, rules_from_config(config.build))()
    rows = preview_rows(model, config)
    header = ("step", "", "name", "type", "detail")
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(4)]
    lines = [f"{config.recipe}: what each step selects in {config.model.name} (nothing was changed or written)"]
    lines += ["  " + "  ".join(str(cell).ljust(width) for cell, width in zip(row[:4], widths)) + "  " + row[4]
              for row in [header, *rows]]
    counts = {(step, kind): sum(1 for r in rows if r[:2] == (step, kind)) for step, kind, *_ in rows}
    lines.append("  " + "; ".join(f"{step}: {n} {kind}" for (step, kind), n in counts.items()))
    return "\n".join(lines)
