"""Budgets: bytes, sizes and bits per weight; anything else a one-line error naming plan.budget."""

from __future__ import annotations

import pytest

from surgery.core.errors import ConfigError
from surgery.ops.planning.budget import budget_bytes


def test_bytes_sizes_and_bits_per_weight():
    assert budget_bytes(1000, 10) == 1000
    assert budget_bytes("12MB", 10) == 12_000_000
    assert budget_bytes("2KiB", 10) == 2048
    assert budget_bytes("4.5bpw", 1600) == 900


@pytest.mark.parametrize(
    "bad",
    [
        "lots",
        "-1MB",
        0,
        True,
        "4.5 parsecs",
        None,
        "1e400bpw",
        "1e400MB",
        "1e300GB",
        "1e308bpw",
        float("inf"),
        float("nan"),
        -(10**400),
    ],
)
def test_anything_else_is_refused_by_name(bad):
    with pytest.raises(ConfigError, match=r"^plan\.budget="):
        budget_bytes(bad, 10)


def test_a_whole_number_of_bytes_too_large_for_a_float_is_kept_exact():
    """Hostile pass, wave 4, item 5: ``1e400bpw`` was an OverflowError traceback; a huge integer is
    still a number of bytes."""
    assert budget_bytes(10**400, 10) == 10**400


def test_numpy_integers_are_whole_numbers_of_bytes():
    import numpy as np

    assert budget_bytes(np.int64(4096), 10) == 4096 and type(budget_bytes(np.int64(4096), 10)) is int
