"""EoRA (Liu et al. 2024): a rank-``r`` branch beside each quantized ``nn.Linear`` that gives back
the part of its quantization error its inputs see most, kept apart from the weights.

For a layer with original weights ``W``, quantized ``Wq`` and inputs whose second moment is
``M = E[xᵀx] = Q Λ Qᵀ``, the error ``ΔW = W − Wq`` is projected onto the inputs' eigenspace
(``ΔW Q Λ^½``), truncated to its ``r`` largest singular directions ``U S Vᵀ`` and brought back:
``B = U S^½`` (outputs × r), ``A = S^½ Vᵀ (Q Λ^½)⁻¹`` (r × inputs); the layer then computes
``Wq x + B (A x)``. The branch is a forward hook, never part of the weights, so the quantized
weights still export as they are; :meth:`LowRankBranchHandle.save` writes the branches as a
PEFT LoRA adapter.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from surgery.core.checkpoints import refuse_existing, save_tensors, write_atomically
from surgery.core.errors import ConfigError, ConfigTypeError
from surgery.core.handles import Handle
from surgery.core.inputs import run_batches
from surgery.core.verbs import VerbCall, verb

FIELD = "low_rank_branch"
ADAPTER_WEIGHTS, ADAPTER_CONFIG = "adapter_model.safetensors", "adapter_config.json"  # PEFT's file names


class LowRankBranchHandle(Handle):
    """The branches :func:`low_rank_branch` added: ``branches[layer] = (A, B)``. ``restore()``
    removes them; they are not weights, so ``bake()`` refuses (save them with :meth:`save`)."""

    undo_first = True  # the branches compensate the quantized weights: restoring those first would leave them wrong

    def __init__(self, model: nn.Module, rank: int) -> None:
        super().__init__("low_rank_branch", model)
        self.rank = rank
        self.branches: dict[str, tuple[Tensor, Tensor]] = {}

    def bake(self) -> nn.Module:
        raise ConfigError(
            f"{FIELD}.bake",
            "bake",
            "a low-rank branch is a separate adapter, not a weight: save it with handle.save(folder) "
            "(a PEFT LoRA adapter), or restore() it",
        )

    def save(self, folder: str | Path, *, overwrite: bool = False) -> Path:
        """Write the branches as a PEFT LoRA adapter (``adapter_model.safetensors`` and
        ``adapter_config.json``; ``lora_alpha`` = ``r``, so its scaling is 1), each file atomically;
        an adapter already in ``folder`` raises :class:`~surgery.core.errors.OutputExistsError`
        unless ``overwrite``."""
        folder = Path(folder)
        if folder.exists() and not folder.is_dir():
            raise ConfigError(
                f"{FIELD}.save.folder", str(folder), "is a file; give a folder for the adapter's two files"
            )
        refuse_existing([folder / ADAPTER_WEIGHTS, folder / ADAPTER_CONFIG], overwrite)
        tensors = {}
        for layer, (down, up) in self.branches.items():
            tensors[f"base_model.model.{layer}.lora_A.weight"] = down.contiguous()
            tensors[f"base_model.model.{layer}.lora_B.weight"] = up.contiguous()
        save_tensors(tensors, folder / ADAPTER_WEIGHTS)
        config = {
            "peft_type": "LORA",
            "r": self.rank,
            "lora_alpha": self.rank,
            "lora_dropout": 0.0,
            "bias": "none",
            "target_modules": sorted(self.branches),
            "task_type": None,
        }
        text = json.dumps(config, indent=2) + "\n"
        write_atomically(folder / ADAPTER_CONFIG, lambda tmp: tmp.write_text(text))
        return folder


@dataclass(frozen=True)
class LowRankSpec:
    """The EoRA branch's ``rank`` (see :func:`low_rank_branch`)."""

    rank: int | None = None

    def __post_init__(self) -> None:
        rank = self.rank
        if isinstance(rank, bool) or not isinstance(rank, int):
            raise ConfigTypeError(f"{FIELD}.rank", rank, "must be a whole number of at least 1")
        if rank < 1:
            raise ConfigError(f"{FIELD}.rank", rank, "must be a whole number of at least 1")


