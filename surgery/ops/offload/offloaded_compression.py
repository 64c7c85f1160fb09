"""Verbs on an offloaded model (:func:`surgery.offloaded`), one stage at a time.

``quantize`` and ``prune`` given an :class:`~surgery.ops.offload.offloading.Offloaded` handle trace
their stages as sequential calibration does (:mod:`surgery.core.sequential`: a block, or a
layer outside blocks, in the order they first run). For each stage:

1. its inputs are the previous block's outputs where the blocks chain, else caught by a
   forward of the model stopped at it (earlier stages already read compressed);
2. its weights are brought into memory, and the verb runs on that module alone, held in a
   skeleton under its own name (so selections and names are the model's) and fed those inputs;
3. the verb's result is baked, and the stage's weights are written to a file of the work
   folder. From then on the model reads them from there; the source files never change.

What this gives equals, bit for bit, the same verb on the model in memory, baked. Memory holds
one stage's weights (the verb's originals are read again from the files, not copied), one
layer's solver work and one block's activations; the grids stay in the stage files.
A ``work=`` folder makes the run restartable: finished stages are listed in its manifest with
the settings, a digest of the calibration, the source files' identity, the state of the model
before the verb and each stage file's sha256; a run with the same ones skips them, any other
is refused in one line (:mod:`surgery.ops.offload.offloaded_manifest`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import resource
import shutil
import tempfile
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from surgery.core import distributed
from surgery.core.activations import BlockCalls, pass_ledger
from surgery.core.allocator import give_back_freed_memory
from surgery.core.block_inputs import catch_inputs, outputs_as_next_inputs
from surgery.core.errors import AlreadyModifiedError, ConfigError, ConfigTypeError
from surgery.core.folders import LOCK, claimed
from surgery.core.handles import Handle
from surgery.core.inputs import Call, evaluating, flatten_tensors
from surgery.core.originals import Reader, read_again_from
from surgery.core.progress import tqdm
from surgery.core.safetensors_streams import write_streamed
from surgery.core.sequential import Stage, materialise, trace_stages
from surgery.ops.experts.layouts import fused_experts
from surgery.ops.experts.linear_experts import split_tensors
from surgery.ops.experts.routing import experts_modules
from surgery.ops.offload.offloaded_manifest import (
    FRESH,
    check_stage,
    checked,
    file_sha256,
    mismatch,
    stage_name,
    state_digest,
)
from surgery.ops.offload.offloading import Offloaded, WeightFiles

log = logging.getLogger("surgery")
MANIFEST = "manifest.json"
GRID = ("scale", "zero_point")  # a quantized weight's grid, beside it in its stage file
StageRun = Callable[[nn.Module, list[str], "str | None", "list[Call] | None"], Handle]
Grids = Callable[[Handle], dict[str, tuple[Tensor, Tensor, "int | None"]]]


@dataclass(frozen=True)
class OffloadedVerb:
    """A verb as :func:`compress_offloaded` runs it on each stage.

    ``run(skeleton, layers, block, calls)`` applies it to the stage's ``layers`` (qualified
    names) inside ``skeleton`` (``block``: the stage's block, None for a single layer), fed
    ``calls`` (None for a verb without calibration), and returns its handle; ``grids(handle)``
    gives each quantized weight's ``(scale, zero_point, axis)`` before the handle is baked;
    ``settings`` is what a restarted run must match. A verb that is not ``sequential``
    (SmoothQuant: statistics of the unchanged model) feeds each stage from the original weights."""

    name: str
    run: StageRun
    settings: str
    spec: Any = None  # the weights' GridSpec, for formats that hold integer grids
    grids: Grids | None = None
    sequential: bool = True  # each stage fed by the compressed stages before it (False: by the originals)


class OffloadedCompression(Handle):
    """A verb applied to an offloaded model: ``model`` computes with the compressed weights,
    read stage by stage from ``work``; ``grids`` holds each quantized weight's
    ``(scale, zero_point, axis)``. ``restore()`` reads the source files again (they never
    changed); ``surgery.export`` streams the result. ``seconds`` (per stage, run or skipped as
    done), ``blocks``, ``peak_bytes`` (the process's peak resident memory) and
    ``spilled_bytes`` (calibration activations written to disk beyond the activation budget,
    see :func:`surgery.activation_budget`) say what it cost."""

    streams = True  # export writes it tensor by tensor (see ExportFormat.stream)

    def __init__(self, source: Offloaded, verb: OffloadedVerb, work: Path) -> None:
        super().__init__(f"offloaded {verb.name}", source.model)
        self.source, self.spec, self.work = source, verb.spec, work
        self.grids = StageGrids()
        self.stages: list[Stage] = []
        self.seconds: list[float] = []
        self.resumed = 0
        self.peak_bytes = 0
        self.gpu_peak_bytes: list[int] = []  # per stage run, on a GPU (offloaded(device="cuda"))
        self.spilled_bytes = 0
        self.temporary = False
        self._before: dict[str, WeightFiles | None] = {}  # name -> where it was read from before
        self._mine: dict[str, WeightFiles] = {}  # name -> the file this verb wrote it to
        self.add("read the weights from the source files again", self._drop, lambda: None)

    @property
    def blocks(self) -> int:
        """How many stages were blocks."""
        return sum(stage.block is not None for stage in self.stages)

    def value_of(self, tensor: Tensor) -> Tensor:
        """A tensor of the model's state with the values the compressed model computes with."""
        return self.source.value_of(tensor)

    def check_undo(self) -> None:
        """Refuse, before anything changes, to undo under a later verb that rewrote the same weights."""
        super().check_undo()
        for name, files in self._mine.items():
            if self.source.overlay.get(name) is not files:
                raise AlreadyModifiedError(
                    f"{self.kind}: {name} was rewritten by a later verb on the offloaded model; restore that one first"
                )

    def _drop(self) -> None:
        """Each name read from where it was read before this verb (the source, or an earlier verb's file)."""
        for name, before in self._before.items():
            if before is None:
                self.source.overlay.pop(name, None)
            else:
                self.source.overlay[name] = before
        self._before.clear()
        self._mine.clear()
        if self.temporary:  # a work folder the caller gave keeps its stages
            shutil.rmtree(self.work, ignore_errors=True)


def compress_offloaded(
    source: Offloaded,
    verb: OffloadedVerb,
    layers: dict[str, nn.Module],
    calibration: Any,
    *,
    blocks: list[str],
    work: str | Path | None = None,
    progress: bool = True,
) -> OffloadedCompression:
    """Apply ``verb`` to ``layers`` of the offloaded model stage by stage (module docstring)."""
    model = source.model
    field_name = f"{verb.name}.calibration"
    calls = (
        None if calibration is None else materialise(calibration, field_name, model, (verb.settings, sorted(layers)))
    )
    chained: set[str] = set()
    with evaluating(model), torch.no_grad():
        if calls is None:
            stages = _stages_in_module_order(layers, blocks)
        else:
            stages = trace_stages(model, layers, blocks, calls[0], field_name, chained)
    stages = _experts_together(model, stages)
    with ExitStack() as stack:
        folder = WorkFolder(work, source, f"{verb.name}: {verb.settings}", _digest(calls), stack, len(stages))
        handle = OffloadedCompression(source, verb, folder.path)
        handle.temporary = folder.temporary
        handle.stages = stages
        try:
            with distributed.batches_shared():  # each stage's inputs come from this rank's share
                _run_stages(handle, verb, folder, stages, calls, chained & set(blocks), progress, blocks)
        except BaseException as err:
            handle.rollback(err)
            folder.abandon()
            raise
    handle.peak_bytes = peak_resident_bytes()
    return handle


def _run_stages(
    handle: OffloadedCompression,
    verb: OffloadedVerb,
    folder: WorkFolder,
    stages: list[Stage],
    calls: list[Call] | None,
    chained: set[str],
    progress: bool,
    blocks: list[str],
) -> None:
    source, model = handle.source, handle.source.model
    cache: tuple[str, BlockCalls] | None = None  # (block, its inputs per batch)
    bar = tqdm(stages, unit="stage", desc=f"{verb.name} (offloaded)", leave=False, disable=None if progress else True)
    with evaluating(model), torch.no_grad(), pass_ledger() as ledger:
        spilled_before = ledger.spilled
        for index, stage in enumerate(bar):
            where = stage_module(model, stage)
            bar.set_postfix_str(where, refresh=False)
            if folder.done(index):
                module = model.get_submodule(where)
                _adopt(handle, folder.finished(index, where, source.names_in(module), expert_shapes(module, where)))
                handle.resumed += 1
                cache = None
                continue
            started = time.perf_counter()
            if source.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(source.device)
            module = model.get_submodule(where)
            inputs = None
            if calls is not None and cache is not None and cache[0] == stage.block:
                inputs = cache[1]
            elif calls is not None:
                with source.reading_source(not verb.sequential), source.holding_outside_blocks():
                    inputs = catch_inputs(model, module, calls)
            following = _after(blocks, stage.block) if inputs is not None and stage.block in chained else None
            cache = None  # the previous block's outputs are this block's inputs now
            written, cache = _compress_stage(source, verb, folder, index, stage, module, inputs, following)
            del inputs
            _adopt(handle, written)
            handle.seconds.append(time.perf_counter() - started)
            if source.device.type == "cuda":  # the block's own peak on the GPU
                handle.gpu_peak_bytes.append(torch.cuda.max_memory_allocated(source.device))
            give_back_freed_memory()  # the stage's weights, activations and Hessians: freed, and handed back
        handle.spilled_bytes = ledger.spilled - spilled_before


def _compress_stage(
    source: Offloaded,
    verb: OffloadedVerb,
    folder: WorkFolder,
    index: int,
    stage: Stage,
    module: nn.Module,
    inputs: BlockCalls | None,
    following: str | None,
) -> tuple[StageFiles, tuple[str, BlockCalls] | None]:
    """One stage: its weights brought in, the verb applied to it alone and baked, the result
    written; returns the stage's file and the next block's inputs where they chain."""
    where = stage_module(source.model, stage)
    cache = None
    with source.resident(module) as weights, read_again_from(_reader(source, weights)):
        if not verb.sequential:  # the next block's inputs as the unchanged block gives them
            cache = _outputs_for_next(following, module, inputs)
        applied = verb.run(
            _skeleton(where, module), stage.layers, stage.block, None if inputs is None else inputs.calls()
        )
        grids = verb.grids(applied) if verb.grids is not None else {}
        # every grid of the stage's layers, those of each expert's layers and of a head tied to the
        # embeddings included (held under another name: the export must still see it quantized)
        applied.bake()
        del applied  # and with it the originals it kept (the source files hold them)
        written = folder.write(index, where, {name: p.detach() for name, p in weights.items()}, grids)
        if verb.sequential:
            cache = _outputs_for_next(following, module, inputs)
    return written, cache


def _reader(source: Offloaded, weights: dict[str, nn.Parameter]) -> Reader:
    """The verb keeps no copy of the stage's weights for its undo: it reads them again from the
    files the model read them from (one layer's bytes less at the peak)."""
    names = {id(param): name for name, param in weights.items()}

    def read_again(param: Tensor) -> Callable[[], Tensor] | None:
        name = names.get(id(param))
        if name is None:
            return None
        files = source.overlay.get(name, source.files)  # where it was read from, before this verb
        return lambda: files.load(name)

    return read_again


def stage_layers(model: nn.Module, names: list[str] | dict[str, Any]) -> dict[str, nn.Module]:
    """Each layer a verb selected (with :func:`~surgery.ops.experts.linearizing.linearized`: each
    expert's own layers) by the module of the offloaded model that runs it: the layer, or for a
    layer of an expert, its fused experts module (a verb makes it per-expert layers in its stage)."""
    experts = experts_modules(model)
    return {name: model.get_submodule(_owner(name, experts)) for name in names}


def stage_module(model: nn.Module, stage: Stage) -> str:
    """The module a stage brings in and runs the verb on: its block, or its layer's module."""
    return stage.block or _owner(stage.layers[0], experts_modules(model))


def expert_shapes(module: nn.Module, where: str) -> dict[str, tuple[int, ...]]:
    """The weight shape of each expert's layer of the fused experts modules in ``module`` (named
    ``where``), by the layer's qualified name (``...experts.3.gate_proj.weight``)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for name, layout in fused_experts(module).items():
        fused = module.get_submodule(name)
        params = [layout.up_name, "down_proj"] + ([f"{layout.up_name}_bias", "down_proj_bias"] if layout.bias else [])
        tensors = {param: torch.empty(getattr(fused, param).shape, device="meta") for param in params}
        owner = ".".join(part for part in (where, name) if part)
        shapes |= {f"{owner}.{key}": tuple(value.shape) for key, value in split_tensors(layout, tensors).items()}
    return shapes


def _owner(name: str, experts: list[str]) -> str:
    """``name``, or the fused experts module whose per-expert layer it is."""
    return next((module for module in experts if name.startswith(module + ".")), name)


def _experts_together(model: nn.Module, stages: list[Stage]) -> list[Stage]:
    """The layers of the experts of one experts module outside blocks made one stage, as one module."""
    merged: list[Stage] = []
    for stage in stages:
        alone = merged and stage.block is None and merged[-1].block is None
        if alone and stage_module(model, stage) == stage_module(model, merged[-1]) != stage.layers[0]:
            merged[-1].layers.extend(stage.layers)
        else:
            merged.append(stage)
    return merged


def _outputs_for_next(
    following: str | None, block: nn.Module, inputs: BlockCalls | None
) -> tuple[str, BlockCalls] | None:
    """The block's outputs as the following block's inputs (where the two chain)."""
    if following is None or inputs is None:
        return None
    outputs = outputs_as_next_inputs(block, inputs)
    return None if outputs is None else (following, outputs)


def _after(blocks: list[str], block: str | None) -> str | None:
    index = blocks.index(block) if block in blocks else -1
    return blocks[index + 1] if 0 <= index < len(blocks) - 1 else None


def _adopt(handle: OffloadedCompression, finished: StageFiles) -> None:
    """The model reads the stage's tensors from its file from now on."""
    for name in finished.names:
        handle._before.setdefault(name, handle.source.overlay.get(name))
        handle.source.overlay[name] = handle._mine[name] = finished.files
    handle.grids.add(finished)


class _Skeleton(nn.Module):
    """A module holding one part of a model under the same qualified name, whose forward is
    that part's: a verb run on it names, selects and stages the part as in the whole model."""

    def __init__(self, path: str, part: nn.Module) -> None:
        super().__init__()
        self._path = path
        parent: nn.Module = self
        *ancestors, leaf = path.split(".")
        for name in ancestors:
            child = nn.Module()
            parent.add_module(name, child)
            parent = child
        parent.add_module(leaf, part)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.get_submodule(self._path)(*args, **kwargs)


def _skeleton(path: str, part: nn.Module) -> nn.Module:
    return _Skeleton(path, part).eval()


def _stages_in_module_order(layers: dict[str, nn.Module], blocks: list[str]) -> list[Stage]:
    """Stages of a verb without calibration: each block's layers together, other layers alone."""
    stages: list[Stage] = []
    for name in layers:
        block = next((b for b in blocks if name.startswith(b + ".")), None)
        if block is not None and stages and stages[-1].block == block:
            stages[-1].layers.append(name)
        else:
            stages.append(Stage([name], block))
    return stages


@dataclass
class StageFiles:
    """A finished stage: its file (read as the model runs), the names it holds, and the axis of
    each quantized weight's grid (whose scales and zero points its file holds beside it)."""

    files: WeightFiles
    names: list[str]
    axes: dict[str, int | None] = field(default_factory=dict)


class StageGrids(Mapping[str, tuple[Tensor, Tensor, "int | None"]]):
    """Each quantized weight's ``(scale, zero_point, axis)``, read from its stage's file when
    asked for: memory holds none of them, so the peak does not grow with depth (a grid is a
    64th of its weight's bytes at groups of 128)."""

    def __init__(self) -> None:
        self._where: dict[str, tuple[WeightFiles, int | None]] = {}

    def add(self, finished: StageFiles) -> None:
        self._where.update({key: (finished.files, axis) for key, axis in finished.axes.items()})

    def __getitem__(self, key: str) -> tuple[Tensor, Tensor, int | None]:
        files, axis = self._where[key]
        return files.load(f"{key}::scale"), files.load(f"{key}::zero_point"), axis

    def __contains__(self, key: object) -> bool:
        return key in self._where

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


class WorkFolder:
    """Where finished stages are written: a temporary folder removed with the source handle,
    or the caller's ``work`` folder, kept (claimed while the run writes), whose manifest lets
    a run with the same settings, calibration, source files and state of the model before the
    verb start again after the last finished stage (see :mod:`surgery.ops.offload.offloaded_manifest`)."""

    def __init__(
        self, work: str | Path | None, source: Offloaded, settings: str, digest: str, stack: ExitStack, stages: int
    ):
        self.temporary, self.stages = work is None, stages
        self.expected: dict[str, Any] = {
            "settings": settings,
            "calibration": digest,
            "source": source.files.identity(),
            "before": state_digest(source.overlay),
            "stages": {},
        }
        if work is None:
            self.path = Path(tempfile.mkdtemp(prefix="surgery-offloaded-"))
            weakref.finalize(source, shutil.rmtree, self.path, ignore_errors=True)  # the model reads it
            self.manifest: dict[str, Any] = self._fresh()
            return
        if not isinstance(work, (str, Path)):
            raise ConfigTypeError("work", work, "must be a folder path (or None for a temporary folder)")
        rank, size = distributed.world()
        work = Path(work) / f"rank-{rank}" if size > 1 else Path(work)  # each process calibrating together its own
        if work.exists() and not work.is_dir():
            raise ConfigError("work", str(work), "is a file; give a folder (empty or new) for the finished stages")
        try:
            self.path = stack.enter_context(claimed(work))
        except OSError as err:  # read-only, or a parent that is a file
            raise ConfigError("work", str(work), f"cannot be used ({err.strerror or err})") from None
        self.manifest = self._read()

    def _fresh(self) -> dict[str, Any]:
        return {**self.expected, "stages": {}}

    def _read(self) -> dict[str, Any]:
        file = self.path / MANIFEST
        if not file.exists():
            if any(p.name != LOCK for p in self.path.iterdir()):
                raise ConfigError("work", str(self.path), "is a folder of other files; give an empty or new folder")
            return self._fresh()
        try:
            found = json.loads(file.read_text(encoding="utf-8"))
        except (OSError, ValueError, RecursionError) as err:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
            raise ConfigError("work", str(file), f"cannot be read as JSON ({type(err).__name__}); {FRESH}") from None
        manifest = checked(found, file, self.stages)
        different = mismatch(manifest, self.expected)
        if different is not None:
            raise ConfigError("work", str(self.path), f"{different}; {FRESH}")
        log.info("offloaded: %d finished stage(s) found in %s", len(manifest["stages"]), self.path)
        return manifest

    def done(self, index: int) -> bool:
        return str(index) in self.manifest["stages"]

    def finished(self, index: int, where: str, names: list[str], shapes: dict[str, tuple[int, ...]]) -> StageFiles:
        """Finished stage ``index`` (of module ``where``, weights ``names``; ``shapes``: those of its
        experts' layers, whose grids it holds too), checked to be it."""
        entry = self.manifest["stages"][str(index)]
        path = self.path / stage_name(index)
        check_stage(entry, path, where, names)
        try:
            files = WeightFiles([path], digest=entry["sha256"])
        except ConfigError as err:  # a stage file cut or removed since the manifest listed it
            raise ConfigError(
                "work", str(path), f"is a finished stage the manifest lists, but {err.allowed}; {FRESH}"
            ) from None
        expected = {*names, *(f"{key}::{part}" for key in entry["grids"] for part in GRID)}
        if set(files.names()) != expected:
            other = sorted(set(files.names()) ^ expected)[0]
            raise ConfigError("work", str(path), f"does not hold the stage's tensors as listed ({other}); {FRESH}")
        for key, axis in entry["grids"].items():
            shape = files.describe(key)[0] if key in names else shapes.get(key)
            if shape is None or not _grid_fits(shape, files.load(f"{key}::scale"), axis):
                raise ConfigError(
                    "work", str(path), f"lists axis {axis!r} for {key}, which its scales do not fit; {FRESH}"
                )
        return StageFiles(files, entry["names"], dict(entry["grids"]))

    def write(
        self, index: int, where: str, tensors: dict[str, Tensor], grids: dict[str, tuple[Tensor, Tensor, int | None]]
    ) -> StageFiles:
        """Write a stage's tensors (each file whole, then renamed into place; the manifest last)."""
        name = stage_name(index)
        grids = {
            key: (scale.detach().cpu(), zero_point.detach().cpu(), axis)
            for key, (scale, zero_point, axis) in grids.items()
        }
        state = {key: value.detach().cpu().contiguous() for key, value in tensors.items()}  # from the GPU, if there
        for key, (scale, zero_point, _axis) in grids.items():
            state[f"{key}::scale"] = scale.contiguous()
            state[f"{key}::zero_point"] = zero_point.contiguous()
        part = self.path / f".{name}.part"
        entries = [(key, tuple(value.shape), value.dtype) for key, value in state.items()]
        try:
            write_streamed(part, entries, state.__getitem__, metadata={"stage": where})  # no copy of the whole stage
            digest = file_sha256(part)
            os.replace(part, self.path / name)
        except OSError as err:  # a full disk, a folder made read-only
            part.unlink(missing_ok=True)
            raise ConfigError("work", str(self.path), f"cannot hold stage {index} ({err.strerror or err})") from None
        self.manifest["stages"][str(index)] = {
            "file": name,
            "module": where,
            "names": sorted(tensors),
            "grids": {key: axis for key, (_s, _z, axis) in grids.items()},
            "sha256": digest,
        }
        self._save_manifest()
        axes = {key: axis for key, (_s, _z, axis) in grids.items()}
        return StageFiles(WeightFiles([self.path / name], digest=digest), sorted(tensors), axes)

    def _save_manifest(self) -> None:
        part = self.path / f".{MANIFEST}.part"
        part.write_text(json.dumps(self.manifest, indent=1, sort_keys=True))
        os.replace(part, self.path / MANIFEST)

    def abandon(self) -> None:
        """After an error: a temporary folder goes; the caller's keeps its finished stages."""
        if self.temporary:
            shutil.rmtree(self.path, ignore_errors=True)


def _digest(calls: list[Call] | None) -> str:
    """A digest of the calibration batches' tensors (a restarted run must be given the same)."""
    if calls is None:
        return "none"
    digest = hashlib.sha256()
    for call in calls:
        for tensor in flatten_tensors([list(call.args), dict(call.kwargs)], floating_only=False):
            digest.update(str((tuple(tensor.shape), tensor.dtype)).encode())
            digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def peak_resident_bytes() -> int:
    """The process's peak resident memory so far (``VmHWM``; ``ru_maxrss`` where there is no /proc)."""
    return _status("VmHWM") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def resident_bytes() -> int:
    """The process's resident memory now (``VmRSS``; 0 where there is no /proc)."""
    return _status("VmRSS")


def _status(field: str) -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _grid_fits(shape: tuple[int, ...], scale: Tensor, axis: Any) -> bool:
    """Whether a weight of ``shape`` has one scale (``axis`` None) or one per index of ``axis``."""
    if axis is None:
        return scale.numel() == 1
    return type(axis) is int and 0 <= axis < len(shape) and scale.dim() >= 1 and scale.shape[0] == shape[axis]
