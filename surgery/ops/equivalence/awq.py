"""``surgery.awq``: activation-aware weight scaling before quantization (AWQ, Lin et al. 2024), restorable.

A weight column that multiplies large activations matters more. AWQ multiplies each input
channel ``j`` of a group of layers reading the same input by ``s_j`` and divides what produces
that input by it, so the model computes the same function while the salient columns get a finer
share of the quantization grid. Block by block, as the reference code (``llm-awq``) does:

1. The block runs on its calibration inputs; each Linear's inputs are kept, and each group's
   *inspected module* (the smallest module holding the whole group: the attention for q/k/v,
   the MLP for gate/up, the layer itself otherwise) is recorded with its calls.
2. Groups: layers reading one input tensor. Their producer is a normalisation layer (its
   weight and bias absorb ``1/s``), or a Linear layer whose output channels can be divided by
   ``s`` without changing the block's output (``up_proj`` before ``down_proj``; ``v_proj``
   before ``o_proj`` when there are as many key/value heads as query heads), found by trying a
   random scale. A group with neither is left out, and listed in ``handle.skipped``. A
   mixture-of-experts block's router and every expert's input layers read its input (a reshape
   of the norm's output) as one group: the router takes the scales exactly but stays float (not
   rounded in the search, not clipped), and the group's statistic is the router's input, every
   token (one scale serves every expert; each expert's own tokens still drive its clipping).
3. For each group, on the unchanged block, ``s = mean|x|^r`` normalised by
   ``sqrt(max s · min s)``, for ``r`` in ``0, 1/n_grid, …``: the group's weights times ``s``
   are rounded onto ``weights``'s grid and divided by ``s`` again, the inspected module runs,
   and the ``r`` with the least mean squared output error wins.
4. Every group's scales are applied; then each layer's weights (but those feeding ``q·k``:
   names holding ``q_``, ``k_``, ``query``, ``key``, ``Wqkv``) are clipped to the fraction of
   each group's range, in ``1, 1 − 1/n_grid, …`` down to ``1 − max_shrink``, whose rounded
   weights give the least output error on a sample of ``clip_tokens`` of its (scaled) inputs.
5. The next block's inputs are the unchanged block's outputs.

The result is a rewrite of weights (``handle.restore()`` puts every value back); quantize after
it with the same grid, by round to nearest or GPTQ::

    handle = surgery.awq(model, weights=GridSpec(bits=4, group_size=128), calibration=batches)
    surgery.quantize(model, weights=GridSpec(bits=4, group_size=128), calibration=batches)
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from dataclasses import replace as replace_fields
from typing import Any

import torch
from torch import Tensor, nn

from surgery.core import guards
from surgery.core.block_inputs import catch_inputs, next_inputs
from surgery.core.errors import ConfigError, ConfigTypeError
from surgery.core.handles import Handle
from surgery.core.inputs import Inputs, evaluating
from surgery.core.progress import tqdm
from surgery.core.sequential import materialise, resolve_blocks, trace_stages
from surgery.core.settings import whole_count
from surgery.core.transforms import attach_all
from surgery.core.verbs import VerbCall, verb
from surgery.ops.equivalence.smoothing import Rescaled, is_norm, whole
from surgery.ops.experts.linear_experts import LinearExperts
from surgery.ops.experts.linearizing import with_linear_experts
from surgery.ops.experts.routing import expert_inputs, gates_in, moe_blocks
from surgery.ops.numerics.fake_quant import Grid, fake_quantize, fake_quantize_groups
from surgery.ops.numerics.grid import GridSpec
from surgery.ops.numerics.observers import Observer
from surgery.ops.offload.offloaded_compression import OffloadedCompression, OffloadedVerb, compress_offloaded
from surgery.ops.offload.offloading import Offloaded

log = logging.getLogger("surgery")
NO_CLIP = ("q_", "k_", "query", "key", "Wqkv")  # llm-awq's: layers whose outputs meet in q·k are not clipped
GRID_LIMIT = 1_000  # llm-awq searches 20 points; each is a forward of every block


class AwqScaled(Rescaled):
    """A one-time rewrite of a parameter to AWQ's scaled (and clipped) values."""

    kind = "awq"


