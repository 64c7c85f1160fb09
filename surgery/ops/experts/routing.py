"""Which tokens reach which expert during calibration: counts per expert, every expert calibrated on
every token on request, and a one-line refusal when an expert saw too few for a method."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

from surgery.core.errors import ConfigError
from surgery.ops.experts.linear_experts import LinearExperts


def linear_experts_in(model: nn.Module) -> dict[str, LinearExperts]:
    """Every :class:`LinearExperts` in ``model`` by name."""
    return {name: module for name, module in model.named_modules() if isinstance(module, LinearExperts)}


def tokens_per_expert(model: nn.Module) -> dict[str, list[int]]:
    """How many tokens were routed to each expert of each experts layer since it was made per-expert."""
    return {name: list(module.routed) for name, module in linear_experts_in(model).items()}


@contextlib.contextmanager
def every_expert_calibrated(model: nn.Module, enabled: bool = True) -> Iterator[None]:
    """Inside the block every expert runs on every token, so that each gathers statistics from all
    of them (llm-compressor's ``calibrate_all_experts``), while each layer's output still sums only
    the experts the router chose. Outputs may differ from the routed forward in the last bit (a
    row's product depends on how many rows a matrix multiply holds)."""
    layers = list(linear_experts_in(model).values()) if enabled else []
    before = [layer.every_token for layer in layers]
    for layer in layers:
        layer.every_token = True
    try:
        yield
    finally:
        for layer, was in zip(layers, before, strict=True):
            layer.every_token = was


def check_tokens(counts: dict[str, list[int]], needed: int, field: str, method: str) -> None:
    """Raise naming the experts that saw fewer than ``needed`` tokens (``counts`` as
    :func:`tokens_per_expert` gives them, for the calibration just run)."""
    short = [f"{name}.{e} ({n})" for name, per in counts.items() for e, n in enumerate(per) if n < needed]
    if short:
        shown = ", ".join(short[:4]) + (f" and {len(short) - 4} more" if len(short) > 4 else "")
        raise ConfigError(
            field,
            shown,
            f"saw fewer than {needed} calibration token(s) each, too few for {method}; calibrate on more "
            "tokens, or route them through every expert (experts='all')",
        )
