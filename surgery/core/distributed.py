"""Calibration across processes on ``torch.distributed`` (gloo on CPU, NCCL on GPUs).

Inside :func:`distributed_calibration`, every rank holds the model and runs the same verb:
before calibrating, the ranks compare digests of the model (parameter names, shapes, dtypes,
value sums), of the verb's settings (its spec and the layers it selects) and of the batches, and
every rank refuses in one line naming the first rank whose model or settings differ from rank
0's. The calibration set is what the ranks were given together: where every rank was given the
same batches, each takes its share (batch ``i`` goes to rank ``i mod world``); where each was
given its own shard (the batches differ), each uses all of its own. Then the statistics a
layer's solution is computed from — Hessians (GPTQ, SparseGPT), squared input norms (Wanda),
per-channel maxima (SmoothQuant) — are summed (or maxed) across ranks before any rank solves. Every rank then computes the same result, equal to one
process's up to the order of summation. Launch with ``torchrun --nproc-per-node N script.py`` and call
``torch.distributed.init_process_group()`` first.

Statistics computed outside the sequential passes (activation observers, gradient criteria)
see every batch on every rank, so they agree across ranks without being shared.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import Tensor

from surgery.core.errors import ConfigError
from surgery.core.fingerprints import calls_digest, model_digest, settings_digest

T = TypeVar("T")


@dataclass(frozen=True)
class _Sharing:
    group: Any
    share_batches: bool = True  # False once the batches were shared out (a verb run stage by stage)


_active: ContextVar[_Sharing | None] = ContextVar("surgery_distributed_calibration", default=None)


@contextmanager
def distributed_calibration(group: Any = None) -> Iterator[None]:
    """Share calibration out across the processes of ``group`` (default: the whole world) for the
    verbs called in the block (see the module docstring).

    Example:
        >>> torch.distributed.init_process_group("gloo")
        >>> with surgery.distributed_calibration():
        ...     surgery.quantize(model, weights=GridSpec(bits=4), method="gptq", calibration=batches)
    """
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        raise ConfigError(
            "distributed",
            "no process group",
            "call torch.distributed.init_process_group() first (torchrun sets its environment)",
        )
    token = _active.set(_Sharing(group))
    try:
        yield
    finally:
        _active.reset(token)


@contextmanager
def batches_shared() -> Iterator[None]:
    """Within the block the batches are already each rank's share: statistics are still
    reduced across ranks, the batches not shared out again."""
    sharing = _active.get()
    token = _active.set(None if sharing is None else _Sharing(sharing.group, share_batches=False))
    try:
        yield
    finally:
        _active.reset(token)


def world() -> tuple[int, int]:
    """(this rank, number of ranks) calibrating together; (0, 1) outside :func:`distributed_calibration`."""
    sharing = _active.get()
    if sharing is None:
        return 0, 1
    return torch.distributed.get_rank(sharing.group), torch.distributed.get_world_size(sharing.group)


def sharing_batches() -> bool:
    """Whether this process calibrates together with others, sharing out its batches."""
    sharing = _active.get()
    return sharing is not None and sharing.share_batches


def share(
    calls: list[T], field: str, model: Any = None, settings: Any = None, refused: ConfigError | None = None
) -> list[T]:
    """This rank's share of ``calls``, once every rank is seen to hold the same model and settings:
    every ``world``-th batch, from its rank, where all ranks were given the same batches; all of
    them where each rank was given its own (module docstring). A rank that ``refused`` its
    batches says so to the others, and every rank raises."""
    sharing = _active.get()
    if sharing is None or not sharing.share_batches:
        return calls
    rank, size = world()
    mine = (
        model_digest(model),
        settings_digest(settings),
        calls_digest(calls),
        None if refused is None else str(refused),
    )
    everyone: list[Any] = [None] * size
    torch.distributed.all_gather_object(everyone, mine, group=sharing.group)
    if refused is not None:
        raise refused
    failed = [(r, found[3]) for r, found in enumerate(everyone) if found[3] is not None]
    if failed:
        raise ConfigError(
            "distributed", f"rank {failed[0][0]}", f"refused its batches ({failed[0][1]}); every rank stops"
        )
    for index, what in ((0, "holds another model"), (1, "runs the verb with other settings or layers")):
        differing = [r for r, found in enumerate(everyone) if found[index] != everyone[0][index]]
        if differing:
            raise ConfigError(
                "distributed",
                f"rank {differing[0]}",
                f"{what} than rank 0 ({field}); every rank must run the same verb on the same model",
            )
    if any(found[2] != everyone[0][2] for found in everyone):
        return calls  # each rank was given its own shard of the batches: it uses all of it
    if len(calls) < size:
        raise ConfigError(
            field, f"{len(calls)} batches", f"are fewer than the {size} processes calibrating; give each one a batch"
        )
    return calls[rank::size]


def summed(tensor: Tensor) -> Tensor:
    """``tensor`` summed over the ranks calibrating together (itself outside them)."""
    return _reduced(tensor, torch.distributed.ReduceOp.SUM)


def maximum(tensor: Tensor) -> Tensor:
    """The elementwise maximum of ``tensor`` over the ranks calibrating together."""
    return _reduced(tensor, torch.distributed.ReduceOp.MAX)


def minimum(tensor: Tensor) -> Tensor:
    """The elementwise minimum of ``tensor`` over the ranks calibrating together."""
    return _reduced(tensor, torch.distributed.ReduceOp.MIN)


def summed_count(count: int) -> int:
    """An integer count summed over the ranks calibrating together."""
    return int(summed(torch.tensor([count], dtype=torch.int64)).item())


def _reduced(tensor: Tensor, op: Any) -> Tensor:
    sharing = _active.get()
    if sharing is None:
        return tensor
    reduced = tensor.contiguous().clone()
    if torch.distributed.get_backend(sharing.group) == "nccl" and tensor.device.type != "cuda":
        reduced = reduced.to(torch.device("cuda", torch.cuda.current_device()))  # NCCL reduces GPU tensors only
    torch.distributed.all_reduce(reduced, op=op, group=sharing.group)
    return reduced.to(tensor.device)
