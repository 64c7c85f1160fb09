"""The dry run (``+select_only=true``): what each step of a recipe would select and skip, and
why, printed as a table; the model is built but nothing is changed or written."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from surgery.cli.build import rules_from_config
from surgery.cli.config import RunConfig
from surgery.cli.models import ModelBuilder
from surgery.core.selection import select
from surgery.ops.pruning import prune_targets
from surgery.ops.quantization import quantize_targets

Row = tuple[str, str, str, str, str]  # (step, matched/skipped, name, type, detail)


def _prune_rows(model: nn.Module, settings: Any) -> list[Row]:
    targets = prune_targets(model, settings.select, settings.exclude or None, settings.dim)
    return _target_rows("prune", targets, {}, "")


def _quantize_rows(model: nn.Module, settings: Any) -> list[Row]:
    targets, layers = quantize_targets(
        model,
        settings.select,
        settings.exclude or None,
        settings.weight_spec(),
        settings.activation_spec(),
        settings.where,
    )
    return _target_rows("quantize", targets, layers, settings.where)


def _target_rows(step: str, targets: Any, layers: dict[str, nn.Module], where: str) -> list[Row]:
    rows = [
        (step, "matched", name, type(t.module).__name__, f"{t.attribute} {tuple(t.param.shape)}")
        for name, t in targets.matched.items()
    ]
    rows += [(step, "skipped", s.name, s.type, s.reason) for s in targets.skipped]
    return rows + [
        (step, "matched", name or "(root)", type(m).__name__, f"{where} activations") for name, m in layers.items()
    ]


def _rewrite_rows(model: nn.Module, settings: Any) -> list[Row]:
    layers = (
        {"": model}
        if settings.select is None
        else select(
            model,
            settings.select,
            exclude=settings.exclude or None,
            field="rewrite.select",
            exclude_field="rewrite.exclude",
        )
    )
    return [
        ("rewrite", "matched", name or "(root)", type(m).__name__, "inputs rewritten") for name, m in layers.items()
    ]


def _shrink_rows(model: nn.Module, settings: Any) -> list[Row]:
    """The layers whose output channels shrink may remove (which go is known only after the trace)."""
    layers = (
        {n: m for n, m in model.named_modules() if isinstance(m, PRODUCERS)}
        if settings.select is None
        else select(
            model,
            settings.select,
            exclude=settings.exclude or None,
            field="shrink.select",
            exclude_field="shrink.exclude",
        )
    )
    if settings.select is None and settings.exclude:
        excluded = select(model, settings.exclude, field="shrink.exclude")
        layers = {n: m for n, m in layers.items() if n not in excluded}
    return [
        ("shrink", "matched", name or "(root)", type(m).__name__, "output channels may go")
        for name, m in layers.items()
        if isinstance(m, PRODUCERS)
    ]


def _finetune_rows(model: nn.Module, settings: Any) -> list[Row]:
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [
        (
            "finetune",
            "matched",
            "(model)",
            type(model).__name__,
            f"trains {len(trainable)} parameters ({sum(p.numel() for _, p in trainable)} values), "
            f"{settings.epochs} epoch(s)",
        )
    ]


PRODUCERS = (nn.Linear, nn.modules.conv._ConvNd, nn.Embedding)
PREVIEWS: dict[str, Callable[[nn.Module, Any], list[Row]]] = {
    "prune": _prune_rows,
    "quantize": _quantize_rows,
    "rewrite": _rewrite_rows,
    "shrink": _shrink_rows,
    "finetune": _finetune_rows,
}


def preview_rows(model: nn.Module, config: RunConfig) -> list[Row]:
    """(step, matched/skipped, name, type, detail) for every step of ``config``, resolved by the
    same functions the verbs use."""
    rows: list[Row] = []
    for step in config.steps:
        show = PREVIEWS.get(step)
        rows += show(model, getattr(config, step)) if show else [(step, "matched", "(model)", "", "not previewed")]
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
    counts = {(step, kind): sum(1 for r in rows if r[:2] == (step, kind)) for step, kind, *_ in rows}
    lines.append("  " + "; ".join(f"{step}: {n} {kind}" for (step, kind), n in counts.items()))
    return "\n".join(lines)
