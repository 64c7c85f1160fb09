"""The names a Hugging Face checkpoint gives each layer, as transformers' own conversion mapping
writes them back (``revert_weight_conversion``, what ``save_pretrained`` runs): a dense layer's
name as it is (or renamed), and each expert of a fused mixture-of-experts module, per-expert layers
while a verb is attached (:class:`~surgery.ops.experts.linear_experts.LinearExperts`), under the
per-expert name transformers merges on load (Mixtral's ``block_sparse_moe.experts.3.w1``, Qwen's
``mlp.experts.3.gate_proj``). A format that stores a layer's weight under other names
(compressed-tensors' ``weight_packed``, ``weight_scale``) writes them there."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from surgery.core.errors import ConfigError
from surgery.ops.experts.linear_experts import LinearExperts
from surgery.ops.experts.routing import linear_experts_in


def reverted(model: nn.Module, state: dict[str, Tensor]) -> dict[str, Tensor]:
    """``state`` (the model's own keys, its experts fused) under the checkpoint's names."""
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(model, state) if hasattr(model, "config") else dict(state)


def checkpoint_names(model: nn.Module, layers: list[str], why: str | None) -> dict[str, str]:
    """Each of ``layers`` (module names of ``model``) by the name its checkpoint gives it. A layer of
    an expert that transformers keeps fused in its checkpoints has none, nor a layer whose weight
    the checkpoint holds merged with others: refused in one line (``why``: what needs the names of
    its own), or with ``why=None`` left out."""
    owners = linear_experts_in(model)
    names: dict[str, str] = {}
    for name, module in owners.items():
        if any(layer.startswith(f"{name}.") for layer in layers):
            names |= _expert_names(model, name, module) or _refuse_fused(model, name, why)
    inside = {layer for layer in layers if any(layer.startswith(f"{name}.") for name in owners)}
    dense = [layer for layer in layers if layer not in inside]
    labels = {f"{layer}.weight": _label(model.get_submodule(layer).weight, i) for i, layer in enumerate(dense)}
    for key, value in reverted(model, labels).items():
        index = int(value.reshape(-1)[0])
        if bool((value == index).all()) and key.endswith(".weight"):
            names[dense[index]] = key.removesuffix(".weight")
        elif why is not None:
            raise ConfigError(
                "export.format", "compressed-tensors", f"{dense[index]}'s checkpoint holds it merged ({key}), and {why}"
            )
    return {layer: names[layer] for layer in layers if layer in names}


def _label(like: Tensor, index: int) -> Tensor:
    """A tensor of ``like``'s shape holding ``index`` everywhere (a view: no memory of its own)."""
    return torch.full((1,) * like.dim(), index, dtype=torch.int32).expand(like.shape)


def _expert_names(model: nn.Module, name: str, experts: LinearExperts) -> dict[str, str] | None:
    """Each layer of each expert of ``experts`` (the module ``name``) by its checkpoint name, traced
    through transformers' conversion: every weight filled with its own number, fused as the model
    stores it, reverted, and read back where each number landed; ``None`` when the checkpoint
    keeps them fused (a tensor holding several layers, or none as a Linear weight of its own)."""
    order: list[str] = []

    def number(local: str, tensor: Tensor) -> Tensor:
        order.append(local)
        return torch.full(tensor.shape, len(order) - 1, dtype=torch.int32)

    fused = {f"{name}.{param}": value for param, value in experts.fused_tensors(number).items()}
    found: dict[str, str] = {}
    for key, value in reverted(model, fused).items():
        index = int(value.reshape(-1)[0])
        layer = f"{name}.{order[index]}".removesuffix(".weight")
        if not bool((value == index).all()):
            return None
        if order[index].endswith(".weight"):
            if not _same_layout(model, layer, key, value):
                return None
            found[layer] = key.removesuffix(".weight")
    return found if len(found) == sum(local.endswith(".weight") for local in order) else None


def _same_layout(model: nn.Module, layer: str, key: str, value: Tensor) -> bool:
    """Whether the checkpoint holds ``layer``'s weight as a Linear weight of its own, as it is."""
    return key.endswith(".weight") and value.shape == model.get_submodule(layer).weight.shape


def _refuse_fused(model: nn.Module, name: str, why: str | None) -> dict[str, str]:
    """Raise (with ``why``; else nothing: no names) as transformers gives ``name``'s experts no
    per-expert checkpoint names."""
    if why is None:
        return {}
    import transformers

    family = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
    layout = linear_experts_in(model)[name].layout
    raise ConfigError(
        "export.format",
        "compressed-tensors",
        f"{family} experts ({name}) have no per-expert checkpoint names in transformers {transformers.__version__}: "
        f"its checkpoints keep them fused (experts.{layout.up_name}, experts.down_proj), and {why}; "
        "leave the experts float (exclude='**.experts') or use format='torchao'",
    )
