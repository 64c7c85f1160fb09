"""The progress bar of every loop: ``tqdm``, with a safe point for interrupts
(:func:`~surgery.core.interrupts.raise_pending`) at each item and update."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from tqdm import tqdm as _tqdm

from surgery.core.interrupts import raise_pending


class tqdm(_tqdm):  # noqa: N801 - a drop-in for tqdm.tqdm
    """``tqdm.tqdm`` whose iteration and ``update`` are safe points for interrupts."""

    def __iter__(self) -> Iterator[Any]:
        for item in super().__iter__():
            raise_pending()
            yield item

    def update(self, n: float | None = 1) -> bool | None:
        raise_pending()
        return super().update(n)