@dataclass
class AwqGroup:
    """Layers reading one input, what produces it (``None``: nothing foldable), the module
    whose output the search compares, and the ratio and scales found. ``gates``: the routers and
    gates of a mixture-of-experts block reading the same input, which take the scales exactly
    (the function stays the same) but are not rounded in the search: they stay float."""

    block: str
    layers: list[str]
    producer: str | None
    inspected: str
    gates: list[str] = field(default_factory=list)
    ratio: float = 0.0
    loss: float = 0.0
    scales: Tensor | None = field(default=None, repr=False)


class AwqHandle(Handle):
    """Handle returned by :func:`awq`: ``groups`` (each with its ratio and scales), ``clipped``
    (each clipped weight's ``max |w|`` per output and group) and ``skipped`` groups."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__("awq", model)
        self.groups: list[AwqGroup] = []
        self.clipped: dict[str, Tensor] = {}
        self.skipped: list[AwqGroup] = []


@dataclass(frozen=True)
class AwqSpec:
    """AWQ's settings but the calibration batches (see :func:`awq`)."""

    weights: GridSpec = field(default_factory=lambda: GridSpec(bits=4, group_size=128))
    n_grid: int = 20
    clip: bool = True
    max_shrink: float = 0.5
    clip_tokens: int = 512
    blocks: Any = None

    def __post_init__(self) -> None:
        if not isinstance(self.weights, GridSpec):
            raise ConfigTypeError("awq.weights", self.weights, "must be a GridSpec (the grid the search rounds onto)")
        whole_count("awq.n_grid", self.n_grid, "grid points", at_most=GRID_LIMIT, example=20)
        if isinstance(self.clip_tokens, bool) or not isinstance(self.clip_tokens, int) or self.clip_tokens < 1:
            raise ConfigError("awq.clip_tokens", self.clip_tokens, "must be an integer >= 1")
        if not isinstance(self.clip, bool):
            raise ConfigTypeError("awq.clip", self.clip, "must be true or false")
        shrink = self.max_shrink
        if isinstance(shrink, bool) or not isinstance(shrink, (int, float)) or not 0 <= shrink < 1:
            raise ConfigError("awq.max_shrink", shrink, "must be a number in [0, 1)")


@verb(
    "awq",
    AwqSpec,
    calibration="required",
    offloaded=lambda source, spec, call: _awq_offloaded(source, spec, call.calibration, call.work, call.progress),
    experts=with_linear_experts,
)
def awq(model: nn.Module, spec: AwqSpec, call: VerbCall) -> AwqHandle | OffloadedCompression:
    """Scale (and clip) the model's weights for ``weights``'s grid, AWQ's way (see the module
    docstring); return a handle whose ``restore()`` gives back every original value.

    Args:
        model: the model to rewrite in place (a transformer: its repeated blocks are found as
            sequential calibration finds them, or named with ``blocks``).
        spec: an :class:`AwqSpec` holding the settings below (the keywords are a shorthand for it).
        weights: the grid the search rounds onto, the one the model is quantized to afterwards
            (default 4 bits, groups of 128, affine).
        calibration: the batches whose activations decide the scales.
        n_grid: ratios tried for the scales, and clipping steps.
        clip: search each layer's clipping range too.
        max_shrink: the most of a group's range clipping may cut.
        clip_tokens: inputs sampled per layer for the clipping search.
        work: for an offloaded model (:func:`surgery.offloaded`'s handle, scaled block by
            block, the result an :class:`~surgery.OffloadedCompression`), the folder finished
            blocks are written to (as for :func:`surgery.quantize`).
    """
    return _awq_in_memory(model, spec, call.calibration, call.progress)


