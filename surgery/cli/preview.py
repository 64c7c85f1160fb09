"""The dry run (``+select_only=true``): what each step of a recipe would select and skip, and
why, printed as a table; the model is built but nothing is changed or written."""

from __future__ import annotations

from torch import nn

from surgery.cli.build import rules_from_config
from surgery.cli.config import RunConfig
from surgery.cli.models import ModelBuilder
from surgery.ops.pruning import prune_targets
from surgery.ops.quantization import quantize_targets
from surgery.core.selection import select


def preview_rows(model: nn.Module, config: RunConfig) -> list[tuple[str, str, str, str, str]]:
    """(step, matched/skipped, name, type, detail) for every step of ``config``, resolved by the
    same functions the verbs use."""
    rows: list[tuple[str, str, str, str, str]] = []
    for step in config.steps:
        settings = getattr(config, step)
        exclude = settings.exclude or None
        if step == "rewrite":
            layers = {"": model} if settings.select is None else select(
                model, settings.select, exclude=exclude, field="rewrite.select", exclude_field="rewrite.exclude")
            rows += [(step, "matched", name or "(root)", type(m).__name__, "inputs rewritten") for name, m in layers.items()]
            continue
        if step == "prune":
            targets, layers = prune_targets(model, settings.select, exclude, settings.dim), {}
        else:
            targets, layers = quantize_targets(model, settings.select, exclude, settings.weight_spec(), settings.activation_spec(),
                                               settings.where)
        rows += [(step, "matched", name, type(t.module).__name__, f"{t.attribute} {tuple(t.param.shape)}")
                 for name, t in targets.matched.items()]
        rows += [(step, "skipped", s.name, s.type, s.reason) for s in targets.skipped]
        rows += [(step, "matched", name or "(root)", type(m).__name__, f"{settings.where} activations")
                 for name, m in layers.items()]
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
