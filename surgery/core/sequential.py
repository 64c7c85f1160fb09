"""Sequential calibration: compress layer by layer, each fed by the compressed layers before it.

Second-order methods (SparseGPT, GPTQ) solve each layer against the inputs it receives, and
Wanda scores each layer by them; as in the papers, those inputs come from a model whose
earlier layers are already compressed. The
selected layers are taken in the order they first run and grouped into *stages*:

- the layers inside one *block* (a transformer's decoder layer: an entry of the longest run of
  same-class modules in an ``nn.ModuleList``/``nn.Sequential``, found automatically, or the
  modules ``blocks=`` selects) form one stage. The block's inputs (positional and keyword,
  e.g. attention masks; a key/value cache is dropped) are caught by a forward stopped at the
  block; the block then runs alone on them, and its outputs become the next block's inputs
  where the tracing forward on the first batch saw that they are what the next block receives
  (otherwise its inputs are caught again). That check is one forward for all blocks: the work
  grows linearly with depth. Peak memory holds one block's inputs and outputs
  for the calibration batches, not the model's activations. A block called other than once
  per forward is not treated as one;
- any other layer is a stage of its own, fed by full forwards of the model.

After each stage the caller's ``solve`` returns new values for its weights; they are written
in (so later stages see them), each weight's original values kept once in an
:class:`~surgery.core.originals.Originals` store. Without a store from the caller they are put
back at the end; with one, the new values stay and the caller attaches them as guarded
transforms whose undo records are the store's. On any error they are put back.

Within :func:`onloading`, each block's stage runs on another device (a GPU): the block is moved
there for its stage (its inputs with it) and back after, so a model held in CPU memory is
compressed block by block at the GPU's speed, the GPU holding one block.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from surgery.core import distributed
from surgery.core.activations import BlockCalls, SpilledCall, pass_ledger
from surgery.core.allocator import give_back_freed_memory
from surgery.core.block_inputs import (
    ONLOAD_DEVICE,
    catch_inputs,
    next_inputs,
    outputs_as_next_inputs,
    same_call,
    without_cache_values,
)
from surgery.core.capture import Capture, Keep, ReducerFactory
from surgery.core.errors import ConfigError, NoCalibrationInputError
from surgery.core.inputs import (
    Call,
    batches,
    check_batch_finite,
    device_of,
    evaluating,
    inputs_to,
    moved,
    present_device,
)
from surgery.core.originals import Originals
from surgery.core.progress import tqdm
from surgery.core.routing import routed_as
from surgery.core.selection import Selection, select

log = logging.getLogger("surgery")
Solve = Callable[[dict[str, Any]], Mapping[str, Tensor]]  # {layer: its reduced inputs} -> {param name: new value}
# (layer, module, its inputs in the model before compression, its inputs here) -> its reduced inputs
Paired = Callable[[str, nn.Module, list[Tensor], list[Tensor]], Any]


@dataclass
class Stage:
    """Layers solved together: one block's, or a single layer outside blocks."""

    layers: list[str]
    block: str | None = None


@dataclass
class StageInputs:
    """What ``solve`` receives when :func:`run_sequential` is given no reducer: the module the
    stage runs (its block, or its one layer), that module's calls, and the block whose outputs
    those calls are (``None``: they were caught by forwards of the model)."""

    module: nn.Module
    calls: BlockCalls
    follows: str | None = None


@dataclass
class SequentialReport:
    """What a sequential pass did: its stages, and the most bytes of cached block inputs and
    outputs held at once (the pass's activation memory)."""

    stages: list[Stage] = field(default_factory=list)
    peak_cached_bytes: int = 0  # in memory; beyond the activation budget they went to disk
    spilled_bytes: int = 0  # cached activations written to disk (see :mod:`surgery.core.activations`)
    blocks: list[str] = field(default_factory=list)
    chained: set[str] = field(default_factory=set)  # blocks whose output is the next block's input
    gpu_peak_bytes: list[int] = field(default_factory=list)  # onloaded to a GPU: each block's peak there
    unrouted: list[str] = field(default_factory=list)  # layers no calibration input reached, solved without one


UNROUTED = "unrouted"  # a layer's statistics when no calibration input reached it and the caller allowed that
UNROUTED_POLICIES = ("refuse", "rtn")  # a layer no calibration input reaches: refused, or solved without statistics


