"""``StepChecks``: what the dry run and the round-trip checks ask of a step beyond applying it
(its neutral form, its preview rows, what it re-attaches after ``bake``). A step holds one
(``Step.checking``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import Tensor, nn

from surgery.core.handles import Handle

Row = tuple[str, str, str, str, str]  # a dry-run row: (step, matched/skipped, name, type, detail)


class StepChecks:
    """A step's answers to the checks; every method has a default that fits a step which
    changes weights only. Subclass, override what differs, and set an instance as the step's
    ``checking``."""

    def neutral(self, model: nn.Module, settings: Any, run: Any) -> Handle | None:
        """The same step with settings that change no output (the ``identity`` check); None
        (the default): nothing at all."""
        return None

    def preview(self, model: nn.Module, settings: Any) -> list[Row]:
        """The dry run's rows: what the step would select and skip, and why; none (the
        default): the dry run shows one row, the whole model."""
        return []

    def reattach(self, model: nn.Module, settings: Any, qparams: dict[str, Tensor] | Path) -> Handle | None:
        """Attach again, to a baked or reloaded model, what baking cannot fold into weights
        (activation quantization, input rewriting); None when baking keeps everything."""
        return None

    def activation_qparams(self, handle: Handle) -> dict[str, Tensor]:
        """The parameters :meth:`reattach` takes back (saved as ``model.qparams.safetensors``)."""
        return {}

    def fresh_build(
        self, handle: Handle, build: Callable[[], nn.Module], architecture: Callable[[], nn.Module]
    ) -> Callable[[], nn.Module]:
        """How a fresh model takes the weights this step baked (the ``bake`` and ``save_load``
        checks build one): ``build``, unless the step changes the model's structure."""
        return build
