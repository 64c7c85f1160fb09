"""``QuantizeHandle`` and its quantization parameters: calibrated, saved, loaded and checked."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import Tensor, nn

from surgery.core.capture import Capture
from surgery.core.checkpoints import save_tensors
from surgery.core.errors import CheckpointError, ConfigError, OutputExistsError
from surgery.core.handles import Handle
from surgery.core.inputs import run_batches
from surgery.core.sequential import SequentialReport
from surgery.core.targets import Targets
from surgery.ops.numerics.deployment import ActivationGrid, WeightGrid
from surgery.ops.numerics.grid import GridSpec
from surgery.ops.numerics.observers import NonFiniteError
from surgery.ops.numerics.weight_methods import output_axis
from surgery.ops.quantization.qat import ShadowWeight
from surgery.ops.quantization.quantizers import ActivationQuantizer, WeightQuantizer


class QuantizeHandle(Handle):
    """Handle returned by :func:`quantize`; also saves and reports quantization parameters."""

    def __init__(self, model: nn.Module, selection: Targets | None = None) -> None:
        super().__init__("quantize", model)
        self.selection = selection or Targets({}, [])  # the weights matched and skipped
        self.weights: dict[str, WeightQuantizer | ShadowWeight] = {}
        self.activations: dict[str, ActivationQuantizer] = {}
        self.sequential: SequentialReport | None = None  # GPTQ's calibration pass
        self.folded: list[tuple[str, str]] = []  # (convolution, BatchNorm) pairs folded for a target
        self.method: Any = "rtn"  # the weight method: its settings (GptqSettings...), or its name

    @property
    def skipped(self) -> list:
        """Weights selected (or, by default, not selected) but left unquantized, with why."""
        return list(self.selection.skipped)

    def outside_weights(self) -> list[str]:
        if self.state != "attached" or not self.activations:
            return []
        return [f"activation quantization of {len(self.activations)} layer(s) (save_qparams keeps its parameters)"]

    def weight_qparams(self) -> dict[str, Tensor]:
        """Weight scales and zero points by ``"<parameter>.scale"`` / ``"<parameter>.zero_point"``
        (``"fc.weight.scale"``): scalars, one per output channel, or (outputs, groups) with
        ``group_size``; quantization-aware training gives those of the weights as they are now.
        ``"<parameter>.g_idx"``: the group of each input column, for ``actorder="group"``."""
        out: dict[str, Tensor] = {}
        for key, grid in self._weight_grids().items():
            out[f"{key}.scale"] = grid.scale.detach().cpu().contiguous()
            out[f"{key}.zero_point"] = grid.zero_point.detach().cpu().contiguous()
            if grid.g_idx is not None:
                out[f"{key}.g_idx"] = grid.g_idx.detach().cpu().contiguous()
        return out

    def _weight_grids(self) -> dict[str, WeightGrid]:
        grids, model = {}, self.model
        for key, quantizer in self.weights.items():
            scale, zero_point = quantizer.scale, quantizer.zero_point  # a shadow observes its current values
            layer, _, attribute = key.rpartition(".")
            outputs = output_axis(model.get_submodule(layer), attribute) if model is not None else 0
            g_idx = getattr(quantizer, "g_idx", None)  # a shadow (training) has contiguous groups
            g_idx = None if g_idx is None else g_idx.detach().cpu()
            grids[key] = WeightGrid(  # on the CPU, where exports pack them, whatever device the model is on
                key, quantizer.spec, scale.detach().cpu(), zero_point.detach().cpu(), quantizer.axis, outputs, g_idx
            )
        return grids

    def export_parts(self) -> list:
        if self.state != "attached":
            return []
        step = self.kind  # "quantize", or "kv_cache" for the cache's scales
        activations = [
            ActivationGrid(
                q.name,
                q.where,
                q.spec,
                q.scale.detach().cpu(),
                q.zero_point.detach().cpu(),
                q.axis,
                q.call,
                q.follows,
                step,
            )
            if not q.spec.dynamic
            else ActivationGrid(q.name, q.where, q.spec, None, None, None, q.call, step=step)
            for q in self.activations.values()
            if q.scale is not None or q.spec.dynamic
        ]
        return [*self._weight_grids().values(), *activations]

    def qparams(self) -> dict[str, Tensor]:
        """Activation scales and zero points by ``"<layer>.scale"`` / ``"<layer>.zero_point"``."""
        out: dict[str, Tensor] = {}
        for name, quantizer in self.activations.items():
            if quantizer.scale is not None:
                out[f"{name}.scale"] = quantizer.scale.detach().cpu().contiguous()
                out[f"{name}.zero_point"] = quantizer.zero_point.detach().cpu().contiguous()
            if quantizer.per_call:  # where="tensors": the module's runs per forward, to reattach without one
                out[f"{name}.runs"] = torch.tensor(quantizer.per_call)
        return out

    def save_qparams(self, path: str | Path, *, overwrite: bool = False) -> Path:
        """Write the activation (:meth:`qparams`) and weight (:meth:`weight_qparams`) quantization
        parameters to one safetensors file, settings as metadata, atomically; an existing file
        raises :class:`~surgery.core.errors.OutputExistsError` unless ``overwrite``.
        ``quantize(..., qparams=path)`` reads the activation parameters back."""
        if Path(path).exists() and not overwrite:
            raise OutputExistsError(str(path))
        first = next(iter(self.activations.values()), None)
        weight_spec = next(iter(self.weights.values())).spec if self.weights else None
        meta = {
            "where": first.where if first else "output",
            "spec": json.dumps(first.spec.as_dict() if first else {}),
            "layers": json.dumps(list(self.activations)),
            "weights": json.dumps(list(self.weights)),
            "weight_spec": json.dumps(weight_spec.as_dict() if weight_spec else {}),
            "weight_axes": json.dumps({key: q.axis for key, q in self.weights.items()}),
        }
        return save_tensors(self.qparams() | self.weight_qparams(), path, metadata=meta)


def load_qparams(path: str | Path) -> dict[str, Tensor]:
    """Read a file written by :meth:`QuantizeHandle.save_qparams`."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"quantize.qparams={str(path)!r}: no such file")
    try:
        return load_file(str(path))
    except Exception as err:
        raise CheckpointError(f"quantize.qparams={str(path)!r}: unreadable ({type(err).__name__})") from None


