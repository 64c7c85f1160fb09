"""``surgery.quantize``: fake quantization of weights (in place, guarded) and activations (hooks)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from torch import Tensor, nn

from surgery.core import guards
from surgery.core._compat import BATCH_NORMS
from surgery.core.errors import ConfigError
from surgery.core.inputs import batches
from surgery.core.sequential import find_blocks, onloading, resolve_blocks
from surgery.core.transforms import own_step_hook
from surgery.core.verbs import VerbCall, verb
from surgery.ops.equivalence.folding import fold_batchnorms
from surgery.ops.experts.linearizing import linearized, with_linear_experts
from surgery.ops.offload.offloaded_compression import (
    OffloadedCompression,
    OffloadedVerb,
    compress_offloaded,
    stage_layers,
)
from surgery.ops.offload.offloading import Offloaded
from surgery.ops.quantization.attaching import (
    _attach_activations,
    _attach_shadow_weights,
    _attach_sites,
    _attach_weights,
    _sites_of,
    _target_selection,
    quantize_targets,
)
from surgery.ops.quantization.qparams import QuantizeHandle, _calibrate_or_load, load_qparams
from surgery.ops.quantization.quantizers import (
    ActivationQuantizer,
    ObserverSchedule,
    PerCallQuantizer,
    WeightQuantizer,
    activation_key,
    activation_sides,
    learned_ranges,
)
from surgery.ops.quantization.spec import DEFAULT_WEIGHTS, WHERE, QuantizeSpec, _validate_inputs
from surgery.ops.quantization.targets import deploy_target

__all__ = [  # the verb, and the names this module held before it was split (their import path kept)
    "DEFAULT_WEIGHTS",
    "WHERE",
    "ActivationQuantizer",
    "ObserverSchedule",
    "PerCallQuantizer",
    "QuantizeHandle",
    "QuantizeSpec",
    "WeightQuantizer",
    "activation_key",
    "activation_sides",
    "learned_ranges",
    "load_qparams",
    "quantize",
    "quantize_targets",
]


@verb(
    "quantize",
    QuantizeSpec,
    offloaded=lambda source, spec, call: _quantize_offloaded(source, spec, call),
    extras={"qparams": None},
    experts=with_linear_experts,
)
def quantize(model: nn.Module, spec: QuantizeSpec, call: VerbCall) -> QuantizeHandle | OffloadedCompression:
    """Fake-quantize the weights and/or activations of the selected layers.

    Args:
        model: the model to modify in place; or an offloaded model's handle
            (:func:`surgery.offloaded`), quantized block by block without loading it whole:
            weights only, the result an :class:`OffloadedCompression` that ``surgery.export``
            streams and whose ``restore()`` reads the untouched source files again.
        spec: a :class:`QuantizeSpec` holding the settings under *Keywords* below (those
            keywords are a shorthand for it; a spec and keywords that differ from its defaults
            are refused together).
        calibration: batches (tensors, tuples of inputs or dicts of keyword inputs) run
            through the model, with a progress bar, to estimate activation ranges (required
            for activations unless ``qparams``, a dict or a file from
            :meth:`QuantizeHandle.save_qparams`, is given) and, for ``method="gptq"``,
            each layer's input Hessian, layer after layer on the already quantized model.
        qparams: saved activation parameters (a dict, or a file written by
            :meth:`QuantizeHandle.save_qparams`) used instead of calibrating.
        progress: a progress bar over calibration batches (on a terminal).
        work: for an offloaded model, the folder finished blocks are written to (kept; a run
            that died part-way, started again with the same settings and calibration, goes on
            after the last finished block); default a temporary folder.

    Keywords (the fields of :class:`QuantizeSpec`):
        weights: settings for weights (default int8, symmetric, per output channel), or None.
            Weights are replaced in place by their fake-quantized values with PyTorch's fused
            ops and kept so by forward-pre hooks; the originals are saved for ``restore()``.
        activations: settings for activations, or None. Forward hooks fake-quantize each
            selected layer's output (``where="input"``: forward-pre hooks, its first input;
            ``where="both"``: both, the output's parameters saved as ``"<layer>@output"``;
            ``where="tensors"``: each tensor once, as graph runtimes quantize: a layer's output,
            or the ReLU after it, per call (``"<relu>@output#1"``: its second call), and a
            layer's input only where no quantizer wrote it; found in one forward of the first
            calibration batch).
        where: where activations are quantized: ``"output"`` (default), ``"input"``,
            ``"both"`` or ``"tensors"`` (see ``activations``).
        select, exclude: layers (see :func:`surgery.select`), or weights by qualified parameter
            name (``"**.weight_ih_l0"``); default every Conv*d, Linear and Hugging Face Conv1D
            (weight axis 1). Weights matched and skipped are in ``handle.selection``.
        train: quantization-aware training. Weights keep their float values (the shadow an
            optimizer updates) and each forward sees them fake-quantized, with gradients passed
            straight through; ``bake()`` folds them to the grid, ``restore()`` gives back the
            original floats. Activation ranges keep learning in training-mode forwards.
        freeze_observers_after: with ``train``, stop learning activation ranges after this
            many optimizer steps over the model's parameters (``None``: never).
        blocks: for GPTQ, the repeated blocks calibrated one after another (default: found
            automatically; a selection; ``False`` for layer-by-layer full forwards).
        target: an export format (``"onnx"``, ``"torchao"``, ``"compressed-tensors"``) whose
            runtime the simulation then equals: BatchNorm folded into convolutions (restorably,
            with the first calibration batch), only the layer types it quantizes selected by
            default, activations where it quantizes them, with its bit widths and signedness.
        onload: for a sequential weight method (GPTQ, AutoRound), the device (``"cuda"``) each
            block is moved to while it is calibrated and solved, then moved back: a model in
            CPU memory compressed at the GPU's speed, the GPU holding one block and its
            calibration activations. ``None`` (default): where the model is.
        method: the weight method with its own settings, apart from the grid:
            ``GptqSettings(actorder=, damping=, block_size=)``, ``GptaqSettings(...)``,
            ``AutoRoundSettings(iterations=, batch=, seed=, lr=)``, a method's name (its default
            settings), or ``{"name": "gptq", "damping": 0.02}``; default: ``"rtn"`` (round to
            nearest). ``GridSpec(method=, actorder=, iterations=)``, the spelling before 0.3,
            still names it, with a ``DeprecationWarning``, until 0.4.
        originals: where the weights' original values wait for ``restore()``: ``"memory"``
            (one copy), or ``"disk"`` (a temporary file each, read back on restore, deleted
            with the handle): the model then needs about one copy of its weights in memory.
        unrouted: a layer no calibration token reached (an expert its router never chose) under
            a calibrated method: ``"refuse"`` (default, one line naming it) or ``"rtn"`` (rounded to
            nearest, never left float; warned and listed in ``handle.sequential.unrouted``).

    Example:
        >>> handle = surgery.quantize(model, activations=GridSpec(bits=8), calibration=batches)
        >>> handle.save_qparams("model.qparams.safetensors")
    """
    return _quantize_in_memory(model, spec, call.calibration, call.extras["qparams"], call.progress)


def _quantize_in_memory(
    model: nn.Module, spec: QuantizeSpec, calibration: Any, qparams: Any, progress: bool
) -> QuantizeHandle:
    """:func:`quantize` on a model in memory (its fused experts already per-expert layers)."""
    weights, activations, select, exclude, where = spec.weights, spec.activations, spec.select, spec.exclude, spec.where
    train, freeze_observers_after, blocks = spec.train, spec.freeze_observers_after, spec.blocks
    _validate_inputs(spec, calibration, qparams)
    if calibration is not None and iter(calibration) is calibration:  # one pass only: a probe takes the first
        calibration = list(calibration)
    if activations is None or activations.dynamic is not None:  # no static scales to read: none are saved
        qparams = None
    if isinstance(qparams, (str, Path)):  # read once, before anything changes
        qparams = load_qparams(qparams)
    rules = deploy_target(spec.target) if spec.target is not None else None
    select = rules.layers if rules is not None and select is None else select
    folding = rules is not None and rules.fold_batchnorm and any(isinstance(m, BATCH_NORMS) for m in model.modules())
    if folding and calibration is None:
        raise ConfigError("quantize.calibration", None, f"target={spec.target!r} folds BatchNorm; pass calibration")
    with _target_selection(model, spec, rules):
        weight_targets, layers = quantize_targets(model, select, exclude, weights, activations, where)
    if rules is not None and rules.check is not None:  # what the format cannot hold, before any work
        rules.check(model, spec, weight_targets.matched)
    guards.check_editable({name: t.param for name, t in weight_targets.matched.items()}, "quantize.select")
    handle = QuantizeHandle(model, weight_targets)
    handle.method = spec.method
    with handle.applying():
        if folding:
            handle.folded = fold_batchnorms(handle, model, next(batches(calibration, "quantize.calibration")))
        if weights is not None and train:
            _attach_shadow_weights(handle, model, weight_targets, weights)
        elif weights is not None:
            with onloading(spec.onload, "quantize.onload"):
                _attach_weights(
                    handle,
                    model,
                    weight_targets,
                    weights,
                    calibration,
                    blocks,
                    progress,
                    spec.originals,
                    spec.method,
                    spec.unrouted,
                )
        if activations is not None and where == "tensors":
            _attach_sites(handle, model, _sites_of(model, layers, calibration, qparams), activations)
        elif activations is not None:
            _attach_activations(handle, layers, activations, where, learning=train)
        if activations is not None:
            _calibrate_or_load(handle, model, calibration, qparams, progress)
            if train and freeze_observers_after is not None:
                schedule = ObserverSchedule(
                    list(handle.activations.values()), list(model.parameters()), freeze_observers_after
                )
                own_step_hook(handle, model, schedule)
    return handle


def _quantize_offloaded(source: Offloaded, spec: QuantizeSpec, call: VerbCall) -> OffloadedCompression:
    """Weights only, stage by stage (:mod:`surgery.ops.offload.offloaded_compression`)."""
    calibration, work, progress = call.calibration, call.work, call.progress
    if call.extras["qparams"] is not None:
        raise ConfigError(
            "quantize.qparams", "given", "holds activation ranges; an offloaded model is quantized weights only"
        )
    rules = deploy_target(spec.target) if spec.target is not None else None
    model = source.model
    folding = rules is not None and rules.fold_batchnorm and any(isinstance(m, BATCH_NORMS) for m in model.modules())
    unsupported = [
        ("activations", spec.activations is not None),
        ("train", spec.train),
        ("target", folding),
        ("weights", spec.weights is None),
        ("onload", spec.onload is not None),
    ]
    refused = next((name for name, bad in unsupported if bad), None)
    if refused is not None:
        raise ConfigError(
            f"quantize.{refused}",
            getattr(spec, refused) if refused != "weights" else None,
            "an offloaded model is quantized weights only, block by block, on the device offloaded(device=) "
            "names: set weights, and no activations, train, onload or target that folds BatchNorm "
            "(or handle.materialise() it first)",
        )
    _validate_inputs(spec, calibration, None)
    method = spec.weight_method
    if method.float_stream:
        raise ConfigError(
            "quantize.method",
            method.name,
            "needs every block's inputs in the float model beside the compressed ones, which an offloaded "
            "run does not carry yet; quantize in memory, or use method='gptq'",
        )
    if getattr(spec.method, "actorder", None) == "group" and spec.weights.group_size:
        raise ConfigError(
            "quantize.method.actorder",
            "group",
            "stores a group index per input column (g_idx), which an offloaded run's stages do not carry yet; "
            "quantize in memory, or use actorder='weight'",
        )
    select = rules.layers if rules is not None and spec.select is None else spec.select  # the layers it quantizes
    with _target_selection(model, spec, rules), linearized(model):  # each expert's layers, as in memory
        targets, _ = quantize_targets(model, select, spec.exclude, spec.weights, None, spec.where)
        if rules is not None and rules.check is not None:  # what the format cannot hold, before any work
            rules.check(model, spec, targets.matched)
    keys: dict[str, list[str]] = {}
    for key, target in targets.matched.items():
        keys.setdefault(target.module_name, []).append(key)

    def run(skeleton: nn.Module, layers: list[str], block: str | None, calls: Any) -> QuantizeHandle:
        staged = dataclasses.replace(
            spec,
            select=[key for layer in layers for key in keys[layer]],
            exclude=None,
            blocks=([block] if block else False) if method.sequential else None,
            originals="memory",
            target=None,  # its selection made above; an offloaded model folds no BatchNorm
        )
        return quantize(skeleton, staged, calibration=calls, progress=False)

    def grids(handle: QuantizeHandle) -> dict[str, tuple[Tensor, Tensor, int | None]]:
        return {key: (q.scale, q.zero_point, q.axis) for key, q in handle.weights.items()}

    verb = OffloadedVerb("quantize", run, repr(spec), spec.weights, grids)
    blocks = resolve_blocks(model, spec.blocks, "quantize.blocks") if method.sequential else find_blocks(model)
    layers = stage_layers(model, keys)
    calibration = calibration if method.needs_calibration or spec.weights.weighted else None
    return compress_offloaded(source, verb, layers, calibration, blocks=blocks, work=work, progress=progress)
