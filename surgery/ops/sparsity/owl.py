"""OWL (Yin et al. 2024, "Outlier Weighed Layerwise Sparsity"): a sparsity per block from
how many outliers its Wanda scores hold.

For every block (a decoder layer), the Wanda scores ``|W_ij| · ‖X_j‖₂`` of all its selected
layers, from one dense forward over the calibration batches, are pooled; the block's *outlier
ratio* is the percentage of scores above ``m`` times their mean. The ratios are mapped linearly
onto ``[0, 2λ]`` and shifted so that their mean is ``1 − sparsity``; each block's sparsity is one
minus its value. Blocks with more outliers keep more weights; the blocks' mean sparsity is
``sparsity``. This is the OWL repository's ``prune_wanda_outlier`` (``Hyper_m``, ``Lamda``).

The allocation is a ``{layer: amount}`` mapping that ``prune(amounts=...)`` takes:

    >>> allocation = surgery.owl_amounts(model, batches, 0.7)
    >>> surgery.prune(model, 0.7, method="wanda", amounts=allocation, calibration=batches)
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from surgery.core import guards
from surgery.core.errors import ConfigError
from surgery.core.inputs import Inputs
from surgery.core.selection import Selection
from surgery.core.sequential import resolve_blocks
from surgery.ops.offload.offloading import Offloaded
from surgery.ops.sparsity.criteria import wanda
from surgery.ops.sparsity.pruning import prune_targets
from surgery.ops.sparsity.statistics import calibrate

log = logging.getLogger("surgery")
DEPRECATED_OWLPLAN = (
    "OwlPlan is now OwlAllocation (OWL's sparsity per block and amount per layer); the old name goes away in 0.4"
)


class OwlAllocation(Mapping[str, float]):
    """OWL's sparsity allocation: each selected layer's amount (its block's sparsity), for
    ``prune(amounts=...)``; ``blocks`` gives each block's sparsity and ``outlier_ratios`` its
    outlier percentage. It was called ``OwlPlan`` before 0.3; that name warns until 0.4."""

    def __init__(self, amounts: dict[str, float], blocks: dict[str, float], outlier_ratios: dict[str, float]) -> None:
        self._amounts, self.blocks, self.outlier_ratios = amounts, blocks, outlier_ratios

    def __getitem__(self, layer: str) -> float:
        return self._amounts[layer]

    def __iter__(self) -> Iterator[str]:
        return iter(self._amounts)

    def __len__(self) -> int:
        return len(self._amounts)

    def __repr__(self) -> str:
        shown = ", ".join(f"{block}: {amount:.3f}" for block, amount in self.blocks.items())
        return f"OwlAllocation({{{shown}}})"


def owl_amounts(
    model: nn.Module | Offloaded,
    calibration: Inputs,
    sparsity: float,
    *,
    lam: float = 0.08,
    m: float = 5.0,
    select: Selection = None,
    exclude: Selection = None,
    blocks: Selection | None = None,
    progress: bool = True,
) -> OwlAllocation:
    """OWL's layer-wise amounts for an average ``sparsity`` (see the module docstring).

    Args:
        model: the model, or a :func:`surgery.offloaded` handle (its forward reads the weights).
        calibration: the batches of the dense forward that measures ‖X_j‖₂.
        sparsity: the blocks' mean sparsity, in [0, 1].
        lam: λ: the blocks' sparsities span ``2λ`` (the paper's 0.08), their mean ``sparsity``.
        m: M, the multiple of a block's mean score above which a score is an outlier (5).
        select, exclude: the layers scored and given amounts, as for :func:`surgery.prune`.
        blocks: the blocks (default: the model's repeated blocks, found as sequential
            calibration finds them).

    Selected layers outside every block (a language model's head) are left out of the allocation
    (logged): ``prune``'s own amount applies to them, unless they are excluded there.
    """
    check_settings(sparsity, lam, m)
    source = model if isinstance(model, Offloaded) else None
    net = source.model if source is not None else model
    block_names = resolve_blocks(net, blocks, "owl.blocks")
    if not block_names:
        raise ConfigError(
            "owl.blocks",
            type(net).__name__,
            "has no repeated blocks to give sparsities to; name them with blocks=",
        )
    selection = prune_targets(net, select, exclude)
    stats = calibrate(net, selection, calibration, progress=progress)
    members: dict[str, list[str]] = {block: [] for block in block_names}
    outside = []
    for name, target in selection.matched.items():
        if name not in stats:
            continue  # a parameter with no input features (a bias): OWL scores weights only
        block = next((b for b in block_names if target.module_name.startswith(b + ".")), None)
        (members[block] if block is not None else outside).append(name)
    empty = [block for block, names in members.items() if not names]
    if empty:
        raise ConfigError(
            "owl.select", empty[0], "is a block none of whose layers is selected; exclude it from blocks="
        )
    ratios = {}
    for block, names in members.items():
        scores = torch.cat([_scores(source, selection.matched[n].param, stats[n]).flatten() for n in names])
        ratios[block] = 100.0 * (scores > scores.mean() * m).sum().item() / scores.numel()
    per_block = _sparsities(ratios, sparsity, lam)
    amounts = {selection.matched[n].module_name: per_block[block] for block, names in members.items() for n in names}
    if outside:
        log.info(
            "owl: %d selected layer(s) outside the blocks (%s...) are not in the allocation: prune's amount applies to them",
            len(outside),
            selection.matched[outside[0]].module_name,
        )
    return OwlAllocation(amounts, per_block, ratios)


def _scores(source: Offloaded | None, weight: nn.Parameter, stats: Any) -> torch.Tensor:
    value = source.value_of(weight) if source is not None else guards.current_value(weight)
    return wanda(value.detach().float(), stats)


def _sparsities(ratios: dict[str, float], sparsity: float, lam: float) -> dict[str, float]:
    """The ratios min-max scaled to [0, 2λ], centred on ``1 − sparsity``, as sparsities."""
    low, high = min(ratios.values()), max(ratios.values())
    if high == low:
        log.info("owl: every block has the same outlier ratio (%.3f %%): the sparsity is uniform", low)
        return dict.fromkeys(ratios, sparsity)
    scaled = {block: (ratio - low) * (1 / (high - low) * lam * 2) for block, ratio in ratios.items()}
    mean = sum(scaled.values()) / len(scaled)
    found = {block: 1 - (value - mean + (1 - sparsity)) for block, value in scaled.items()}
    beyond = next(((b, v) for b, v in found.items() if not 0 <= v <= 1), None)
    if beyond is not None:
        raise ConfigError(
            "owl.lam",
            lam,
            f"puts {beyond[0]} at sparsity {beyond[1]:.3f}, outside [0, 1] (the span 2λ is not centred "
            "on the mean when one block stands apart); use a smaller lam",
        )
    return found


def check_settings(
    sparsity: float, lam: float, m: float, *, field: str = "owl", sparsity_field: str = "owl.sparsity"
) -> None:
    """Refuse settings OWL cannot allocate with, naming ``{field}.lam`` / ``{field}.m``."""
    for name, value in ((sparsity_field, sparsity), (f"{field}.lam", lam), (f"{field}.m", m)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError(name, value, "must be a finite number")
    if not 0 <= sparsity <= 1:
        raise ConfigError(sparsity_field, sparsity, "must be in [0, 1]")
    if lam < 0:
        raise ConfigError(f"{field}.lam", lam, "must be >= 0")
    if m <= 0:
        raise ConfigError(f"{field}.m", m, "must be > 0")
    if sparsity - lam < 0 or sparsity + lam > 1:
        raise ConfigError(
            f"{field}.lam",
            lam,
            f"moves a block's sparsity outside [0, 1] around {sparsity}; use lam <= {min(sparsity, 1 - sparsity):g}",
        )


def __getattr__(name: str) -> Any:
    """``OwlPlan``: the name :class:`OwlAllocation` had before 0.3 (warns)."""
    if name == "OwlPlan":
        warnings.warn(DEPRECATED_OWLPLAN, DeprecationWarning, stacklevel=2)
        return OwlAllocation
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
