"""A block's inputs: caught where the model calls it, and the next block's predicted from its outputs (checked against where the model really calls it)."""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from typing import Any

import torch
from torch import Tensor, nn

from surgery.core.activations import BlockCalls, SpilledCall, current_ledger, loaded
from surgery.core.errors import ConfigError
from surgery.core.inputs import (
    Call,
    moved,
)


def outputs_as_next_inputs(block: nn.Module, inputs: BlockCalls) -> BlockCalls | None:
    """The block's outputs on each of its cached calls, as the next block's calls (its output
    in place of the hidden states); ``None`` where an output has no such place."""
    outputs = BlockCalls(current_ledger())
    for args, kwargs in inputs:
        following = next_inputs(block(*args, **kwargs), args, kwargs)
        if following is None:
            outputs.close()
            return None
        outputs.add(*following)
    return outputs


def catch_inputs(model: nn.Module, block: nn.Module, calls: list[Call] | list[Call | SpilledCall]) -> BlockCalls:
    """The block's inputs for each batch, caught by a forward stopped at the block (a key/value
    cache among them is dropped: running the block again must not attend to its own past),
    held within the pass's activation budget. A batch the block receives unchanged (a model
    that is the block's wrapper) is kept as the call it was, in memory or in its file."""
    caught = BlockCalls(current_ledger())
    seen: list[tuple[tuple, dict]] = []
    onload = ONLOAD_DEVICE.get()  # within onloading(): kept where the stage runs, moved there once

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        seen.append(
            without_cache_values(args, kwargs) if onload is None else moved(without_cache_values(args, kwargs), onload)
        )
        raise _Stop

    # first among the block's pre-hooks: the inputs as the block is called with them (its own
    # hooks run again when it is), and an offloaded block's weights are not read for nothing
    handle = block.register_forward_pre_hook(hook, with_kwargs=True, prepend=True)
    try:
        for call in calls:
            run = loaded(call)
            with contextlib.suppress(_Stop):
                run(model)
            if seen:
                args, kwargs = seen.pop()
                if _unchanged(args, kwargs, run):
                    caught.adopt(call)
                else:
                    caught.add(args, kwargs)
                del args, kwargs
            del run
    finally:
        handle.remove()
    if len(caught) != len(calls):
        raise ConfigError(
            "calibration.blocks",
            type(block).__name__,
            "a block did not run on every calibration batch; "
            "pass blocks=False to compress layer by layer with full forwards",
        )
    return caught


def _unchanged(args: tuple, kwargs: dict, call: Call) -> bool:
    """Whether the block received exactly the call's own objects."""
    return (
        len(args) == len(call.args)
        and all(a is b for a, b in zip(args, call.args))
        and kwargs.keys() == call.kwargs.keys()
        and all(kwargs[key] is call.kwargs[key] for key in kwargs)
    )


def _is_cache(value: Any) -> bool:
    """A transformers key/value cache (``DynamicCache``...), which a block appends to."""
    return type(value).__name__.endswith("Cache")


def _without_cache(kwargs: dict) -> dict:
    """Keyword inputs with any key/value cache (``past_key_values``, a transformers ``Cache``)
    set to None and ``use_cache`` off."""
    clean = {key: None if "past_key_value" in key or _is_cache(value) else value for key, value in kwargs.items()}
    if "use_cache" in clean:
        clean["use_cache"] = False
    return clean


def next_inputs(output: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """The next block's call: this block's output in place of its hidden states (the first
    positional input, or ``hidden_states``); other inputs (masks, positions) are shared.
    ``None`` if the output or the call has no such place."""
    hidden = (
        output if isinstance(output, Tensor) else output[0] if isinstance(output, (tuple, list)) and output else None
    )
    if not isinstance(hidden, Tensor):
        return None
    if args:
        return (hidden, *args[1:]), kwargs
    if "hidden_states" in kwargs:
        return (), {**kwargs, "hidden_states": hidden}
    return None


def same_call(actual: tuple[tuple, dict], predicted: tuple[tuple, dict]) -> bool:
    """Whether a block received ``predicted`` (the previous block's output in place of its
    hidden states, the other inputs shared)."""
    if len(actual[0]) != len(predicted[0]) or set(actual[1]) != set(predicted[1]):
        return False
    pairs = list(zip(actual[0], predicted[0])) + [(actual[1][k], predicted[1][k]) for k in actual[1]]
    for real, guess in pairs:
        if isinstance(real, Tensor) != isinstance(guess, Tensor):
            return False
        if isinstance(real, Tensor) and (
            real.shape != guess.shape
            or real.dtype != guess.dtype
            or not torch.allclose(real.float(), guess.float(), rtol=1e-4, atol=1e-5)
        ):
            return False
    return True


ONLOAD_DEVICE: ContextVar[torch.device | None] = ContextVar("surgery_onload", default=None)


class _Stop(Exception):
    """Raised by the hook that catches a block's inputs, ending the forward there."""


def without_cache_values(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A block's call without a key/value cache (as :func:`catch_inputs` keeps it)."""
    return tuple(None if _is_cache(value) else value for value in args), _without_cache(kwargs)
