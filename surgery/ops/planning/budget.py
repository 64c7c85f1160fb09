"""A plan's budget in bytes: a whole number of bytes, a size (``"12MB"``, ``"3.5MiB"``), or bits
per weight (``"4.5bpw"``) over the selected layers' weights."""

from __future__ import annotations

import math
import numbers
import re

from surgery.core.errors import ConfigError

UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)
ALLOWED = "must be bytes (an integer, or a size such as '12MB', '3.5MiB') or bits per weight such as '4.5bpw'"


def budget_bytes(budget: object, weights: int, field: str = "plan.budget") -> int:
    """``budget`` as whole bytes, ``weights`` being the selected layers' weight count (for bpw)."""
    if isinstance(budget, bool):
        raise ConfigError(field, budget, ALLOWED)
    if isinstance(budget, numbers.Integral):  # numpy's integers too
        if budget <= 0:
            raise ConfigError(field, budget, ALLOWED)
        return int(budget)
    if isinstance(budget, float) and math.isfinite(budget):
        value, unit = budget, "b"
    elif isinstance(budget, str) and (found := _PATTERN.match(budget)):
        value, unit = float(found.group(1)), (found.group(2) or "b").lower()
    else:
        raise ConfigError(field, budget, ALLOWED)
    if not math.isfinite(value) or value <= 0 or (unit != "bpw" and unit not in UNITS):
        raise ConfigError(field, budget, ALLOWED)
    found = value * weights / 8 if unit == "bpw" else value * UNITS[unit]
    if not math.isfinite(found):  # "1e300GB": past any float
        raise ConfigError(field, budget, f"is past any size this machine can count; {ALLOWED}")
    return int(found)
