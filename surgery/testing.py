"""Helpers for testing surgery on your own models (as ``torch.testing`` is for tensors).

Snapshots of everything ``restore()`` must put back, hook counts (per module and in torch's
global registries), outputs collected over batches, and which parameters carry transforms,
so tests assert on behaviour without reaching into private state (the audits themselves live in
:mod:`surgery.analysis.audits`, where the command line's checks use them too).

Example:
    >>> before = surgery.testing.snapshot(model)
    >>> surgery.prune(model, 0.5).restore()
    >>> assert surgery.testing.snapshot_differences(before, surgery.testing.snapshot(model)) == []
"""

from __future__ import annotations

from torch import nn

from surgery.analysis.audits import (
    Snapshot,
    collect,
    max_difference,
    snapshot,
    snapshot_differences,
    transformed_parameters,
)
from surgery.analysis.metrics import same_bits
from surgery.core._compat import MODULE_HOOK_DICTS, global_hook_counts, module_hook_counts


def assert_no_hooks(model: nn.Module) -> None:
    """Fail if any module of ``model`` still carries a hook of any kind."""
    leftover = {name: count for name, count in module_hook_counts(model).items() if count}
    assert not leftover, f"hooks left on the model: {leftover}"


__all__ = [
    "MODULE_HOOK_DICTS",
    "Snapshot",
    "assert_no_hooks",
    "collect",
    "global_hook_counts",
    "max_difference",
    "module_hook_counts",
    "snapshot",
    "snapshot_differences",
    "transformed_parameters",
    "same_bits",
]
