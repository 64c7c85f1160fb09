"""Short digests that tell whether two processes hold the same model, settings and batches.

:func:`~surgery.core.distributed.share` compares them across the ranks calibrating together
before any rank computes: ranks that differ would otherwise reduce statistics of different
models (or of different layers) into each other and finish with no word.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

import torch
from torch import nn

from surgery.core.inputs import Call, flatten_tensors

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")  # a function's or object's repr differs between processes


def model_digest(model: nn.Module | None) -> str:
    """A digest of the model's parameter and buffer names, shapes, dtypes and value sums
    (sums left out for tensors on the meta device, e.g. an offloaded model's weights)."""
    if model is None:
        return "none"
    digest = hashlib.sha256()
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
        if not tensor.is_meta and tensor.numel():
            total = torch.sum(tensor.detach(), dtype=torch.float64) if tensor.is_floating_point() else None
            checksum = total if total is not None else tensor.detach().to(torch.int64).sum()
            digest.update(repr(float(checksum)).encode())
    return digest.hexdigest()


def settings_digest(settings: Any) -> str:
    """A digest of the settings' ``repr`` (object addresses removed)."""
    return hashlib.sha256(_ADDRESS.sub("", repr(settings)).encode()).hexdigest()


def calls_digest(calls: list[Call]) -> str:
    """A digest of the batches' tensors (shapes, dtypes and bytes) and their number."""
    digest = hashlib.sha256(str(len(calls)).encode())
    for call in calls:
        for tensor in flatten_tensors([list(call.args), dict(call.kwargs)], floating_only=False):
            digest.update(str((tuple(tensor.shape), tensor.dtype)).encode())
            digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