def _awq_in_memory(model: nn.Module, spec: AwqSpec, calibration: Inputs, progress: bool) -> AwqHandle:
    """:func:`awq` on a model in memory (its fused experts already per-expert layers)."""
    calls = materialise(calibration, "awq.calibration", model, spec)
    block_names = resolve_blocks(model, spec.blocks, "awq.blocks")
    if not block_names:
        raise ConfigError("awq.blocks", type(model).__name__, "has no repeated blocks to scale; name them with blocks=")
    handle = AwqHandle(model)
    values: dict[str, Tensor] = {}
    params = dict(model.named_parameters())
    _check_free(model, block_names, spec)
    with evaluating(model), torch.no_grad():
        chained: set[str] = set()
        layers = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
        inside = {n: m for n, m in layers.items() if any(n.startswith(b + ".") for b in block_names)}
        trace_stages(model, inside, block_names, calls[0], "awq.calibration", chained)
        inputs = None
        for index, block in enumerate(tqdm(block_names, desc="awq", unit="block", disable=None if progress else True)):
            module = model.get_submodule(block)
            if inputs is None:
                inputs = catch_inputs(model, module, calls)
            outputs = _block(handle, block, module, list(inputs), spec, values)
            following = index + 1 < len(block_names) and block in chained
            inputs = outputs if following and outputs is not None else None
    if not handle.groups:
        if not values:
            raise ConfigError(
                "awq",
                type(model).__name__,
                "found no group of layers whose input a norm or a Linear layer can rescale, and nothing to "
                "clip: it would change nothing (see the left-out groups in the log)",
            )
        log.warning("awq: no group of layers could be scaled; only the clipping search was applied")
    for name in values:
        guards.check_editable({name: params[name]}, "awq")
    with handle.applying():
        attach_all(handle, model, {n: (params[n], AwqScaled(v)) for n, v in values.items()}, "awq hook")
    return handle


def _check_free(model: nn.Module, block_names: list[str], spec: AwqSpec) -> None:
    """AWQ rewrites weights the way later quantization sees them: it goes first, and every
    layer it may clip must hold whole groups."""
    size = spec.weights.group_size
    for name, module in model.named_modules():
        if not any(name.startswith(b + ".") for b in block_names):
            continue
        for attribute, param in module.named_parameters(recurse=False):
            kinds = [t.kind for t in guards.transforms_of(param)]
            if kinds:
                raise ConfigError(
                    "awq",
                    f"{name}.{attribute}",
                    f"already has {', '.join(kinds)} attached; run awq first, then prune or quantize "
                    "(its scales are searched on the weights as they are)",
                )
        if isinstance(module, nn.Linear) and size and module.in_features % size:
            raise ConfigError(
                "awq.weights.group_size",
                size,
                f"does not divide the {module.in_features} inputs of {name}; AWQ's clipping search takes whole groups",
            )


def _awq_offloaded(source: Offloaded, spec: AwqSpec, calibration: Inputs, work: Any, progress: bool) -> Any:
    """Each block scaled on the block alone, fed by the unchanged blocks before it (as in memory)."""
    model = source.model
    calls = materialise(calibration, "awq.calibration", model, spec)
    blocks = resolve_blocks(model, spec.blocks, "awq.blocks")
    if not blocks:
        raise ConfigError("awq.blocks", type(model).__name__, "has no repeated blocks to scale; name them with blocks=")
    layers = {
        name: m
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and any(name.startswith(b + ".") for b in blocks)
    }

    def run(skeleton: nn.Module, staged: list[str], block: str | None, calls: Any) -> AwqHandle:
        return awq(skeleton, replace_fields(spec, blocks=[block]), calibration=calls, progress=False)

    verb = OffloadedVerb("awq", run, repr(spec), sequential=False)
    return compress_offloaded(source, verb, layers, calls, blocks=blocks, work=work, progress=progress)