def find_blocks(model: nn.Module, at_least: int = 2) -> list[str]:
    """Names of the repeated blocks of a model: the entries of the ``nn.ModuleList`` or
    ``nn.Sequential`` holding the most parameters in a run of ``at_least`` or more same-class
    children that hold parameters themselves (a transformer's decoder layers), never a list that
    is called as a layer itself; ``[]`` if none. ``at_least=1`` also finds the one block of a
    one-layer decoder (whose list is otherwise indistinguishable from a wrapper)."""
    best: tuple[int, list[str]] = (0, [])
    for name, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)) or len(module) < at_least:
            continue
        if isinstance(module, nn.ModuleList) and type(module).forward is not nn.ModuleList.forward:
            continue  # a list that is itself a layer (a mixture-of-experts layer's experts): its entries are not blocks
        children = list(module.named_children())
        kinds = {type(child) for _, child in children}
        if len(kinds) != 1 or not any(True for _ in children[0][1].children()):
            continue  # mixed classes, or leaf layers (a Sequential of convolutions is not a list of blocks)
        size = sum(p.numel() for _, child in children for p in child.parameters())
        if size > best[0]:
            best = (size, [f"{name}.{child}" if name else child for child, _ in children])
    return best[1]


def resolve_blocks(model: nn.Module, blocks: Selection | bool | None, field: str = "blocks") -> list[str]:
    """``None``/``True``: :func:`find_blocks`; ``False``: none (every layer its own stage);
    otherwise the modules the selection names, in model order."""
    if blocks is None or blocks is True:
        return find_blocks(model)
    if blocks is False:
        return []
    return list(select(model, blocks, field=field))


def materialise(calibration: Any, field_name: str, model: nn.Module | None = None, settings: Any = None) -> list[Call]:
    """Calibration batches as a list of calls (a sequential pass reads them many times); inside
    :func:`~surgery.core.distributed.distributed_calibration`, this process's share of them, once
    every process is seen to hold the same ``model`` and verb ``settings``. A batch refused on one
    process is refused on every process (none is left waiting for it)."""
    try:
        device = device_of(model) if model is not None else None
        calls = [
            call if device is None or isinstance(call, SpilledCall) else moved(call, device)
            for call in batches(calibration, field_name)
        ]
        if not calls:
            raise ConfigError(field_name, "0 batches", "must hold at least one batch")
        for index, call in enumerate(calls):
            if not isinstance(call, SpilledCall):  # made by the model's blocks from batches checked here
                check_batch_finite(call, index, field_name)
    except ConfigError as err:
        if not distributed.sharing_batches():
            raise
        distributed.share([], field_name, model, settings, refused=err)  # raises on every rank
    return distributed.share(calls, field_name, model, settings)  # this process's share, across processes


def trace_stages(
    model: nn.Module,
    layers: dict[str, nn.Module],
    block_names: list[str],
    first: Call,
    field: str = "calibration",
    chained: set[str] | None = None,
) -> list[Stage]:
    """The stages, in the order the layers first run on the batch ``first``; ``chained`` gets
    the blocks whose output (in place of the hidden states) is what the next block received."""
    order: list[str] = []
    calls = {name: 0 for name in block_names}
    hooks = []
    watch = _ChainWatch(block_names, chained if chained is not None else set())

    def seen(name: str) -> Callable:
        def hook(module: nn.Module, args: tuple) -> None:
            if name not in order:
                order.append(name)

        return hook

    def called(name: str) -> Callable:
        def hook(module: nn.Module, args: tuple) -> None:
            calls[name] += 1

        return hook

    try:
        for name, module in layers.items():
            hooks.append(module.register_forward_pre_hook(seen(name)))
        for name in block_names:
            block = model.get_submodule(name)
            hooks.append(block.register_forward_pre_hook(called(name)))
            hooks.append(block.register_forward_pre_hook(watch.receives(name), with_kwargs=True))
            hooks.append(block.register_forward_hook(watch.finished(name), with_kwargs=True))
        try:
            with routed_as("trace"):  # every expert of a mixture-of-experts layer runs, whatever the router says
                first(model)
        except (RuntimeError, TypeError) as err:
            _explain_dtype(model, first, err, field)
            raise
    finally:
        for hook in reversed(hooks):
            hook.remove()
    missing = [name for name in layers if name not in order]
    if missing:
        raise ConfigError(
            "calibration",
            missing[0],
            "this layer never ran on the calibration batches",
            "give batches that run through it, or exclude it",
        )
    once = [name for name in block_names if calls[name] == 1]  # a block run twice (shared weights) is no block
    watch.chained.intersection_update(once)
    stages: list[Stage] = []
    for name in order:
        block = next((b for b in once if name == b or name.startswith(b + ".")), None)
        if block is not None and stages and stages[-1].block == block:
            stages[-1].layers.append(name)
        else:
            stages.append(Stage([name], block))
    return stages


