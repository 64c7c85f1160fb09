"""The command line's steps: the ``Step`` protocol, its registry, and what a step is given.

A recipe's ``steps: [prune, quantize]`` names registered steps; each reads its settings from
the recipe's section of the same name (``prune:``), a frozen dataclass the step declares.
Built-in steps register here the same way a user's step does, from a module a recipe names
in ``plugins:``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, NamedTuple

from torch import Tensor, nn

from surgery.cli.steps.blocks import block_stages
from surgery.core.errors import ConfigError, ConfigTypeError
from surgery.core.handles import Handle
from surgery.core.registry import Registry

Row = tuple[str, str, str, str, str]  # a dry-run row: (step, matched/skipped, name, type, detail)


class Calibration(NamedTuple):
    """The calibration data a step asks for: ``batches`` batches of the data's calibration
    split, as ``(inputs, labels)`` pairs when ``labelled``."""

    batches: int
    labelled: bool = False
    field: str = "calibration_batches"


@dataclass
class StepRun:
    """What a step is given besides its settings, for one run of a recipe."""

    config: Any  # the whole RunConfig: seed, data, every step's settings
    calibration: Any = None  # the batches this step asked for with Step.calibration
    training: Callable[[int], tuple[Sequence, Callable[[nn.Module], float] | None]] | None = None
    folder: Path | None = None  # where the run stages its outputs (a step may write files there)
    reference: nn.Module | None = None  # the unmodified model (for reports)
    inputs: Sequence | None = None  # the evaluation batches
    data: Any = None  # the evaluation Data (inputs, labels)
    metric: tuple[str, Callable[[nn.Module], float], bool] | None = None  # the task's (name, evaluate, higher
    # is better) on the evaluation batches; None: the task has no metric (output drift measures)
    work: Path | None = None  # an offloaded run: where the step writes its finished blocks (None: a temporary folder)


class Step:
    """One step of a recipe. Subclass, set ``name`` and ``settings`` (a dataclass, frozen or
    not, whose ``__post_init__`` validates), override what applies, and register an instance
    with :func:`register_step`.

    Example:
        >>> @dataclass(frozen=True)
        ... class ScaleSettings:
        ...     factor: float = 1.0
        >>> class Scale(Step):
        ...     name, settings = "scale", ScaleSettings
        ...     def apply(self, model, settings, run):
        ...         return surgery.rewrite_inputs(model, lambda args, kwargs: (
        ...             (args[0] * settings.factor, *args[1:]), kwargs))
        >>> register_step(Scale())
    """

    name: ClassVar[str] = ""
    settings: ClassVar[type] = object
    changes_model: ClassVar[bool] = True  # False: it measures (sensitivity); the checks do not run it again
    needs_labels: ClassVar[bool] = False  # it trains on labelled data (finetune)
    offloadable: ClassVar[bool] = False  # apply also takes an offloaded model (model.offload=true; run.work)
    outputs: ClassVar[tuple[str, ...]] = ()  # every file it may write into a run's folder (plots, plans)

    def __call__(self, model: nn.Module, settings: Any, run: StepRun) -> Handle:
        return self.apply(model, settings, run)

    def apply(self, model: nn.Module, settings: Any, run: StepRun) -> Handle:
        """Change ``model`` in place and return the handle that undoes it. With ``offloadable``,
        ``model`` may be an offloaded model's handle (:func:`surgery.offloaded`), worked on block
        by block, finished blocks written to ``run.work``: a verb given ``work=run.work`` does so."""
        raise NotImplementedError(f"step {self.name!r} does not implement apply()")

    def neutral(self, model: nn.Module, settings: Any, run: StepRun) -> Handle:
        """The same step with settings that change no output (the ``identity`` check):
        by default nothing at all."""
        return Handle(self.name, model)

    def calibration(self, settings: Any) -> Calibration | None:
        """The calibration batches the step needs (None: none)."""
        return None

    def preview(self, model: nn.Module, settings: Any) -> list[Row]:
        """The dry run's rows: what the step would select and skip, and why."""
        return [(self.name, "matched", "(model)", type(model).__name__, "the whole model")]

    def report(self, handle: Handle, settings: Any, run: StepRun, report: dict[str, Any]) -> None:
        """Add the step's section to ``report`` (``report.json``); by default none."""

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

    def files(self, handle: Handle) -> dict[str, str]:
        """Text files the step writes beside the checkpoint (file name -> contents)."""
        return {}

    def sparsity(self, handle: Handle) -> dict[str, Any] | None:
        """``report.json``'s ``sparsity`` (overall, per layer, over what) from the step that prunes."""
        return None

    def summary(self, report: dict[str, Any]) -> list[str]:
        """The step's headline in the printed summary and atop ``report.md``: what it did, told
        from its section of ``report`` in a line or two; a line starting with a space continues
        the one above in the terminal only (``report.md`` has the step's own section); by
        default nothing."""
        return []

    def markdown(self, report: dict[str, Any]) -> list[str]:
        """The step's sections of ``report.md`` (``## ...`` headings, tables), from ``report``."""
        return []

    def plots(self, report: dict[str, Any]) -> dict[str, Callable[[dict[str, Any], Path], None]]:
        """The plots the step draws from ``report``: file name (one of :attr:`outputs`) -> draw(report, path)."""
        return {}

    def offloaded_stages(self, handle: Handle) -> dict[str, Any] | None:
        """On an offloaded model: the blocks the step walked and the seconds each took (the
        report's ``offloaded.steps``); None when it walks no blocks. The last step that walked
        them holds the compressed weights an export streams. An offloadable step walks blocks."""
        return block_stages(handle) if self.offloadable else None


STEPS: Registry[Step] = Registry("steps")


def register_step(step: Step, *, replace: bool = False) -> Step:
    """Make ``step`` available to recipes as ``steps: [<step.name>]`` with a ``<step.name>:`` section."""
    if not isinstance(step, Step):
        raise ConfigTypeError("steps entry", step, "must be an instance of a surgery.cli.steps.Step subclass")
    if not dataclasses.is_dataclass(step.settings):
        raise ConfigTypeError(f"step {step.name!r} settings", step.settings, "must be a dataclass")
    return STEPS.register(step.name, step, replace=replace)


def step_named(name: object) -> Step:
    """The step registered as ``name``; a one-line error listing the registered ones otherwise."""
    if not isinstance(name, str):
        raise ConfigError("steps", name, f"must be one of {', '.join(STEPS.names())}")
    return STEPS.get(name)


def target_rows(step: str, targets: Any, layers: dict[str, nn.Module], where: str) -> list[Row]:
    """Dry-run rows of a verb's selection: each weight matched or skipped, and activation layers."""
    rows = [
        (step, "matched", name, type(t.module).__name__, f"{t.attribute} {tuple(t.param.shape)}")
        for name, t in targets.matched.items()
    ]
    rows += [(step, "skipped", s.name, s.type, s.reason) for s in targets.skipped]
    return rows + [
        (step, "matched", name or "(root)", type(m).__name__, f"{where} activations") for name, m in layers.items()
    ]
