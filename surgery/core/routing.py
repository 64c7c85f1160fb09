"""How mixture-of-experts layers route tokens right now: as the router says, every token through every
expert for calibration statistics, or every token through every expert for a structure trace."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Literal

Routing = Literal["routed", "every_expert", "trace"]
_ROUTING: contextvars.ContextVar[Routing] = contextvars.ContextVar("routing", default="routed")


def routing() -> Routing:
    """``"routed"`` (the model's own routing), ``"every_expert"`` (calibration: each expert runs on
    every token, the routed rows go on) or ``"trace"`` (the same, for finding which layers run;
    nothing is counted)."""
    return _ROUTING.get()


@contextlib.contextmanager
def routed_as(mode: Routing) -> Iterator[None]:
    """Route mixture-of-experts layers as ``mode`` says inside the block."""
    token = _ROUTING.set(mode)
    try:
        yield
    finally:
        _ROUTING.reset(token)


@contextlib.contextmanager
def every_expert_calibrated(enabled: bool = True) -> Iterator[None]:
    """Inside the block, every expert of a mixture-of-experts layer gathers calibration statistics
    from every token (llm-compressor's ``calibrate_all_experts``), while each layer's output still
    sums only the experts its router chose, so rarely chosen experts are calibrated too.

    Outputs may differ from the routed forward in the last bit (a row's product depends on how
    many rows a matrix multiply holds).

    Example:
        >>> with surgery.every_expert_calibrated():
        ...     surgery.quantize(model, weights=GridSpec(bits=4), method="gptq", calibration=batches)
    """
    with routed_as("every_expert" if enabled else routing()):
        yield