class _ChainWatch:
    """Hooks of trace_stages' forward that find, for every block at once, whether the next block
    receives its output in place of its hidden states (the other inputs shared)."""

    def __init__(self, block_names: list[str], chained: set[str]) -> None:
        self.block_names, self.chained = block_names, chained
        self.predicted: dict[str, tuple[tuple, dict] | None] = {}  # block -> the next block's predicted call

    def finished(self, name: str) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            self.predicted[name] = next_inputs(output, *without_cache_values(args, kwargs))

        return hook

    def receives(self, name: str) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            index = self.block_names.index(name)
            before = self.block_names[index - 1] if index else None
            guess = self.predicted.pop(before, None) if before is not None else None
            if guess is not None and same_call(without_cache_values(args, kwargs), guess):
                self.chained.add(before)

        return hook


def _explain_dtype(model: nn.Module, first: Call, err: BaseException, field: str) -> None:
    """A forward that failed on batches of another floating dtype than the model's weights is
    that mismatch (float16 calibration on a float32 model), said in one line."""
    weights = {p.dtype for p in model.parameters() if p.is_floating_point()}
    given = {t.dtype for t in first.tensors()}
    if len(weights) == 1 and given and given != weights:
        raise ConfigError(
            field,
            "batch 0",
            f"holds {', '.join(sorted(map(str, given)))} tensors and the "
            f"model's weights are {next(iter(weights))}; give batches of the model's dtype "
            f"({type(err).__name__}: {' '.join(str(err).split())[:100]})",
        ) from None


@contextlib.contextmanager
def onloading(device: str | torch.device | None, field: str = "onload") -> Iterator[None]:
    """Within the block, each block's stage of sequential calibration runs on ``device`` (None:
    where the block is): the block moved there for its stage, its inputs moved to it, and moved
    back after (also on an error). A device this machine lacks is refused, naming ``field``."""
    if device is None:
        yield
        return
    token = ONLOAD_DEVICE.set(present_device(device, field))
    try:
        yield
    finally:
        ONLOAD_DEVICE.reset(token)


@contextlib.contextmanager
def _onloaded(block: nn.Module | None) -> Iterator[torch.device | None]:
    """The block on the onload device for the stage (see :func:`onloading`), then back where it
    was; yields that device (None: nothing onloaded)."""
    device = ONLOAD_DEVICE.get()
    if device is None or block is None:
        yield None
        return
    home = device_of(block)
    block.to(device)
    to_device = block.register_forward_pre_hook(inputs_to(device), with_kwargs=True)
    try:
        yield device
    finally:
        to_device.remove()
        block.to(home)


