"""AutoRound (Cheng et al. 2024, intel/auto-round's SignRound) as a weight method.

Block after block (a transformer's decoder layers, as sequential calibration finds them), every
selected weight ``W`` gets rounding offsets ``V`` (its shape, starting at 0) and, per group, two
factors in [0, 1] on its range's minimum and maximum (starting at 1). The block runs with each
weight fake-quantized as ``scale * (clamp(round(W / scale + V) + zero, qmin, qmax) - zero)``,
``scale`` and ``zero`` from the scaled range, rounding passing gradients straight through, and
signed gradient descent (each step moves every value by the learning rate against its
gradient's sign) lowers the mean squared error between that output and the block's float output
on the float model's inputs (on hidden states, each sequence's last position left out, as
auto-round 0.16 does). As auto-round 0.16 does by default: ``iterations`` steps (200), a
learning rate of ``1 / iterations`` for both kinds of values decaying linearly to 0, a batch of 8
calibration samples (here: calibration batches) drawn in a shuffled order seeded with 42, the
values of the step with the least loss kept, and the next block fed by the quantized block.

The rounded weights are written into the model (their originals kept, as GPTQ does) and each
weight's scales and zero points are returned, so ``restore()`` is exact and exports hold the
tuned integers. Asymmetric grids are auto-round's ``int_asym``; ``observer="full_range"`` is its
``int_sym`` (symmetric, the extra level on the larger side, held as an affine grid); a symmetric
grid is surgery's (``max |range| / ((qmax - qmin) / 2)``). With ``observer="mse"`` the range
factors start at the clipping the ``mse`` observer searches for each group (1 otherwise), as
auto-round starts from AWQ's searched clipping with ``clip_as_init``. On the FP4 formats only each block's
largest magnitude has a factor: ``mxfp4`` is auto-round's ``mx_fp`` (E8M0 scales, equal to it bit
for bit), ``nvfp4`` its ``nv_fp`` (E4M3 block scales under a per-tensor one; the rounding and its
gradients equal to it on the same values, the scale in surgery's arithmetic).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call

from surgery.core import guards
from surgery.core.block_inputs import next_inputs
from surgery.core.capture import Capture, MinMax
from surgery.core.errors import ConfigError, ConfigTypeError, NoCalibrationInputError
from surgery.core.progress import tqdm
from surgery.core.sequential import StageInputs, run_sequential
from surgery.core.settings import whole_count
from surgery.core.targets import Target
from surgery.ops.numerics.fake_quant import stored_offset, stored_scale, super_grouped, super_grouped_offsets
from surgery.ops.numerics.grid import ITERATIONS_LIMIT, GridSpec
from surgery.ops.numerics.number_formats import E4M3_LARGEST
from surgery.ops.numerics.weight_methods import QuantizedWeight, WeightProblem, register_weight_method
from surgery.ops.second_order.hessians import from_matrix, supports_hessian, weight_matrix
from surgery.ops.second_order.second_order import warn_unrouted, warn_zero_inputs

BATCH = 8  # auto-round's batch_size: samples per step
SEED = 42  # auto-round's seed
SMALLEST_SCALE = 1e-8  # auto-round's q_scale_thresh for float32 scales


@dataclass(frozen=True)
class AutoRoundSettings:
    """AutoRound's own settings, apart from the grid, defaulting to auto-round 0.16's:
    ``iterations`` (signed-gradient steps per block), ``batch`` (calibration samples per step),
    ``seed`` (of the samples' order) and ``lr`` (the rate, decaying linearly to 0; None:
    ``1 / iterations``, auto-round's)."""

    iterations: int = 200
    batch: int = BATCH
    seed: int = SEED
    lr: float | None = None

    def __post_init__(self) -> None:
        whole_count(
            "quantize.method.iterations", self.iterations, "tuning steps", at_most=ITERATIONS_LIMIT, example=200
        )
        whole_count("quantize.method.batch", self.batch, "samples a step", at_most=1 << 16, example=8)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ConfigTypeError("quantize.method.seed", self.seed, "must be an integer")
        lr = self.lr
        if lr is not None and (isinstance(lr, bool) or not isinstance(lr, (int, float)) or not 0 < lr <= 1):
            raise ConfigError("quantize.method.lr", lr, "must be null (1 / iterations) or a number in (0, 1]")


class SignSGD(torch.optim.Optimizer):
    """Each step moves every parameter by its group's ``lr`` against its gradient's sign."""

    def __init__(self, params: list[dict[str, Any]], lr: Tensor) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # noqa: ARG002 - the Optimizer signature
        """One signed step of every parameter with a gradient."""
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    param.add_(torch.sign(param.grad), alpha=-float(group["lr"]))


class IndexSampler:
    """auto-round's sampler: batches taken in a shuffled order, reshuffled when fewer than a batch are left."""

    def __init__(self, count: int, batch: int, shuffler: random.Random) -> None:
        self.count, self.batch, self.index = count, min(batch, count), 0
        self.random = shuffler
        self.order = list(range(count))
        self.random.shuffle(self.order)

    def next_batch(self) -> list[int]:
        """The next batch of indices."""
        if self.index + self.batch > self.count:
            self.random.shuffle(self.order)
            self.index = 0
        chosen = self.order[self.index : self.index + self.batch]
        self.index += self.batch
        return chosen


def round_ste(x: Tensor) -> Tensor:
    """Rounded to nearest (half to even), the gradient passing straight through."""
    return (x.round() - x).detach() + x


@dataclass
class TunedWeight:
    """One weight in groups (rows of ``rows``) with its rounding offsets and range factors."""

    key: str  # qualified parameter name
    name: str  # the parameter's name inside the stage's module
    module: nn.Module
    value: Tensor  # its current value
    rows: Tensor  # (groups, group size), float32, the last group padded with zeros
    outputs: int  # the weight matrix's rows
    columns: int  # the weight matrix's columns before padding
    offsets: nn.Parameter
    low: nn.Parameter  # factor on each group's minimum (integer grids)
    high: nn.Parameter  # factor on each group's maximum (on a floating-point grid: on its largest magnitude)
    tensor_amax: Tensor  # the whole weight's largest magnitude (nvfp4's per-tensor scale)

    def quantized(self, spec: GridSpec) -> tuple[Tensor, Tensor, Tensor]:
        """The fake-quantized weight in its own shape, with each group's scale and zero point."""
        with torch.no_grad():
            self.low.clamp_(0.0, 1.0)
            self.high.clamp_(0.0, 1.0)
        if spec.is_float:
            rounded, scale = FLOAT_GRIDS[spec.format](self.rows, self.offsets, self.high, self.tensor_amax)
            zero = torch.zeros_like(scale)
        else:
            rounded, scale, zero = qdq(self.rows, self.offsets, self.low, self.high, spec)
        matrix = rounded.reshape(self.outputs, -1)[:, : self.columns]
        return from_matrix(self.module, matrix, self.value), scale, zero


def qdq(rows: Tensor, offsets: Tensor, low: Tensor, high: Tensor, spec: GridSpec) -> tuple[Tensor, Tensor, Tensor]:
    """auto-round's ``quant_tensor_asym`` on (groups, size) ``rows`` (surgery's symmetric grid
    when ``spec.symmetric``; auto-round's ``int_sym`` with ``observer="full_range"``, its signed
    scale ``s`` held as ``|s|`` and a zero point, its rounding offsets negated where ``s < 0``, so
    a group whose larger side changes while tuning keeps them as auto-round does):
    the rounded rows, and each group's scale and zero point."""
    quant_min, quant_max = spec.quant_range
    smallest = rows.min(1).values.clamp(max=0) * low
    largest = rows.max(1).values.clamp(min=0) * high
    if spec.symmetric:
        scale = (torch.maximum(-smallest, largest) / ((quant_max - quant_min) / 2)).clamp(min=SMALLEST_SCALE)
        zero = torch.zeros_like(scale)
    elif spec.observer == "full_range":  # auto-round's int_sym: its signed scale as |scale| and a zero point
        half = (quant_max + 1) // 2
        negative = -smallest > largest  # its scale > 0: the lowest level is -half * scale
        scale = (torch.maximum(-smallest, largest) / half).clamp(min=SMALLEST_SCALE)
        zero = torch.where(negative, half, half - 1).to(scale.dtype).detach()
        # its offsets move round(w / scale); under a negative scale that is round(w / |scale|) moved back
        offsets = offsets * torch.where(negative, 1.0, -1.0)[:, None]
    elif spec.float_offset:  # the group's minimum as a float offset: value = scale x q - offset
        return _offset_qdq(rows, offsets, smallest, largest, spec)
    else:
        scale = ((largest - smallest) / (quant_max - quant_min)).clamp(min=SMALLEST_SCALE)
        zero = round_ste(-smallest / scale).clamp(quant_min, quant_max)
    scale = _as_stored(scale, spec)
    if spec.scale_dtype is not None and not spec.symmetric and spec.observer != "full_range":
        zero = round_ste(-smallest / scale).clamp(quant_min, quant_max)  # against the stored scale
    integers = torch.clamp(round_ste(rows / scale[:, None] + offsets) + zero[:, None], quant_min, quant_max)
    return scale[:, None] * (integers - zero[:, None]), scale, zero


def _offset_qdq(
    rows: Tensor, offsets: Tensor, smallest: Tensor, largest: Tensor, spec: GridSpec
) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`qdq` on a float-offset grid: scale ``(max - min) / (2^bits - 1)`` and offset ``-min``
    of the tuned range, each rounded as stored (and onto the super groups' two levels), the
    gradient straight through."""
    quant_min, quant_max = spec.quant_range
    scale = ((largest - smallest) / (quant_max - quant_min)).clamp(min=SMALLEST_SCALE)
    scale, offset = _as_stored(scale, spec), _as_stored(-smallest, spec, offsets=True)
    integers = torch.clamp(round_ste((rows + offset[:, None]) / scale[:, None] + offsets), quant_min, quant_max)
    return scale[:, None] * integers - offset[:, None], scale, offset


def _as_stored(value: Tensor, spec: GridSpec, *, offsets: bool = False) -> Tensor:
    """Each group's scale (or float offset) exactly as the format stores it: rounded to
    ``scale_dtype``, then onto the super groups' two levels; the gradient passes straight through."""
    stored = value.detach()
    if spec.scale_dtype is not None:
        stored = stored_offset(stored, spec) if offsets else stored_scale(stored, spec)
    if spec.super_group:
        two_levels = super_grouped_offsets if offsets else super_grouped
        stored = two_levels(stored.reshape(1, -1), spec).reshape(-1)
    return stored + (value - value.detach())  # exactly the stored value forward


def floor_ste(x: Tensor) -> Tensor:
    """Rounded down, the gradient passing straight through."""
    return (x.floor() - x).detach() + x


def e2m1_by_exponent(x: Tensor) -> Tensor:
    """``x`` (within ±6) rounded to FP4 E2M1, ties to even, as auto-round's MX path rounds: each
    value's own exponent ``floor(log2 |x|)`` (at least 0) taken with a straight-through floor, so
    the gradient also flows through it."""
    exponent = floor_ste(torch.log2(x.abs() + (x == 0).to(x.dtype))).clamp(min=0.0)
    scaled = x / torch.exp2(exponent) * 2.0  # one mantissa bit in the integer part
    magnitude = scaled.abs()
    tie_to_odd = ((magnitude - 0.5) % 2 == 0).to(x.dtype)  # x.5 with an even floor: round down
    rounded = torch.sign(scaled) * (floor_ste(magnitude + 0.5) - tie_to_odd)
    return (rounded / 2.0 * torch.exp2(exponent)).clamp(-6.0, 6.0)


def e2m1_by_ranges(x: Tensor) -> Tensor:
    """``x`` (within ±6) rounded to FP4 E2M1, ties to even, as auto-round's NVFP4 path rounds:
    steps of 0.5 below 2, of 1 below 4, of 2 above, each a straight-through rounding."""
    magnitude = x.abs()
    small, middle = magnitude < 2.0, magnitude < 4.0
    stepped = (
        round_ste(2.0 * magnitude) / 2.0 * small
        + round_ste(magnitude) * (~small) * middle
        + 2.0 * round_ste(magnitude / 2.0) * (~small) * (~middle)
    )
    return stepped.clamp(-6.0, 6.0) * torch.sign(x)


def mxfp4_tuned(rows: Tensor, offsets: Tensor, high: Tensor, tensor_amax: Tensor) -> tuple[Tensor, Tensor]:
    """auto-round's ``mx_fp`` (4 bits): each block's scale ``2^(floor(log2(amax * high)) - 2)``
    (a straight-through floor), ``rows / scale + offsets`` clipped to ±6 and rounded to E2M1."""
    amax = rows.abs().amax(1) * high
    exponent = floor_ste(torch.where(amax == 0, torch.ones_like(amax), torch.log2(amax)))
    scale = torch.exp2((exponent - 2.0).clamp(-127.0, 127.0))
    values = e2m1_by_exponent((rows / scale[:, None] + offsets).clamp(-6.0, 6.0))
    return values * scale[:, None], scale.detach()


def nvfp4_tuned(rows: Tensor, offsets: Tensor, high: Tensor, tensor_amax: Tensor) -> tuple[Tensor, Tensor]:
    """auto-round's ``nv_fp4``: each block's scale ``amax * high / 6`` in FP8 E4M3 (a
    straight-through cast) relative to the per-tensor ``tensor_amax / (448 * 6)``, surgery's
    arithmetic for it (so the written weights are on the grid the scale names), ``rows /
    scale + offsets`` clipped to ±6 and rounded to E2M1."""
    outer = tensor_amax / (E4M3_LARGEST * 6.0)
    outer = torch.where(outer > 0, outer, torch.ones_like(outer))  # an all-zero weight: every block's scale 1
    inner = (rows.abs().amax(1) * high / 6.0 / outer).clamp(0.0, E4M3_LARGEST)
    inner = (inner.to(torch.float8_e4m3fn).float() - inner).detach() + inner
    scale = inner * outer
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero block stays zero
    values = e2m1_by_ranges((rows / safe[:, None] + offsets).clamp(-6.0, 6.0))
    return values * safe[:, None], safe.detach()


# the floating-point grids AutoRound tunes: (rows, offsets, factor on the largest magnitude, the
# weight's largest magnitude) -> (rounded rows, each block's scale)
FLOAT_GRIDS: dict[str, Callable[[Tensor, Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]] = {
    "mxfp4": mxfp4_tuned,
    "nvfp4": nvfp4_tuned,
}


def tuned_weight(key: str, name: str, target: Target, spec: GridSpec) -> TunedWeight:
    """A weight's tuning state: zero offsets, range factors of 1."""
    value = guards.current_value(target.param).detach()
    matrix = weight_matrix(target.module, value).float()
    columns = matrix.shape[1]
    if spec.group_size:
        size = spec.group_size
        rows = torch.nn.functional.pad(matrix, (0, (-columns) % size)).reshape(-1, size)
    else:
        rows = matrix if spec.per_channel else matrix.reshape(1, -1)
    groups = rows.shape[0]
    start = searched_factors(rows, spec) if spec.observer_name == "mse" else torch.ones(groups, device=rows.device)
    return TunedWeight(
        key,
        name,
        target.module,
        value,
        rows,
        matrix.shape[0],
        columns,
        nn.Parameter(torch.zeros_like(rows)),
        nn.Parameter(start.clone()),
        nn.Parameter(start.clone()),
        matrix.abs().amax(),
    )


def searched_factors(rows: Tensor, spec: GridSpec) -> Tensor:
    """Each group's clipping ``p`` (its range ``p x (min, max)``) as the ``mse`` observer searches
    it on ``spec``'s grid: the range factors' starting values, as auto-round starts its range from
    AWQ's searched clipping (``clip_as_init``) and tunes on top."""
    low, high = spec.observe(rows, None)
    largest, smallest = rows.amax(1), rows.amin(1)
    by_low = torch.where(smallest < 0, low / smallest.clamp(max=-torch.finfo(torch.float32).tiny), 1.0)
    return torch.where(largest > 0, high / largest.clamp(min=torch.finfo(torch.float32).tiny), by_low).clamp(0.0, 1.0)


def hidden_of(output: Any) -> Tensor:
    """A block's hidden states: its output, or the output's first entry."""
    return output if isinstance(output, Tensor) else output[0]


class BlockTuner:
    """AutoRound's pass over the stages of a sequential walk: each stage's weights tuned on its
    calls against the float stage's outputs on the float model's inputs."""

    def __init__(self, problem: WeightProblem) -> None:
        self.problem, self.spec = problem, problem.spec
        self.by_module = {id(t.module): (key, t) for key, t in problem.targets.matched.items()}
        self.found: dict[str, tuple[Tensor, Tensor]] = {}  # key -> (scale, zero point), per group
        self.float_outputs: list[Tensor] | None = None  # the last stage's float outputs, on float inputs
        self.losses: list[float] = []  # each stage's least loss
        given = problem.settings if isinstance(problem.settings, AutoRoundSettings) else None
        self.settings = given or AutoRoundSettings()
        self.shuffler = random.Random(self.settings.seed)  # one for the whole pass, as auto-round's seeded global one
        self.unrouted: list[str] = []  # layers no calibration input reached, kept at round to nearest

    def __call__(self, stage: StageInputs) -> dict[str, Tensor]:
        """The stage's new weights (and their grids in ``found``)."""
        weights = self._weights(stage.module)
        calls = list(stage.calls)
        keys = {weight.key for weight in weights}
        layers = {key: target.module for key, target in self.by_module.values() if key in keys}
        with Capture(stage.module, layers, ("inputs",), MinMax) as seen:  # each layer's range in the float pass
            targets = self._targets(stage, calls)
        for weight in weights:
            layer = self.problem.targets.matched[weight.key].module_name
            if seen.inputs.get(weight.key) is None:  # no input reached it (an expert its router never chose)
                if self.problem.unrouted != "rtn":
                    raise NoCalibrationInputError(
                        "calibration",
                        layer,
                        "this layer received no floating-point input during calibration",
                        "give batches that run through it, or exclude it (or quantize with unrouted='rtn')",
                    )
                warn_unrouted("quantize.calibration", layer, "autoround")  # its offsets stay 0: RTN is kept
                self.unrouted.append(layer)
            elif seen.inputs.get(weight.key) == (0.0, 0.0):  # nothing to tune against: RTN would be kept
                warn_zero_inputs("quantize.calibration", layer, "autoround")
        with torch.enable_grad():
            best = self._tune(stage.module, calls, targets, weights)
        written = {}
        with torch.no_grad():
            for weight, (offsets, low, high) in zip(weights, best):
                weight.offsets.copy_(offsets), weight.low.copy_(low), weight.high.copy_(high)
                value, scale, zero = weight.quantized(self.spec)
                written[weight.key] = value.detach()
                self.found[weight.key] = (scale.detach(), zero.detach())
        return written

    def _weights(self, module: nn.Module) -> list[TunedWeight]:
        """The tuning state of every selected weight inside ``module``."""
        found = []
        for name, inner in module.named_modules():
            if id(inner) in self.by_module:
                key, target = self.by_module[id(inner)]
                found.append(
                    tuned_weight(key, f"{name}.{target.attribute}" if name else target.attribute, target, self.spec)
                )
        return found

    def _targets(self, stage: StageInputs, calls: list[tuple[tuple, dict]]) -> list[Tensor]:
        """The float stage's outputs on the float model's inputs: where the calls are the last
        stage's outputs, the last stage's float outputs in their place; otherwise the calls."""
        floats = calls
        if self.float_outputs is not None and stage.follows is not None:
            pairs = zip(self.float_outputs, calls)
            floats = [next_inputs(out, args, kwargs) or (args, kwargs) for out, (args, kwargs) in pairs]
        self.float_outputs = [hidden_of(stage.module(*args, **kwargs)).detach() for args, kwargs in floats]
        return self.float_outputs

    def _tune(
        self, block: nn.Module, calls: list[tuple[tuple, dict]], targets: list[Tensor], weights: list[TunedWeight]
    ) -> list[tuple[Tensor, Tensor, Tensor]]:
        """Signed gradient descent on the weights' offsets and range factors; the values of the
        step with the least loss (measured before that step moves them)."""
        steps = self.settings.iterations
        rate = torch.tensor(self.settings.lr or 1.0 / steps)
        groups = [{"params": [w.offsets for w in weights], "lr": rate.clone()}]
        groups.append({"params": [p for w in weights for p in (w.low, w.high)], "lr": rate.clone()})
        optimizer = SignSGD(groups, rate)
        schedule = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1.0, end_factor=0.0, total_iters=steps)
        sampler = IndexSampler(len(calls), self.settings.batch, self.shuffler)
        frozen = {name: p.detach() for name, p in block.named_parameters()}
        best_loss, best = float("inf"), _snapshot(weights)
        bar = tqdm(
            range(steps), desc="autoround", unit="step", leave=False, disable=None if self.problem.progress else True
        )
        for _ in bar:
            chosen = sampler.next_batch()
            total = sum(targets[i].numel() for i in chosen)
            replaced = guards.stand_ins(block, {**frozen, **{w.name: w.quantized(self.spec)[0] for w in weights}})
            loss = sum(
                squared_error(hidden_of(functional_call(block, replaced, *calls[index])), targets[index]) / total
                for index in chosen
            )
            loss.backward()  # one pass back through the rounding for the whole batch, as auto-round's
            loss_sum = loss.item()
            if loss_sum < best_loss:
                best_loss, best = loss_sum, _snapshot(weights)
            optimizer.step()
            optimizer.zero_grad()
            schedule.step()
        self.losses.append(best_loss)
        return best


def squared_error(output: Tensor, target: Tensor) -> Tensor:
    """The summed squared error of a block's output, in float32; on (batch, sequence, features)
    hidden states without each sequence's last position, as auto-round leaves it out of its
    loss (it has no next token to predict). Divided by every entry's count, it is auto-round's
    masked mean."""
    error = output.float() - target.float()
    if error.dim() == 3:
        error = error[:, :-1]
    return error.pow(2).sum()


def _snapshot(weights: list[TunedWeight]) -> list[tuple[Tensor, Tensor, Tensor]]:
    """A copy of every weight's tuned values."""
    return [(w.offsets.detach().clone(), w.low.detach().clone(), w.high.detach().clone()) for w in weights]


RANGES = ("minmax", "full_range", "mse")  # the observers whose range AutoRound starts from and tunes


def check_problem(problem: WeightProblem) -> None:
    """AutoRound tunes the weights of Linear, convolution and Conv1D layers onto integer grids,
    starting from each group's extremes."""
    spec = problem.spec
    if spec.is_float and spec.format not in FLOAT_GRIDS:
        raise ConfigError(
            "quantize.weights.format",
            spec.format,
            f"autoround rounds onto integer grids and {', '.join(FLOAT_GRIDS)}; use method rtn or gptq for it",
        )
    allowed = ("minmax",) if spec.is_float else RANGES
    if spec.observer_name not in allowed:
        raise ConfigError(
            "quantize.weights.observer",
            spec.observer_name,
            f"autoround tunes each group's range from its extremes (or from the mse search's clipping on "
            f"an integer grid); use {', '.join(allowed)}",
        )
    for name, target in problem.targets.matched.items():
        if target.attribute != "weight" or not supports_hessian(target.module):
            raise ConfigError(
                "quantize.select",
                name,
                "autoround tunes Linear, Conv1d, Conv2d and Hugging Face Conv1D weights; this is "
                f"{type(target.module).__name__}.{target.attribute} (exclude it)",
            )


def solve_autoround(problem: WeightProblem) -> dict[str, QuantizedWeight]:
    """AutoRound on every selected weight, block after block (see the module docstring)."""
    check_problem(problem)
    tuner = BlockTuner(problem)
    by_layer = {t.module_name: (key, t) for key, t in problem.targets.matched.items()}
    problem.sequential = run_sequential(
        problem.model,
        {layer: target.module for layer, (_, target) in by_layer.items()},
        problem.calibration,
        tuner,
        params=lambda layer: (by_layer[layer][0], by_layer[layer][1].param),
        reduce=None,
        blocks=problem.blocks,
        field="quantize.calibration",
        progress=problem.progress,
        originals=problem.originals,
        settings=(problem.spec, tuner.settings, problem.unrouted),
    )
    problem.sequential.unrouted.extend(tuner.unrouted)
    return {key: _answer(problem, key, *tuner.found[key]) for key in problem.targets.matched}


def _answer(problem: WeightProblem, key: str, scale: Tensor, zero: Tensor) -> QuantizedWeight:
    """The grid in surgery's layout: (outputs, groups), (outputs,) per channel, or scalars."""
    spec = problem.spec
    zero = zero.float() if spec.float_offset else zero.to(torch.int32)
    if not spec.group_size and not spec.per_channel:
        return QuantizedWeight(scale.reshape(()), zero.reshape(()), None)
    outputs = weight_matrix(problem.targets.matched[key].module, problem.value(key)).shape[0]
    if spec.group_size:
        return QuantizedWeight(scale.reshape(outputs, -1), zero.reshape(outputs, -1), problem.axis(key))
    return QuantizedWeight(scale, zero, problem.axis(key))


register_weight_method(
    "autoround",
    solve_autoround,
    needs_calibration=True,
    sequential=True,
    float_stream=True,
    settings=AutoRoundSettings,
)
