"""How much each expert of a mixture-of-experts layer matters, from calibration tokens: the tokens its
router sent it, and REAP's router-weighted expert activation norm (Lasby et al. 2025, "REAP the
Experts"), ``S_j = mean over the tokens routed to j of g_j(x) * ||f_j(x)||_2`` with ``g_j`` the
softmax over all of the router's logits (not the renormalised top-k weights) and ``f_j(x)`` the
expert's output before it is weighted.

Criteria are registered in :data:`EXPERT_CRITERIA` (:func:`register_expert_criterion`); each maps
one layer's :class:`ExpertStats` to a score per expert, the lowest removed first.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from surgery.core.errors import ConfigError
from surgery.core.inputs import Inputs, device_of, run_batches
from surgery.core.registry import Registry
from surgery.core.routing import routed_as
from surgery.ops.experts.linear_experts import LinearExperts


@dataclass
class ExpertStats:
    """What one experts layer's calibration gave: per expert, the tokens routed to it (``routed``)
    and the sum of ``g_j(x) * ||f_j(x)||`` over them (``weighted_norm``); ``generator`` seeds a
    random criterion (one per call, shared by the layers in order)."""

    routed: Tensor
    weighted_norm: Tensor
    generator: torch.Generator = field(default_factory=lambda: torch.Generator().manual_seed(0))

    @property
    def num_experts(self) -> int:
        """How many experts the layer has."""
        return int(self.routed.numel())


ExpertCriterion = Callable[[ExpertStats], Tensor]
EXPERT_CRITERIA: Registry[ExpertCriterion] = Registry("prune_experts.criterion")


def register_expert_criterion(name: str, score: ExpertCriterion, *, replace: bool = False) -> ExpertCriterion:
    """Register ``score(stats: ExpertStats) -> Tensor (E,)``: the experts scoring lowest are removed.

    Example:
        >>> surgery.register_expert_criterion("norm_only", lambda s: s.weighted_norm)
    """
    return EXPERT_CRITERIA.register(name, score, replace=replace)


def reap(stats: ExpertStats) -> Tensor:
    """REAP: the mean over an expert's routed tokens of its gate value times its output norm (0 when
    no token reached it)."""
    return stats.weighted_norm / stats.routed.clamp(min=1).to(stats.weighted_norm.dtype)


def frequency(stats: ExpertStats) -> Tensor:
    """How many calibration tokens the router sent each expert."""
    return stats.routed.to(torch.float64)


def random(stats: ExpertStats) -> Tensor:
    """A seeded random score: the baseline any criterion should beat."""
    return torch.rand(stats.num_experts, generator=stats.generator, dtype=torch.float64)


register_expert_criterion("reap", reap)
register_expert_criterion("frequency", frequency)
register_expert_criterion("random", random)


def observe(
    model: nn.Module, routers: dict[str, nn.Module], calibration: Inputs, *, progress: bool = False
) -> dict[str, ExpertStats]:
    """Run ``calibration`` through ``model`` (its experts made :class:`LinearExperts`) and gather
    :class:`ExpertStats` for each experts module named in ``routers`` (name -> its router)."""
    stats: dict[str, ExpertStats] = {}
    hooks = []
    try:
        for name, router in routers.items():
            experts = model.get_submodule(name)
            count = len(experts)
            device = device_of(experts)  # accumulated where the experts run, brought to the CPU once at the end
            wide = torch.float32 if device.type == "mps" else torch.float64  # MPS has no float64
            zeros = torch.zeros(count, dtype=wide, device=device)
            stats[name] = ExpertStats(torch.zeros(count, dtype=torch.long), zeros)
            gates: dict[str, Tensor] = {}
            hooks.append(router.register_forward_hook(_keep_gates(gates)))
            hooks.append(experts.register_forward_pre_hook(_accumulate(gates, stats[name])))
        with routed_as("routed"):
            count = run_batches(model, calibration, field="prune_experts.calibration", progress=progress)
    finally:
        for hook in hooks:
            hook.remove()
    if not count:
        raise ConfigError("prune_experts.calibration", "0 batches", "must hold at least one batch")
    return {name: dataclasses.replace(found, weighted_norm=found.weighted_norm.cpu()) for name, found in stats.items()}


def _keep_gates(gates: dict[str, Tensor]) -> Callable[..., None]:
    """A router forward hook keeping the softmax over all its logits, ``(tokens, E)``, in float32."""

    def hook(module: nn.Module, args: tuple, output: tuple) -> None:
        logits = output[0] if isinstance(output, tuple) else output
        gates["probs"] = torch.softmax(logits.detach().float(), dim=-1)

    return hook


def _accumulate(gates: dict[str, Tensor], stats: ExpertStats) -> Callable[..., None]:
    """A forward pre-hook on :class:`LinearExperts` adding each expert's routed tokens and its
    ``g_j * ||f_j||`` over them (the expert run once more on its tokens, unweighted)."""

    def hook(module: LinearExperts, args: tuple) -> None:
        hidden, index = args[0], args[1]
        probs = gates.pop("probs", None)
        if probs is None or probs.shape[0] != hidden.shape[0]:
            raise ConfigError(
                "prune_experts.router", type(module).__name__, "gave no router logits for the tokens its experts ran on"
            )
        with torch.no_grad():
            for e in range(len(module)):
                _, token = torch.where(torch.eq(index.T, e))
                if token.numel() == 0:
                    continue
                norms = torch.linalg.vector_norm(module[e](hidden[token]).float(), dim=-1)
                stats.routed[e] += token.numel()
                stats.weighted_norm[e] += (probs[token, e] * norms).double().sum()

    return hook
