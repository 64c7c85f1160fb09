"""Tests that share one process (a memory probe, a torchrun, a new interpreter) carry
``@pytest.mark.xdist_group(NAME)``, and ``make test`` runs ``--dist loadgroup`` so that one worker
runs each group and starts that process once."""

from __future__ import annotations

import pytest


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``--dist loadgroup`` on pytest 9: xdist 3.8 names a test's group by setting ``item._nodeid``,
    which pytest 9 no longer reads (a node's id is ``item._id``), so every group was split across
    workers, and each started its own shared process. The same suffix, where pytest reads it."""
    if not getattr(config.option, "loadgroup", False) or not hasattr(items[0] if items else None, "_id"):
        return
    from _pytest.nodeid import coerce_node_id

    for item in items:
        names = sorted(
            {str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in item.iter_markers("xdist_group")}
        )
        if names and "@" not in item.nodeid.rsplit("]", 1)[-1]:
            item._id = coerce_node_id(f"{item.nodeid}@{'_'.join(names)}")