@verb(
    "low_rank_branch",
    LowRankSpec,
    positional="rank",
    calibration="required",
    old_positional=("rank", "calibration"),
    unwrap_compiled=False,
)
def low_rank_branch(quantized: Handle, spec: LowRankSpec, call: VerbCall) -> LowRankBranchHandle:
    """Add an EoRA branch of rank ``rank`` beside every ``nn.Linear`` weight ``quantized`` (a
    :func:`surgery.quantize` handle, still attached) rounded, from the second moment of the layer's
    inputs over ``calibration`` (the quantized model run on it).

    Example:
        >>> q = surgery.quantize(model, weights=GridSpec(bits=3, group_size=64), method="gptq", calibration=batches)
        >>> branch = surgery.low_rank_branch(q, rank=16, calibration=batches)
        >>> branch.save("eora-adapter")   # a PEFT LoRA adapter beside the quantized export
    """
    model, rank, calibration, progress = quantized.model, spec.rank, call.calibration, call.progress
    if not isinstance(quantized, Handle):
        raise ConfigTypeError(f"{FIELD}.quantized", quantized, "must be an attached quantize handle")
    if model is None or quantized.state != "attached":
        raise ConfigError(f"{FIELD}.quantized", quantized.kind, "must be an attached quantize handle")
    errors = _quantization_errors(model, quantized)
    for layer, delta in errors.items():
        if rank > min(delta.shape):
            raise ConfigError(
                f"{FIELD}.rank",
                rank,
                f"is larger than {layer} ({delta.shape[0]} x {delta.shape[1]}): at most {min(delta.shape)}",
            )
    moments = _input_moments(model, list(errors), calibration, progress)
    handle = LowRankBranchHandle(model, rank)
    for layer, delta in errors.items():
        down, up = eora_factors(delta, moments[layer], rank)
        module = model.get_submodule(layer)
        handle.branches[layer] = (down.to(module.weight.dtype), up.to(module.weight.dtype))
        handle.add_hook(f"remove the low-rank branch of {layer}", module.register_forward_hook(_Branch(down, up)))
    return handle


def eora_factors(delta: Tensor, moment: Tensor, rank: int) -> tuple[Tensor, Tensor]:
    """``(A, B)`` of rank ``rank`` with ``B A`` the best approximation of ``delta`` (outputs ×
    inputs) as inputs of second moment ``moment`` see it (EoRA's eigenspace projection)."""
    eigenvalues, vectors = torch.linalg.eigh(moment.double())
    positive = eigenvalues[eigenvalues > 0]
    floor = positive.min() if positive.numel() else torch.tensor(1.0, dtype=torch.float64)
    eigenvalues = torch.where(eigenvalues > 0, eigenvalues, floor)  # too few calibration inputs
    project = vectors * eigenvalues.sqrt()
    left, values, right = torch.linalg.svd(delta.double() @ project, full_matrices=False)
    root = values[:rank].sqrt()
    up = left[:, :rank] * root
    down = (root.unsqueeze(1) * right[:rank]) @ torch.linalg.inv(project)
    return down.float(), up.float()


class _Branch:
    """The forward hook adding ``B (A x)`` to a Linear layer's output."""

    def __init__(self, down: Tensor, up: Tensor) -> None:
        self.down, self.up = down, up

    def __call__(self, module: nn.Module, args: tuple, output: Tensor) -> Tensor:
        x = args[0]
        down, up = self.down.to(x.device, x.dtype), self.up.to(x.device, x.dtype)
        return output + torch.nn.functional.linear(torch.nn.functional.linear(x, down), up)


def _quantization_errors(model: nn.Module, quantized: Handle) -> dict[str, Tensor]:
    """``W − Wq`` (float32, outputs × inputs) of each ``nn.Linear`` weight the handle quantized."""
    errors = {}
    for record in quantized.records:
        layer, _, name = record.name.rpartition(".")
        module = model.get_submodule(layer)
        if getattr(record.transform, "kind", None) != "quantize" or name != "weight":
            continue
        if not isinstance(module, nn.Linear):
            raise ConfigError(
                f"{FIELD}.quantized", layer, f"is a {type(module).__name__}; EoRA branches go beside nn.Linear layers"
            )
        current = record.param.detach().float()
        original = record.param.detach().clone()
        with torch.no_grad():
            record.saved.put_back(original)
        errors[layer] = original.float() - current
    if not errors:
        raise ConfigError(f"{FIELD}.quantized", quantized.kind, "rounded no nn.Linear weight: nothing to compensate")
    return errors


def _input_moments(model: nn.Module, layers: list[str], calibration: Any, progress: bool) -> dict[str, Tensor]:
    """``E[xᵀx]`` of each layer's inputs over the calibration batches."""
    sums: dict[str, Tensor] = {}
    counts = dict.fromkeys(layers, 0)

    def observe(layer: str):
        def hook(module: nn.Module, args: tuple) -> None:
            x = args[0].detach().reshape(-1, args[0].shape[-1]).float()
            sums[layer] = sums.get(layer, 0) + x.t() @ x
            counts[layer] += x.shape[0]

        return hook

    hooks = [model.get_submodule(layer).register_forward_pre_hook(observe(layer)) for layer in layers]
    try:
        run_batches(model, calibration, field=f"{FIELD}.calibration", progress=progress)
    finally:
        for hook in hooks:
            hook.remove()
    missing = [layer for layer in layers if not counts[layer]]
    if missing:
        raise ConfigError(
            f"{FIELD}.calibration", missing[0], "saw no calibration input; give batches that run through it"
        )
    return {layer: sums[layer] / counts[layer] for layer in layers}