def _channels(module: nn.Module, where: str) -> int | None:
    """Channels of a layer's output (``where="output"``) or input, when the layer declares them."""
    for attribute in ("out_channels", "out_features") if where == "output" else ("in_channels", "in_features"):
        if isinstance(getattr(module, attribute, None), int):
            return getattr(module, attribute)
    return None


def _check_qparam_values(name: str, scale: Any, zero_point: Any, spec: GridSpec) -> None:
    """Saved scales must be finite, positive, normal floats and zero points integers on the grid:
    anything else quantizes every value to NaN or zero."""
    for key, value in (("scale", scale), ("zero_point", zero_point)):
        if not isinstance(value, Tensor):
            raise CheckpointError(f"quantize.qparams: {name}.{key} is {type(value).__name__}; it must be a tensor")
    if not scale.is_floating_point():
        raise CheckpointError(f"quantize.qparams: {name}.scale has dtype {scale.dtype}; it must be floating")
    low, high = (0, 0) if spec.is_float else spec.quant_range  # a floating-point grid's zero point is 0
    span = 2 * spec.number_format.largest if spec.is_float else high - low
    tiny, huge = torch.finfo(torch.float32).tiny, torch.finfo(torch.float32).max / span
    scale64 = scale.detach().double()
    bad = ~(torch.isfinite(scale64) & (scale64 >= tiny) & (scale64 <= huge))
    if bad.any():
        value = scale.flatten()[bad.flatten()][0].item()
        raise CheckpointError(
            f"quantize.qparams: {name}.scale holds {value!r}; every scale must be a finite "
            f"number in [{tiny:.3g}, {huge:.3g}] (positive, not denormal, and its grid "
            "representable in float32)"
        )
    if spec.float_offset:  # value = scale x q - offset: a finite offset >= 0 (minus the group's minimum)
        if not zero_point.is_floating_point() or not bool(((zero_point >= 0) & torch.isfinite(zero_point)).all()):
            raise CheckpointError(
                f"quantize.qparams: {name}.zero_point must hold finite float offsets >= 0 (float_offset=true)"
            )
        return
    if zero_point.is_floating_point() or zero_point.is_complex() or zero_point.dtype == torch.bool:
        raise CheckpointError(
            f"quantize.qparams: {name}.zero_point has dtype {zero_point.dtype}; it must be an integer tensor"
        )
    outside = (zero_point < low) | (zero_point > high)
    if outside.any():
        value = int(zero_point.flatten()[outside.flatten()][0])
        kind = spec.format if spec.is_float else f"{spec.bits}-bit {'symmetric' if spec.symmetric else 'affine'}"
        raise CheckpointError(
            f"quantize.qparams: {name}.zero_point holds {value}; it must lie in [{low}, {high}] for {kind} quantization"
        )