def run_sequential(
    model: nn.Module,
    layers: dict[str, nn.Module],
    calibration: Any,
    solve: Solve,
    *,
    params: Callable[[str], tuple[str, nn.Parameter]],
    reduce: ReducerFactory | None,
    blocks: Selection | bool | None = None,
    field: str = "calibration",
    progress: bool = True,
    originals: Originals | None = None,
    settings: Any = None,
    paired: Paired | None = None,
    unrouted: str = "refuse",
) -> SequentialReport:
    """Solve ``layers`` stage by stage on ``calibration`` (see the module docstring).

    ``solve`` receives each stage layer's inputs reduced by ``reduce`` (given by the caller, as
    core knows no method: GPTQ and SparseGPT pass
    :class:`surgery.ops.second_order.hessians.HessianReducer`, ``{"hessian", "rows"}``; Wanda
    per-feature squared norms); with ``reduce=None`` it receives the stage's
    :class:`StageInputs` instead, to run the block itself (AutoRound). ``params(layer)`` names
    the parameter ``solve``'s values replace for that layer (``(qualified name, parameter)``).
    Every parameter written is put back as it was before returning, unless the caller passes
    the ``originals`` store to keep them in (then the new values stay); always on an error.
    ``settings`` (the verb's spec) must be the same on every process calibrating together.
    With ``paired``, each stage's layers are also run as the model was before any compression
    (a float stream beside the compressed one, block to block) and ``paired`` reduces each
    layer's two lists of inputs instead of ``reduce`` (GPTAQ). A layer no calibration input
    reached (an expert its router never chose) is refused in one line; with ``unrouted="rtn"``
    ``solve`` receives :data:`UNROUTED` as its statistics instead, and the report lists it.
    """
    if unrouted == "rtn" and distributed.world()[1] > 1:
        raise ConfigError(
            field.split(".")[0] + ".unrouted",
            "rtn",
            "decides a layer has no input from one process's tokens, and processes calibrating together "
            "must agree: use unrouted='refuse', or with surgery.every_expert_calibrated(): ...",
        )
    calls = materialise(calibration, field, model, (settings, sorted(layers)))
    report = SequentialReport(blocks=resolve_blocks(model, blocks, field.split(".")[0] + ".blocks"))
    onload = ONLOAD_DEVICE.get()
    if onload is not None and not report.blocks:  # nothing would move: say so rather than run on the CPU
        raise ConfigError(
            field.split(".")[0] + ".onload",
            str(onload),
            "moves each repeated block to the device for its stage, and this run has none "
            "(blocks=False, or a model without repeated blocks): name them with blocks=, or drop onload",
        )
    keep = originals is not None
    store = originals if originals is not None else Originals()
    try:
        with evaluating(model), torch.no_grad(), pass_ledger() as ledger:
            spilled_before = ledger.spilled
            report.stages = trace_stages(model, layers, report.blocks, calls[0], field, report.chained)
            cache: tuple[str, BlockCalls] | None = None  # (block, its inputs per batch)
            floats = None if paired is None else _FloatStream(model, calls, store, report, paired)
            previous: str | None = None  # the block of the stage before
            for stage in tqdm(
                report.stages, unit="stage", desc="compressing", leave=False, disable=None if progress else True
            ):
                stage_layers = {name: layers[name] for name in stage.layers}
                if stage.block is None and reduce is not None:
                    block = None  # a layer outside blocks: full forwards of the model
                else:
                    block = model.get_submodule(stage.block) if stage.block else stage_layers[stage.layers[0]]
                with _onloaded(block) as onload:
                    if onload is not None and onload.type == "cuda":
                        torch.cuda.reset_peak_memory_stats(onload)
                    if block is None:
                        cache, inputs = None, None
                        run = lambda calls=calls: [call(model) for call in calls]  # noqa: E731
                    else:
                        follows = previous if cache is not None and cache[0] == stage.block else None
                        inputs = cache[1] if follows is not None else catch_inputs(model, block, calls)
                        run = lambda block=block, inputs=inputs: run_each(block, inputs)  # noqa: E731
                    if reduce is None:
                        reduced = StageInputs(block, inputs, follows)
                    elif floats is None:
                        reduced = _reduced(model, stage_layers, reduce, run, unrouted, report)
                    else:
                        reduced = floats.reduced(stage, stage_layers, block, inputs, run, unrouted)
                    _write(solve(reduced), stage, params, store)
                    del reduced
                    previous = stage.block
                    cache = None if stage.block is None else _outputs_for_next(report, stage.block, block, inputs)
                    if stage.block is not None or reduce is None:
                        del inputs
                    if onload is not None and onload.type == "cuda":
                        report.gpu_peak_bytes.append(torch.cuda.max_memory_allocated(onload))
                give_back_freed_memory()  # the stage's Hessians and activations: freed, and handed back
            report.peak_cached_bytes, report.spilled_bytes = ledger.peak_held, ledger.spilled - spilled_before
            if report.spilled_bytes:
                log.info(
                    "calibration: %.0f MB of block activations went to disk (%.0f MB were allowed in memory)",
                    report.spilled_bytes / 1e6,
                    ledger.limit / 1e6,
                )
    except BaseException:
        store.put_back()
        raise
    if not keep:
        store.put_back()
    return report


def run_each(block: nn.Module, inputs: BlockCalls) -> None:
    """Run the block on each cached call, keeping none of its outputs (their memory handed back)."""
    for args, kwargs in inputs:
        block(*args, **kwargs)
        give_back_freed_memory()


