"""``StepReport``: how a step tells what it did, in ``report.json``, the printed summary,
``report.md``, plots and files beside the checkpoint. A step holds one (``Step.reporting``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

from surgery.cli.steps.blocks import block_stages
from surgery.core.handles import Handle


class StepReport:
    """A step's part of the run's report; every method has a default that adds nothing.
    Subclass, override what the step reports, and set an instance as the step's ``reporting``.

    Example:
        >>> class ScaleReport(StepReport):
        ...     def report(self, handle, settings, run, report):
        ...         report["scale"] = {"factor": settings.factor}
        ...     def summary(self, report):
        ...         return [f"scale: inputs times {report['scale']['factor']}"] if "scale" in report else []
    """

    outputs: ClassVar[tuple[str, ...]] = ()  # every file the step may write into a run's folder (plots, plans)

    def report(self, handle: Handle, settings: Any, run: Any, report: dict[str, Any]) -> None:
        """Add the step's section to ``report`` (``report.json``); by default none."""

    def summary(self, report: dict[str, Any]) -> list[str]:
        """The step's headline in the printed summary and atop ``report.md``: what it did, told
        from its section of ``report`` in a line or two; a line starting with a space continues
        the one above in the terminal only (``report.md`` has the step's own section)."""
        return []

    def markdown(self, report: dict[str, Any]) -> list[str]:
        """The step's sections of ``report.md`` (``## ...`` headings, tables), from ``report``."""
        return []

    def plots(self, report: dict[str, Any]) -> dict[str, Callable[[dict[str, Any], Path], None]]:
        """The plots the step draws from ``report``: file name (one of :attr:`outputs`) -> draw(report, path)."""
        return {}

    def files(self, handle: Handle) -> dict[str, str]:
        """Text files the step writes beside the checkpoint (file name -> contents)."""
        return {}

    def sparsity(self, handle: Handle) -> dict[str, Any] | None:
        """``report.json``'s ``sparsity`` (overall, per layer, over what) from the step that prunes."""
        return None

    def offloaded_stages(self, handle: Handle) -> dict[str, Any] | None:
        """On an offloaded model, for a step that is ``offloadable``: the blocks it walked and the
        seconds each took (the report's ``offloaded.steps``); None when it walks no blocks. The
        last step that walked them holds the compressed weights an export streams."""
        return block_stages(handle)
