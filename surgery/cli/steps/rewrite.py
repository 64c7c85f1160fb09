"""The ``rewrite`` step: :func:`surgery.rewrite_inputs` with a recipe's ``rewrite:`` settings."""

from __future__ import annotations

from pathlib import Path

from torch import Tensor, nn

from surgery.cli.steps.base import Row, Step, StepRun, register_step
from surgery.cli.steps.step_checks import StepChecks
from surgery.core.handles import Handle
from surgery.core.selection import select
from surgery.ops.rewrite.rewriting import RewriteSpec, rewrite_inputs


class RewriteChecks(StepChecks):
    """How the ``rewrite`` step answers the dry run and the checks."""

    def neutral(self, model: nn.Module, settings: RewriteSpec, run: StepRun) -> Handle:
        return rewrite_inputs(model, RewriteSpec("identity", select=settings.select, exclude=settings.exclude))

    def preview(self, model: nn.Module, settings: RewriteSpec) -> list[Row]:
        layers = (
            {"": model}
            if settings.select is None
            else select(
                model,
                settings.select,
                exclude=settings.exclude,
                field="rewrite.select",
                exclude_field="rewrite.exclude",
            )
        )
        return [("rewrite", "matched", n or "(root)", type(m).__name__, "inputs rewritten") for n, m in layers.items()]

    def reattach(self, model: nn.Module, settings: RewriteSpec, qparams: dict[str, Tensor] | Path) -> Handle | None:
        """Hooks are not weights: a baked model gets its rewrite again."""
        return rewrite_inputs(model, settings)


class RewriteStep(Step):
    """Inputs rewritten by forward-pre hooks (``rewrite:`` holds :class:`~surgery.RewriteSpec`'s
    fields: a built-in by ``name`` with its ``kwargs``, or a dotted path)."""

    name, settings = "rewrite", RewriteSpec
    checking = RewriteChecks()

    def apply(self, model: nn.Module, settings: RewriteSpec, run: StepRun) -> Handle:
        return rewrite_inputs(model, settings)


register_step(RewriteStep())