def _block(
    handle: AwqHandle, block: str, module: nn.Module, calls: list[tuple[tuple, dict]], spec: AwqSpec, values: dict
) -> Any:
    """One block: its groups searched, scaled and clipped into ``values``; returns the next
    block's calls (the unchanged block's outputs), or None where they do not chain."""
    seen = _Recorded(module)
    with seen:
        outputs = [next_inputs(module(*a, **k), a, k) for a, k in calls]
    groups = _groups(block, module, seen, calls[0])
    original = {f"{block}.{n}": p.detach().clone() for n, p in module.named_parameters()}
    for group in groups:
        if group.producer is None:
            handle.skipped.append(group)
            log.info("awq: %s left out: nothing before it can absorb the scales", ", ".join(group.layers))
            continue
        _search(group, module, block, seen, calls, spec)
        handle.groups.append(group)
    features = {name: torch.cat([x.reshape(-1, x.shape[-1]) for x in xs]) for name, xs in seen.inputs.items()}
    mine = [group for group in handle.groups if group.block == block]
    current = _keeping_function(handle, mine, module, block, original, features, calls[0])
    if spec.clip:
        for local, layer in module.named_modules():
            if (
                isinstance(layer, nn.Linear)
                and not any(part in local for part in NO_CLIP)
                and local in features
                and local not in seen.gates  # routers stay float
            ):
                name = f"{block}.{local}.weight"
                limit = _clip_limits(current[name], features[local], spec)
                handle.clipped[name] = limit
                current[name] = _clipped(current[name], limit)
    values.update({name: value for name, value in current.items() if not torch.equal(value, original[name])})
    return None if any(o is None for o in outputs) else outputs


def _keeping_function(
    handle: AwqHandle, groups: list[AwqGroup], module: nn.Module, block: str, original: dict, features: dict, first: Any
) -> dict[str, Tensor]:
    """The block's values with every group's scales applied, if the block then computes what it
    did; else without the groups that change it (a norm whose output also feeds the residual,
    as in a post-norm block, or one computing ``x·(1 + w)``), which are moved to skipped."""

    def scaled(chosen: list[AwqGroup]) -> dict[str, Tensor]:
        current, scratch = dict(original), dict(features)
        for group in chosen:
            _apply(group, module, block, current, scratch)
        return current

    def unchanged(chosen: list[AwqGroup]) -> bool:
        reference = _first_output(module, first)
        params = dict(module.named_parameters())
        saved = {n: p.detach().clone() for n, p in params.items()}
        try:
            for name, value in scaled(chosen).items():
                params[name[len(block) + 1 :]].copy_(value)
            moved = _first_output(module, first)
        finally:
            for n, p in params.items():
                p.copy_(saved[n])
        return moved.shape == reference.shape and _close(moved, reference, _dtype_of(module))

    if not unchanged(groups):
        for group in [g for g in groups if not unchanged([g])]:
            groups.remove(group)
            handle.groups.remove(group)
            handle.skipped.append(group)
            log.warning(
                "awq: %s left out: dividing %s by its scales changes the block's output (its output is also "
                "used elsewhere, e.g. a post-norm residual, or it does not scale by its weight)",
                ", ".join(group.layers),
                group.producer,
            )
    current = dict(original)
    for group in groups:
        _apply(group, module, block, current, features)
    return current


def _dtype_of(module: nn.Module) -> torch.dtype:
    return next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float32)


