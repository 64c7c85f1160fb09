"""Second-order compression of selected layers, stage by stage: the part prune and quantize share.

:func:`reconstruct_layers` runs a sequential calibration pass (:mod:`surgery.core.sequential`)
and hands each layer's weight, as an (outputs, input columns) matrix, with the Hessian of its
inputs to a per-matrix solver (SparseGPT, GPTQ); a grouped convolution is solved group by
group. The new weights stay written in the model, their originals kept once in the caller's
:class:`~surgery.core.originals.Originals` store; the caller attaches guarded transforms whose
undo records are the store's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from surgery.core import guards
from surgery.core.allocator import give_back_freed_memory
from surgery.core.errors import ConfigError
from surgery.core.originals import Originals
from surgery.core.selection import Selection
from surgery.core.sequential import UNROUTED, Paired, SequentialReport, run_sequential
from surgery.core.targets import Target
from surgery.ops.second_order.hessians import HessianReducer, from_matrix, groups_of, supports_hessian, weight_matrix

# (layer name, matrix, hessian, **extra statistics) -> (new matrix, per-row extras: a keep-mask, scales, zero points)
MatrixSolver = Callable[..., tuple[Tensor, tuple[Tensor, ...]]]
log = logging.getLogger("surgery")


def warn_zero_inputs(field: str, layer: str, method: str) -> None:
    """Say, naming ``layer``, that its inputs were 0 throughout calibration, so that ``method``
    had nothing to weigh its error by and gave what it gives without calibration (round to nearest,
    or magnitude pruning): returned normally, it would pass for a calibrated result."""
    log.warning(
        "%s=%r: its inputs were 0 in every calibration batch and position, so %s had no error to weigh: "
        "it was %s; give batches that reach the layer with real values",
        field,
        layer,
        method,
        _fallback(field),
    )


def _fallback(field: str) -> str:
    """What a calibrated method gives a layer without statistics: magnitude pruning, or round to nearest."""
    return "pruned by magnitude alone" if field.startswith("prune") else "rounded to nearest (RTN's result)"


def warn_unrouted(field: str, layer: str, method: str) -> None:
    """Say, naming ``layer``, that no calibration input reached it (an expert its router never
    chose) and ``unrouted="rtn"`` had it solved without statistics: rounded to nearest."""
    log.warning(
        "%s=%r: no calibration input reached it (an expert its router never chose), so %s had no error to "
        "weigh; unrouted='rtn': it was %s",
        field,
        layer,
        method,
        _fallback(field),
    )


def check_layers(targets: dict[str, Target], field: str, method: str) -> None:
    """Second-order methods need a layer weight whose input columns are known."""
    for name, target in targets.items():
        if target.attribute != "weight" or not supports_hessian(target.module):
            raise ConfigError(
                field,
                name,
                f"{method} solves Linear, Conv1d, Conv2d and Hugging Face Conv1D weights "
                f"with their input Hessian; this is {type(target.module).__name__}.{target.attribute} "
                "(exclude it)",
            )


def reconstruct_layers(
    model: nn.Module,
    targets: dict[str, Target],
    calibration: Any,
    solver: MatrixSolver,
    originals: Originals,
    *,
    blocks: Selection | bool | None = None,
    field: str = "calibration",
    progress: bool = True,
    settings: Any = None,
    paired: Paired | None = None,
    method: str | None = None,
    unrouted: str = "refuse",
) -> tuple[dict[str, tuple[Tensor, ...]], SequentialReport]:
    """Solve every target's weight in sequence, writing the new values in (the originals kept in
    ``originals``; all put back on an error); returns, by parameter name, the solver's extras
    (concatenated over a grouped convolution's groups), and the pass's report. ``paired``
    reduces each layer's inputs beside those of the model before compression instead of the
    Hessian alone (see :func:`~surgery.core.sequential.run_sequential`); what it adds beside
    ``hessian`` (GPTAQ's ``asymmetry``) reaches the solver as a keyword."""
    by_layer = {target.module_name: (name, target) for name, target in targets.items()}
    results: dict[str, tuple[Tensor, ...]] = {}
    homes = {name: target.param.device for name, target in targets.items()}  # where each weight is kept

    method = method or getattr(settings, "method", None) or "the second-order method"

    def solve(hessians: dict[str, dict[str, Any]]) -> Mapping[str, Tensor]:
        return _SolvedOneByOne(hessians, by_layer, solver, results, homes, (field, str(method)))

    report = run_sequential(
        model,
        {layer: t.module for layer, (_, t) in by_layer.items()},
        calibration,
        solve,
        params=lambda layer: (by_layer[layer][0], by_layer[layer][1].param),
        blocks=blocks,
        field=field,
        progress=progress,
        reduce=HessianReducer,
        originals=originals,
        settings=settings,
        paired=paired,
        unrouted=unrouted,
    )
    return results, report


class _SolvedOneByOne(Mapping[str, Tensor]):
    """A stage's new weights, each layer solved when its value is asked for (the caller writes it
    in at once) and its Hessian dropped then: beside the stage's weights, memory holds one new
    matrix and the Hessians not yet used, not every new matrix of the stage at once."""

    def __init__(
        self,
        hessians: dict[str, dict[str, Any]],
        by_layer: dict[str, tuple[str, Target]],
        solver: MatrixSolver,
        results: dict[str, tuple[Tensor, ...]],
        homes: dict[str, torch.device],
        said: tuple[str, str],
    ) -> None:
        self.hessians, self.solver, self.results, self.homes = hessians, solver, results, homes
        self.layers = {by_layer[layer][0]: (layer, by_layer[layer][1]) for layer in hessians}
        self.said = said  # (field, method): who says so when a layer's inputs were all zero

    def __getitem__(self, name: str) -> Tensor:
        give_back_freed_memory()  # the previous layer's solve: freed, and handed back before the next
        layer, target = self.layers[name]
        found = self.hessians.pop(layer)  # each layer is solved once
        value = guards.current_value(target.param)
        unrouted = found is UNROUTED
        if unrouted:  # no input reached it and the caller allowed that: solved on zero statistics
            columns = weight_matrix(target.module, value).shape[1]  # per group already (a grouped conv)
            found = {"hessian": torch.zeros(groups_of(target.module), columns, columns, device=value.device)}
            warn_unrouted(self.said[0], layer, self.said[1])
        extra = {key: found[key] for key in ("asymmetry",) if key in found}
        hessian = found.pop("hessian")
        # inputs all zero (every group's diagonal): the solver can only round or rank by magnitude
        if not unrouted and not bool(torch.diagonal(hessian, dim1=-2, dim2=-1).any()):
            warn_zero_inputs(self.said[0], layer, self.said[1])
        matrix, extras = _solve_groups(
            layer, target.module, weight_matrix(target.module, value), hessian, self.solver, extra
        )
        # the grids and masks where the weight is kept (its block may be onloaded to a GPU)
        self.results[name] = tuple(extra.to(self.homes[name]) for extra in extras)
        return from_matrix(target.module, matrix, value)

    def __contains__(self, name: object) -> bool:
        return name in self.layers

    def __iter__(self) -> Iterator[str]:
        return iter(self.layers)

    def __len__(self) -> int:
        return len(self.layers)


def _solve_groups(
    layer: str, module: nn.Module, matrix: Tensor, hessian: Tensor, solver: MatrixSolver, extra: dict[str, Tensor]
) -> tuple[Tensor, tuple[Tensor, ...]]:
    groups = groups_of(module)
    rows = matrix.shape[0] // groups
    parts = [
        solver(layer, matrix[g * rows : (g + 1) * rows], hessian[g], **{k: v[g] for k, v in extra.items()})
        for g in range(groups)
    ]
    if groups == 1:
        return parts[0]
    merged = torch.cat([p[0] for p in parts])
    extras = tuple(
        torch.cat([p[1][i] for p in parts]) if parts[0][1][i].dim() else parts[0][1][i] for i in range(len(parts[0][1]))
    )
    return merged, extras