def _calibrate_or_load(handle: QuantizeHandle, model: nn.Module, calibration, qparams, progress: bool) -> None:
    if all(q.spec.dynamic for q in handle.activations.values()):
        return  # scales come from each tensor as it runs
    if qparams is not None:
        saved = load_qparams(qparams) if isinstance(qparams, (str, Path)) else qparams
        if not isinstance(saved, dict):
            raise CheckpointError(
                f"quantize.qparams: got {type(saved).__name__}; pass a path or a dict of tensors "
                "as written by save_qparams"
            )
        missing = [n for n in handle.activations if f"{n}.scale" not in saved or f"{n}.zero_point" not in saved]
        if missing:
            raise CheckpointError(f"quantize.qparams: no parameters for {len(missing)} layer(s), e.g. {missing[0]}")
        for name, quantizer in handle.activations.items():
            scale, zero_point = saved[f"{name}.scale"], saved[f"{name}.zero_point"]
            _check_qparam_values(name, scale, zero_point, quantizer.spec)
            channels = _channels(model.get_submodule(quantizer.name), quantizer.where)
            fits = (
                scale.numel() == 1
                if quantizer.axis is None
                else scale.dim() == 1 and (channels is None or scale.numel() == channels)
            )
            if not fits or zero_point.shape != scale.shape:
                need = (
                    "one value each"
                    if quantizer.axis is None
                    else f"1-d tensors of length {channels if channels is not None else 'C'}"
                )
                raise CheckpointError(
                    f"quantize.qparams: {name} has scale shape {tuple(scale.shape)} and zero point "
                    f"shape {tuple(zero_point.shape)}; these settings need {need}"
                )
            quantizer.freeze(scale, zero_point)
        return
    with contextlib.ExitStack() as captures:  # the observers are the reducers, one capture per side
        for side in ("input", "output"):
            observers = {k: q.observer for k, q in handle.activations.items() if q.where == side and not q.per_call}
            if observers:
                layers = {k: model.get_submodule(handle.activations[k].name) for k in observers}
                capture = Capture(model, layers, (f"{side}s",), lambda key, module, seen=observers: seen[key])
                captures.enter_context(capture)
        run_batches(model, calibration, field="quantize.calibration", progress=progress, error=NonFiniteError)
    for quantizer in handle.activations.values():
        if quantizer.per_call and quantizer.observer.low is None:
            raise ConfigError(
                "quantize.calibration", quantizer.name, f"ran fewer than {quantizer.call + 1} times in a forward"
            )
        quantizer.freeze()
    for quantizer in handle.activations.values():
        if quantizer.follows is not None:  # its input is a quantized tensor, max-pooled: one grid for both
            source = handle.activations[quantizer.follows]
            quantizer.freeze(source.scale.clone(), source.zero_point.clone())