class _Recorded:
    """While active: each Linear's inputs and each submodule's calls in one block's forwards."""

    def __init__(self, block: nn.Module) -> None:
        self.block = block
        named = dict(block.named_modules())
        self.gates = set(gates_in(named))
        self.moe = moe_blocks(named)
        self.claimed: set[str] = set()  # layers already a reader of some input
        self.inputs: dict[str, list[Tensor]] = {}
        self.calls: dict[str, list[tuple[tuple, dict]]] = {}
        self.readers: dict[int, list[str]] = {}  # id(input) -> Linear layers reading it (first call only)
        self.producers: dict[int, str] = {}  # id(output) -> the norm or Linear that produced it (first call)
        self._kept: list[Tensor] = []  # outputs of the first call kept alive, so their ids stay unique
        self._hooks: list[Any] = []

    def __enter__(self) -> _Recorded:
        for name, sub in self.block.named_modules():
            if not name:
                continue
            if name in self.gates or any(isinstance(m, nn.Linear) for m in sub.modules()):  # what a search may run
                self._hooks.append(sub.register_forward_pre_hook(self._called(name), with_kwargs=True))
            if isinstance(sub, nn.Linear) or is_norm(sub):
                self._hooks.append(sub.register_forward_hook(self._produced(name)))
        return self

    def __exit__(self, *exc: object) -> None:
        while self._hooks:
            self._hooks.pop().remove()

    def _called(self, name: str) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            self.calls.setdefault(name, []).append((args, kwargs))
            if not args or not isinstance(args[0], Tensor):
                return
            if isinstance(module, nn.Linear) or name in self.gates:
                self.inputs.setdefault(name, []).append(args[0].detach())
                self._read(name, args[0], [name])
            elif isinstance(module, LinearExperts):  # every expert's input layers read its input's rows
                self._read(name, args[0], expert_inputs(name, module))

        return hook

    def _read(self, name: str, tensor: Tensor, layers: list[str]) -> None:
        """``layers`` read ``tensor`` (a reshape of all of another inside a mixture-of-experts block:
        that one), where they read nothing yet: the first call tells."""
        fresh = [layer for layer in layers if layer not in self.claimed]
        if fresh:
            inside = any(name.startswith(f"{block}.") for block in self.moe)
            self.readers.setdefault(id(whole(tensor) if inside else tensor), []).extend(fresh)
            self.claimed.update(fresh)

    def _produced(self, name: str) -> Callable:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            if isinstance(output, Tensor) and name not in self.producers.values():
                self.producers[id(output)] = name
                self._kept.append(output)

        return hook


def _groups(block: str, module: nn.Module, seen: _Recorded, first: tuple[tuple, dict]) -> list[AwqGroup]:
    """The layers reading each input tensor, with what can absorb their scales."""
    named = dict(module.named_modules())
    order = list(seen.calls)
    groups = []
    for key, readers in seen.readers.items():
        producer = seen.producers.get(key)
        if producer is not None and isinstance(named[producer], nn.Linear):
            producer = None  # a Linear feeding Linear layers directly is tried as a candidate below
        if producer is None:
            producer = _linear_producer(module, named, order, readers, first)
        inspected = _common_parent(readers)
        layers = [f"{block}.{r}" for r in readers if r not in seen.gates]
        gates = [f"{block}.{r}" for r in readers if r in seen.gates]
        if layers:
            groups.append(AwqGroup(block, layers, producer, inspected, gates))
    return groups


def _linear_producer(
    module: nn.Module, named: dict[str, nn.Module], order: list[str], readers: list[str], first: tuple[tuple, dict]
) -> str | None:
    """The Linear layer before ``readers`` whose output channels can carry the scales: dividing
    them by a random scale and multiplying the readers' columns by it leaves the block's output
    as it was (to float rounding)."""
    width = named[readers[0]].weight.shape[1]
    before = order[: order.index(readers[0])]
    candidates = [n for n in reversed(before) if isinstance(named[n], nn.Linear) and named[n].out_features == width]
    if not candidates:
        return None
    reference = _first_output(module, first)
    scales = torch.empty(width).uniform_(0.5, 2.0, generator=torch.Generator().manual_seed(0))
    for candidate in candidates:
        saved = {n: p.detach().clone() for n, p in module.named_parameters()}
        try:
            _scale_rows(named[candidate], 1 / scales)
            for reader in readers:
                named[reader].weight.mul_(scales.to(named[reader].weight))
            moved = _first_output(module, first)
        finally:
            for n, p in module.named_parameters():
                p.copy_(saved[n])
        if moved.shape == reference.shape and _close(moved, reference, _dtype_of(module)):
            return candidate
    return None


