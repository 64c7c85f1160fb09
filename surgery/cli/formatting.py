"""What the report's writers share: a value as a markdown cell, and matplotlib set up to draw
a figure into a file (no display)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def fmt(value: Any) -> str:
    """A value as a markdown table cell: ``—`` for none, yes/**NO**, six significant digits."""
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "**NO**"
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def pyplot() -> Any:
    """``matplotlib.pyplot`` drawing off-screen (the Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    return plt


def save_figure(fig: Any, path: Path) -> None:
    """Lay ``fig`` out, write it to ``path`` as a PNG and close it."""
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=110)
    pyplot().close(fig)
