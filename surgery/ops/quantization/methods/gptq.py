"""GPTQ (Frantar et al. 2023) as a weight method: each layer rounded input column by input
column against the Hessian of its calibration inputs, layer after layer in sequence."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from surgery.core import guards
from surgery.core.errors import ConfigError
from surgery.core.sequential import Paired
from surgery.core.settings import whole_count
from surgery.ops.numerics.fake_quant import Grid
from surgery.ops.numerics.grid import ACTORDER
from surgery.ops.numerics.observers import relative_importance
from surgery.ops.numerics.weight_methods import QuantizedWeight, WeightProblem, register_weight_method
from surgery.ops.second_order.hessians import weight_matrix
from surgery.ops.second_order.reconstruction import gptq
from surgery.ops.second_order.second_order import check_layers, reconstruct_layers


@dataclass(frozen=True)
class GptqSettings:
    """GPTQ's own settings, apart from the grid: ``actorder`` (``"weight"``: columns in order of
    their Hessian's diagonal; ``"group"``: groups formed in that order, a ``g_idx`` stored; None:
    as they come), ``damping`` (the share of the Hessian's mean diagonal added to it before it is
    inverted; llm-compressor's and the paper's 0.01) and ``block_size`` (columns updated together,
    the lazy batch; as in the reference code, a group's scale is taken from the weights as updated
    up to the start of its block, so with groups smaller than a block the block size changes the
    result too; 128, the reference's and llm-compressor's)."""

    actorder: str | None = None
    damping: float = 0.01
    block_size: int = 128

    def __post_init__(self) -> None:
        if self.actorder not in (None, *ACTORDER):
            raise ConfigError(
                "quantize.method.actorder", self.actorder, f"must be null or one of {', '.join(ACTORDER)}"
            )
        damping = self.damping
        if isinstance(damping, bool) or not isinstance(damping, (int, float)) or not 0 < damping <= 1:
            raise ConfigError("quantize.method.damping", damping, "must be a number in (0, 1] (0.01: the paper's)")
        whole_count("quantize.method.block_size", self.block_size, "columns", at_most=1 << 16, example=128)


@dataclass(frozen=True)
class GptaqSettings(GptqSettings):
    """GPTAQ's settings: GPTQ's (its walk is GPTQ's)."""


def solve_gptq(problem: WeightProblem) -> dict[str, QuantizedWeight]:
    """GPTQ on every selected layer; a pruned layer keeps its zeros and compensates on the kept entries."""
    return solve_columns(problem)


def solve_columns(problem: WeightProblem, paired: Paired | None = None) -> dict[str, QuantizedWeight]:
    """GPTQ's walk on every selected layer, with the statistics ``paired`` gives where it is set
    (the float model's inputs beside the compressed one's: GPTAQ)."""
    targets, spec = problem.targets, problem.spec
    settings = problem.settings if isinstance(problem.settings, GptqSettings) else GptqSettings()
    check_layers(targets.matched, "quantize.select", "gptq")
    _refuse_split_group_index(problem, settings.actorder)
    grid = Grid(spec, per_row=spec.per_channel or spec.group_size is not None)
    by_layer = {t.module_name: t for t in targets.matched.values()}
    whole = {}  # without groups: the scales of the whole weight (a grouped convolution is solved in parts)
    amax = {}  # each weight's largest magnitude, before GPTQ moves it
    for layer, target in by_layer.items():
        amax[layer] = guards.current_value(target.param).detach().abs().amax().float()
        if not spec.group_size and not spec.weighted:  # imatrix_mse: from each part's Hessian, in the solver
            whole[layer] = grid.qparams_of(weight_matrix(target.module, guards.current_value(target.param)))
    offsets: dict[str, int] = {}
    masks = {}
    for layer, target in by_layer.items():
        mask = next((t.mask() for t in guards.transforms_of(target.param) if callable(getattr(t, "mask", None))), None)
        if mask is not None:
            masks[layer] = weight_matrix(target.module, mask)

    def solver(
        layer: str, matrix: Tensor, hessian: Tensor, asymmetry: Tensor | None = None
    ) -> tuple[Tensor, tuple[Tensor, ...]]:
        rows = slice(offsets.get(layer, 0), offsets.get(layer, 0) + matrix.shape[0])
        offsets[layer] = rows.stop
        # what was found before the stage, where the weight was: on the stage's device (onload=)
        keep = masks.get(layer)
        keep = None if keep is None else keep.to(matrix.device)
        tensor_max = amax[layer].to(matrix.device)
        layer_grid = Grid(spec, grid.per_row, tensor_max) if spec.is_float else grid  # nvfp4: the tensor's scale
        fixed = None if spec.group_size else whole.get(layer)
        if fixed is not None:
            fixed = tuple(part.to(matrix.device) for part in fixed)
        if fixed is not None and grid.per_row:
            fixed = (fixed[0][rows], fixed[1][rows])
        if fixed is None and not spec.group_size:  # weighted: each row's range against its inputs' energy
            fixed = layer_grid.qparams_of(matrix, relative_importance(torch.diagonal(hessian)))
        groups = None  # two-level grids: the groups' scales before the walk, under their super groups' scales
        if spec.super_group:
            groups = layer_grid.group_qparams(matrix, relative_importance(torch.diagonal(hessian)))
        new, scale, zero_point, g_idx = gptq(
            matrix,
            hessian,
            layer_grid.qparams_of if fixed is None else lambda *_: fixed,
            layer_grid.round,
            group_size=spec.group_size,
            name=layer,
            actorder=settings.actorder,
            damping=settings.damping,
            block=settings.block_size,
            asymmetry=asymmetry,
            keep=None if keep is None else keep[rows],
            groups=groups,
        )
        grid_of = (
            scale.expand(matrix.shape[0]) if scale.dim() == 0 else scale,
            zero_point.expand(matrix.shape[0]) if zero_point.dim() == 0 else zero_point,
        )
        return new, grid_of if g_idx is None else (*grid_of, g_idx)

    results, problem.sequential = reconstruct_layers(
        problem.model,
        targets.matched,
        problem.calibration,
        solver,
        problem.originals,
        blocks=problem.blocks,
        field="quantize.calibration",
        progress=problem.progress,
        settings=(spec, settings, problem.unrouted),  # the grid, the settings: the same on every process
        paired=paired,
        method=problem.method,
        unrouted=problem.unrouted,
    )
    found = {}
    for key in targets.matched:  # the rounded weights are in the model already
        scale, zero_point, *g_idx = results[key]
        axis = problem.axis(key) if grid.per_row else None
        if not grid.per_row:
            scale, zero_point = scale[0].reshape(()), zero_point[0].reshape(())
        zero_point = zero_point if spec.float_offset else zero_point.to(torch.int32)
        found[key] = QuantizedWeight(scale, zero_point, axis, g_idx=next(iter(g_idx), None))
    return found


def _refuse_split_group_index(problem: WeightProblem, actorder: str | None) -> None:
    """``actorder="group"`` gives a weight one group index; a grouped convolution, solved one
    group of channels at a time (each with its own Hessian and order), would need one per part."""
    if actorder != "group" or not problem.spec.group_size:
        return
    for key, target in problem.targets.matched.items():
        if getattr(target.module, "groups", 1) > 1:
            raise ConfigError(
                "quantize.method.actorder",
                "group",
                f"{key} is a grouped convolution (groups={target.module.groups}), solved part by part, each "
                "part in its own column order: one g_idx cannot hold them; use actorder='weight' or exclude it",
            )


register_weight_method("gptq", solve_gptq, needs_calibration=True, sequential=True, settings=GptqSettings)