def _reduced(
    model: nn.Module,
    layers: dict[str, nn.Module],
    reduce: ReducerFactory,
    run: Callable[[], Any],
    unrouted: str,
    report: SequentialReport,
) -> dict[str, Any]:
    with Capture(model, layers, ("inputs",), reduce) as seen:
        run()
    return _every_layer_ran(seen.inputs, layers, unrouted, report)


class _FloatStream:
    """The inputs each stage's layers receive in the model as it was before compression, carried
    block to block beside the compressed stream (GPTAQ calibrates against both)."""

    def __init__(
        self, model: nn.Module, calls: list, store: Originals, report: SequentialReport, paired: Paired
    ) -> None:
        self.model, self.calls, self.store, self.report, self.paired = model, calls, store, report, paired
        self.cache: tuple[str, BlockCalls] | None = None  # (block, its float inputs per batch)

    def reduced(
        self,
        stage: Stage,
        layers: dict[str, nn.Module],
        block: nn.Module | None,
        inputs: Any,
        run: Callable[[], Any],
        unrouted: str = "refuse",
    ) -> dict[str, Any]:
        """Each layer's two input lists reduced by ``paired``: the float model's, then this model's."""
        with Capture(self.model, layers, ("inputs",), Keep) as seen:
            following = self._run(stage, block, inputs)
        floats = seen.inputs
        with Capture(self.model, layers, ("inputs",), Keep) as seen:
            run()
        found = _every_layer_ran(seen.inputs, layers, unrouted, self.report)
        self.cache = following
        return {
            name: UNROUTED
            if found[name] is UNROUTED
            else self.paired(name, module, floats.get(name) or [], found[name])
            for name, module in layers.items()
        }

    def _run(self, stage: Stage, block: nn.Module | None, inputs: Any) -> tuple[str, BlockCalls] | None:
        """Run the stage as the float model would; the next block's float inputs where they chain."""
        if block is None:
            with self.store.originals_in():
                for call in self.calls:
                    call(self.model)
            return None
        if self.cache is not None and self.cache[0] == stage.block:
            floats = self.cache[1]
        elif len(self.store):  # layers before it are compressed: catch what the float model gives it
            with self.store.originals_in():
                floats = catch_inputs(self.model, block, self.calls)
        else:
            floats = inputs
        following = _following(self.report.blocks, stage.block)
        if following is None or stage.block not in self.report.chained:
            run_each(block, floats)
            return None
        outputs = outputs_as_next_inputs(block, floats)
        return None if outputs is None else (following, outputs)


def _every_layer_ran(
    found: dict[str, Any],
    layers: dict[str, nn.Module],
    unrouted: str = "refuse",
    report: SequentialReport | None = None,
) -> dict[str, Any]:
    for name in layers:
        if found.get(name) is None and unrouted == "rtn":
            found[name] = UNROUTED
            if report is not None:
                report.unrouted.append(name)
        elif found.get(name) is None:
            raise NoCalibrationInputError(
                "calibration",
                name,
                "this layer received no floating-point input during calibration",
                "give batches that run through it, or exclude it",
            )
    return found


def _following(blocks: list[str], block: str) -> str | None:
    index = blocks.index(block)
    return blocks[index + 1] if index + 1 < len(blocks) else None


def _write(
    values: Mapping[str, Tensor],
    stage: Stage,
    params: Callable[[str], tuple[str, nn.Parameter]],
    originals: Originals,
) -> None:
    for layer in stage.layers:  # each value asked for once, written at once (a solver may solve it only now)
        name, param = params(layer)
        if name not in values:  # not .get(): a KeyError raised while solving must not read as "no value"
            continue
        value = values[name]
        if value is None:
            continue
        originals.keep(name, param)
        param.copy_(value.to(param.dtype))
        del value


def _outputs_for_next(
    report: SequentialReport, name: str, block: nn.Module, inputs: BlockCalls
) -> tuple[str, BlockCalls] | None:
    """The (pruned) block's outputs as the following block's inputs, if the two chain."""
    following = _following(report.blocks, name)
    if following is None or name not in report.chained:
        return None
    outputs = outputs_as_next_inputs(block, inputs)
    return None if outputs is None else (following, outputs)
