"""The memory guard of :func:`~surgery.analysis.attribution.attribution`: the forward it runs
keeps every activation autograd saves for the backward, which grows with the input's pixels
(a 4096-pixel image through a ResNet: tens of GB). Before running it, a probe forward on one
input, scaled down to at most ``PROBE_SIDE`` pixels a side, counts the bytes autograd saves
(weights left out); scaled up by the batch size and the pixel ratio, that estimate is refused
in one line when it exceeds the memory available (as a batch is refused before it is made,
:func:`~surgery.tasks.synthetic.check_fits_in_memory`)."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from surgery.core.activations import available_memory
from surgery.core.errors import ConfigError
from surgery.core.inputs import Call, evaluating

PROBE_SIDE = 64


def check_attribution_memory(model: nn.Module, call: Call, first: Tensor | None) -> None:
    """Refuse ``call`` when its forward with gradients would need more activation memory than
    is available (module docstring); ``first`` is its first floating input, if any."""
    if first is None or first.dim() < 2 or first.shape[0] == 0:
        return
    needed = estimated_bytes(model, call, first)
    limit = _available(first.device)
    if needed > limit:
        raise ConfigError(
            "attribution.inputs",
            f"shape {tuple(first.shape)}",
            f"its forward with gradients needs about {needed / 2**30:.3g} GiB of activations (estimated "
            f"from a smaller probe), more than the {limit / 2**30:.3g} GiB available; use fewer or smaller inputs",
        )


def estimated_bytes(model: nn.Module, call: Call, first: Tensor) -> float:
    """Bytes autograd would save in a forward of ``call``, from a probe on one small input."""
    probe, ratio = _small(first)
    try:
        saved = _saved_bytes(model, _probe_call(call, first, probe))
    except Exception:  # noqa: BLE001 - a model that takes one size only: probe one input at its size
        probe, ratio = first[:1].detach().clone().requires_grad_(True), 1.0
        saved = _saved_bytes(model, _probe_call(call, first, probe))
    return saved * first.shape[0] * ratio


def _small(first: Tensor) -> tuple[Tensor, float]:
    """One input, its sides past the channel axis scaled down to ``PROBE_SIDE`` at most; and the
    ratio of the full input's positions to the probe's."""
    one = first[:1].detach()
    sides = tuple(one.shape[2:])
    if not sides or max(sides) <= PROBE_SIDE or len(sides) > 3:
        return one.clone().requires_grad_(True), 1.0
    small = tuple(max(1, round(s * PROBE_SIDE / max(sides))) for s in sides)
    probe = F.interpolate(one, size=small)
    return probe.requires_grad_(True), math.prod(sides) / math.prod(small)


def _probe_call(call: Call, first: Tensor, probe: Tensor) -> Call:
    """``call`` with ``probe`` for its first input and its other batch tensors cut to one input."""

    def one(value: object) -> object:
        same_batch = isinstance(value, Tensor) and value.dim() > 0 and value.shape[0] == first.shape[0]
        return value[:1] if same_batch else value

    if call.args:
        return Call((probe, *map(one, call.args[1:])), {k: one(v) for k, v in call.kwargs.items()})
    key = next(iter(call.kwargs))
    return Call((), {k: probe if k == key else one(v) for k, v in call.kwargs.items()})


def _saved_bytes(model: nn.Module, call: Call) -> int:
    """Bytes of the tensors autograd saves in a forward of ``call`` (not the model's own)."""
    own = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    storages: dict[int, int] = {}

    def pack(tensor: Tensor) -> Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in own:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with evaluating(model), torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        output = call(model)
    del output
    return sum(storages.values())


def _available(device: torch.device) -> int:
    """Bytes free for the forward: the GPU's free memory, or the machine's available memory."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return available_memory()
