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

from torch import nn

from surgery.cli.steps.hooks_on_the_step import HooksBefore03, adopt_hooks_on_the_step
from surgery.cli.steps.step_checks import Row, StepChecks
from surgery.cli.steps.step_report import StepReport
from surgery.core.errors import ConfigError, ConfigTypeError
from surgery.core.handles import Handle
from surgery.core.registry import Registry


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


class Step(HooksBefore03):
    """One step of a recipe: its ``settings`` (a dataclass, frozen or not, whose ``__post_init__``
    validates), the ``calibration`` it needs and ``apply``. How it reports (``reporting``, a
    :class:`StepReport`) and answers the checks (``checking``, a :class:`StepChecks`) are
    objects of their own, with defaults. Subclass, set ``name`` and ``settings``, override what
    applies, and register an instance with :func:`register_step`.

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
    reporting: StepReport = StepReport()  # its report.json section, summary, report.md, plots, files
    checking: StepChecks = StepChecks()  # its neutral form, dry-run rows, what it re-attaches after bake

    def __call__(self, model: nn.Module, settings: Any, run: StepRun) -> Handle:
        return self.apply(model, settings, run)

    def apply(self, model: nn.Module, settings: Any, run: StepRun) -> Handle:
        """Change ``model`` in place and return the handle that undoes it. With ``offloadable``,
        ``model`` may be an offloaded model's handle (:func:`surgery.offloaded`), worked on block
        by block, finished blocks written to ``run.work``: a verb given ``work=run.work`` does so."""
        raise NotImplementedError(f"step {self.name!r} does not implement apply()")

    def calibration(self, settings: Any) -> Calibration | None:
        """The calibration batches the step needs (None: none)."""
        return None

    @property
    def outputs(self) -> tuple[str, ...]:
        """Every file the step may write into a run's folder (its ``reporting.outputs``)."""
        return tuple(self.reporting.outputs)


def offloaded_stages(step: Step, handle: Handle) -> dict[str, Any] | None:
    """The blocks an offloadable ``step`` walked on an offloaded model (its reporting's
    :meth:`~StepReport.offloaded_stages`); None for a step that walks none."""
    return step.reporting.offloaded_stages(handle) if step.offloadable else None


STEPS: Registry[Step] = Registry("steps")


def register_step(step: Step, *, replace: bool = False) -> Step:
    """Make ``step`` available to recipes as ``steps: [<step.name>]`` with a ``<step.name>:`` section."""
    if not isinstance(step, Step):
        raise ConfigTypeError("steps entry", step, "must be an instance of a surgery.cli.steps.Step subclass")
    if not dataclasses.is_dataclass(step.settings):
        raise ConfigTypeError(f"step {step.name!r} settings", step.settings, "must be a dataclass")
    for kind, value in (("reporting", step.reporting), ("checking", step.checking)):
        wanted = StepReport if kind == "reporting" else StepChecks
        if not isinstance(value, wanted):
            raise ConfigTypeError(f"step {step.name!r} {kind}", value, f"must be a {wanted.__name__} instance")
    adopt_hooks_on_the_step(step)
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
