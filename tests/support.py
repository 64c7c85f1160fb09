"""Small helpers shared by several test files (fixtures live in conftest.py)."""

from __future__ import annotations

from torch import nn


class Passthrough(nn.Module):
    """A wrapper that changes nothing: the identity wrap."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args, **kwargs):
        return self.inner(*args, **kwargs)