def _scale_rows(layer: nn.Linear, factor: Tensor) -> None:
    layer.weight.mul_(factor.view(-1, 1).to(layer.weight))
    if layer.bias is not None:
        layer.bias.mul_(factor.to(layer.bias))


def _first_output(module: nn.Module, call: tuple[tuple, dict]) -> Tensor:
    output = module(*call[0], **call[1])
    output = output[0] if isinstance(output, (tuple, list)) else output
    return output.detach().float()


def _close(a: Tensor, b: Tensor, dtype: torch.dtype) -> bool:
    """Equal to the rounding of rescaled weights in ``dtype`` (a wrong producer moves outputs by
    far more: the scales tried span 0.5 to 2)."""
    scale = b.abs().max().clamp(min=1e-12)
    return bool(((a - b).abs().max() / scale) < max(1e-4, 8 * torch.finfo(dtype).eps))


def _common_parent(readers: list[str]) -> str:
    """The smallest module holding every reader (``""``: the block); a lone reader itself."""
    if len(readers) == 1:
        return readers[0]
    parts = [r.split(".")[:-1] for r in readers]
    common = []
    for pieces in zip(*parts):
        if len(set(pieces)) != 1:
            break
        common.append(pieces[0])
    return ".".join(common)


def _mean_abs(xs: list[Tensor]) -> Tensor:
    """llm-awq's activation statistic: mean |x| per input channel over every token."""
    return torch.cat([x.reshape(-1, x.shape[-1]) for x in xs]).abs().mean(0)


def _search(group: AwqGroup, module: nn.Module, block: str, seen: _Recorded, block_calls: list, spec: AwqSpec) -> None:
    """The ratio whose scales give the least squared error of the inspected module's output."""
    named = dict(module.named_modules())
    locals_ = [layer[len(block) + 1 :] for layer in group.layers]
    inspected = named[group.inspected] if group.inspected else module
    calls = seen.calls[group.inspected] if group.inspected else block_calls
    # every token: a router reads them all, an expert's layers only those routed to it, and one scale serves every expert
    x_mean = _mean_abs(seen.inputs[(group.gates or group.layers)[0][len(block) + 1 :]])
    reference = [_flat(inspected(*a, **k)) for a, k in calls]
    count = sum(r.numel() for r in reference)
    originals = {name: named[name].weight.detach().clone() for name in locals_}
    best = (math.inf, -1.0, None)
    try:
        for step in range(spec.n_grid):
            ratio = step / spec.n_grid
            scales = x_mean.pow(ratio).clamp(min=1e-4).view(-1)
            scales = scales / (scales.max() * scales.min()).sqrt()
            for name in locals_:
                weight = named[name].weight
                weight.copy_(round_onto(originals[name] * scales.view(1, -1), spec.weights) / scales.view(1, -1))
            loss = sum(
                (_flat(inspected(*a, **k)) - r).float().pow(2).sum().item() for (a, k), r in zip(calls, reference)
            )
            loss /= count
            if loss < best[0]:
                best = (loss, ratio, scales.clone())
    finally:
        for name in locals_:
            named[name].weight.copy_(originals[name])
    if best[2] is None:
        raise ConfigError(
            "awq.calibration", ", ".join(group.layers), "every ratio gave a non-finite error (NaN inputs?)"
        )
    group.loss, group.ratio, group.scales = best


def _flat(output: Any) -> Tensor:
    output = output[0] if isinstance(output, (tuple, list)) else output
    return output.detach()


def round_onto(weight: Tensor, spec: GridSpec) -> Tensor:
    """A Linear weight (outputs × inputs) rounded to nearest on ``spec``'s grid."""
    if spec.group_size:
        scale, zero_point = Grid(spec, per_row=True).group_qparams(weight)
        return fake_quantize_groups(weight, scale, zero_point, 0, spec)
    observer = Observer(spec, 0 if spec.per_channel else None, "awq")
    observer.observe(weight)
    scale, zero_point = observer.qparams()
    return fake_quantize(weight, scale, zero_point, 0 if spec.per_channel else None, spec)


def _apply(group: AwqGroup, module: nn.Module, block: str, current: dict, features: dict) -> None:
    """The group's scales into the values: the producer divided, the readers' columns multiplied,
    their recorded inputs divided (for the clipping search)."""
    scales = group.scales
    producer = f"{block}.{group.producer}"
    if is_norm(module.get_submodule(group.producer)):
        for attribute in ("weight", "bias"):
            if f"{producer}.{attribute}" in current:
                current[f"{producer}.{attribute}"] = current[f"{producer}.{attribute}"] / scales
    else:
        current[f"{producer}.weight"] = current[f"{producer}.weight"] / scales.view(-1, 1)
        if f"{producer}.bias" in current:
            current[f"{producer}.bias"] = current[f"{producer}.bias"] / scales
    for layer in [*group.layers, *group.gates]:
        current[f"{layer}.weight"] = current[f"{layer}.weight"] * scales.view(1, -1)
        local = layer[len(block) + 1 :]
        if local in features:  # an expert sent no token has none
            features[local] = features[local] / scales.view(1, -1)


def _clip_limits(weight: Tensor, inputs: Tensor, spec: AwqSpec) -> Tensor:
    """llm-awq's ``auto_clip_layer``: per output row and group, the ``max |w|`` (a fraction of
    the group's own) whose clipped, rounded weights give the least error on sampled inputs."""
    grid = spec.weights
    size = grid.group_size or weight.shape[1]
    tokens = inputs.reshape(1, inputs.shape[0], -1, size)
    tokens = tokens[:, 0 :: max(1, tokens.shape[1] // spec.clip_tokens)]
    shaped = weight.reshape(weight.shape[0], 1, -1, size)
    chunk = 256 if weight.shape[0] % 256 == 0 else 64 if weight.shape[0] % 64 == 0 else weight.shape[0]
    limits = []
    for start in range(0, weight.shape[0], chunk):
        w = shaped[start : start + chunk]
        top = w.abs().amax(dim=-1, keepdim=True)
        best, errors = top.clone(), torch.full_like(top, math.inf)  # llm-awq's 1e9, which float16 cannot hold
        reference = (tokens * w).sum(dim=-1)
        for step in range(int(spec.max_shrink * spec.n_grid)):
            limit = top * (1 - step / spec.n_grid)
            clipped = torch.clamp(w, -limit, limit)
            rounded = _round_groups(clipped, grid)
            error = ((tokens * rounded).sum(dim=-1) - reference).pow(2).mean(dim=1).view(errors.shape)
            better = error < errors  # kept on the device: no boolean indexing (a sync) a step
            errors, best = torch.where(better, error, errors), torch.where(better, limit, best)
        limits.append(best)
    return torch.cat(limits).squeeze(1)


def _round_groups(w: Tensor, spec: GridSpec) -> Tensor:
    """``w`` (rows, 1, groups, size) rounded with one scale per (row, group)."""
    rows = w.reshape(-1, w.shape[-1])
    per_group = GridSpec(  # a two-level grid's groups searched on their own scales (the super groups' left out)
        **{**spec.as_dict(), "group_size": None, "per_channel": True, "observer": spec.observer}
        | {"super_group": None, "scale_bits": None}
    )
    observer = Observer(per_group, 0, "awq.clip")
    observer.observe(rows)
    scale, zero_point = observer.qparams()
    return fake_quantize(rows, scale, zero_point, 0, per_group).reshape(w.shape)


def _clipped(weight: Tensor, limit: Tensor) -> Tensor:
    shaped = weight.reshape(*limit.shape[:2], -1)
    return torch.clamp(shaped, -limit, limit).reshape(weight.shape)
