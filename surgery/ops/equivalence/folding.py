"""Fold each BatchNorm into the convolution that feeds it, restorably, as deployment runtimes do
before they quantize: the convolution's weight and bias absorb the normalisation and the
BatchNorm becomes an identity (a subclass that does more, as timm's BatchNormAct2d with its
activation inside, keeps its forward with the normalisation made exactly neutral)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from surgery.core import guards
from surgery.core._compat import get_slot, set_slot
from surgery.core.errors import ConfigError
from surgery.core.handles import Handle
from surgery.core.inputs import Call
from surgery.core.layer_kinds import classes_where, is_kind


def _batch_norm(module: nn.Module) -> bool:
    """A BatchNorm (SyncBatchNorm included) by the layer-kind table."""
    return is_kind(module, lambda kind: kind.normalises == "channel")


def batchnorm_pairs(model: nn.Module, call: Call) -> list[tuple[str, str]]:
    """(convolution, BatchNorm) names where the BatchNorm's input is the convolution's output
    in one eval-mode forward of ``call``: what :func:`fold_batchnorms` folds."""
    produced: dict[int, str] = {}
    pairs: list[tuple[str, str]] = []
    names = {id(m): n for n, m in model.named_modules()}
    hooks = []

    def conv_output(module: nn.Module, args: tuple, output: Tensor) -> None:
        produced[id(output)] = names[id(module)]
        keep.append(output)  # alive until the forward ends, so ids stay unique

    def norm_input(module: nn.Module, args: tuple) -> None:
        source = produced.get(id(args[0])) if args else None
        if source is not None:
            pairs.append((source, names[id(module)]))

    keep: list[Tensor] = []
    for module in model.modules():
        if is_kind(module, lambda kind: kind.foldable):  # not a transposed convolution: outputs on axis 1
            hooks.append(module.register_forward_hook(conv_output))
        elif _batch_norm(module) and module.track_running_stats and module.running_var is not None:
            hooks.append(module.register_forward_pre_hook(norm_input))
    training = model.training
    try:
        model.eval()
        with torch.no_grad():
            call(model)
    finally:
        model.train(training)
        for hook in hooks:
            hook.remove()
    used = [norm for _, norm in pairs]
    return [(conv, norm) for conv, norm in pairs if used.count(norm) == 1 and _feeds_once(pairs, conv)]


def _feeds_once(pairs: list[tuple[str, str]], conv: str) -> bool:
    return sum(1 for c, _ in pairs if c == conv) == 1


def fold_batchnorms(handle: Handle, model: nn.Module, call: Call) -> list[tuple[str, str]]:
    """Fold every BatchNorm fed by a convolution (found by :func:`batchnorm_pairs`) into it, each
    fold recorded on ``handle`` so that ``restore()`` puts weights, biases and BatchNorms back
    and ``bake()`` keeps them folded. Returns the folded pairs."""
    pairs = batchnorm_pairs(model, call)
    for conv_name, norm_name in pairs:
        conv, norm = model.get_submodule(conv_name), model.get_submodule(norm_name)
        guards.check_editable({f"{conv_name}.weight": conv.weight}, "quantize.target")
        _fold_one(handle, model, conv_name, conv, norm_name, norm)
    return pairs


def _fold_one(
    handle: Handle, model: nn.Module, conv_name: str, conv: nn.Module, norm_name: str, norm: nn.Module
) -> None:
    with torch.no_grad():
        std = torch.sqrt(norm.running_var.double() + norm.eps)
        gamma = norm.weight.double() if norm.weight is not None else torch.ones_like(std)
        beta = norm.bias.double() if norm.bias is not None else torch.zeros_like(std)
        factor = gamma / std
        weight = conv.weight
        if not torch.isfinite(factor).all():
            raise ConfigError("quantize.target", norm_name, "has a non-finite scale (running_var + eps <= 0)")
        original_weight = weight.detach().clone()
        shape = (-1,) + (1,) * (weight.dim() - 1)
        folded = weight.double() * factor.reshape(shape)
        old_bias = get_slot(conv, "bias")
        bias = old_bias.double() if old_bias is not None else torch.zeros_like(std)
        new_bias = ((bias - norm.running_mean.double()) * factor + beta).to(weight.dtype)
        weight.copy_(folded.to(weight.dtype))
    parent_name, _, child = norm_name.rpartition(".")
    parent = model.get_submodule(parent_name)
    set_slot(conv, "bias", nn.Parameter(new_bias, requires_grad=weight.requires_grad))
    kept = _neutralize(norm) if type(norm) not in classes_where(lambda k: k.normalises == "channel") else None
    if kept is None:
        setattr(parent, child, nn.Identity())

    def undo() -> None:
        if kept is not None:
            kept()
        setattr(parent, child, norm)
        set_slot(conv, "bias", old_bias)
        with torch.no_grad():
            conv.weight.copy_(original_weight)

    handle.add(f"BatchNorm {norm_name} folded into {conv_name}", undo)


def _neutralize(norm: nn.Module) -> Callable[[], None]:
    """Make ``norm``'s normalisation the identity, bit for bit (mean 0, weight 1, bias 0, and a
    variance that with its eps makes 1 exactly), leaving the rest of its forward; returns what
    puts it back."""
    saved = {
        n: t.detach().clone() for n, t in (*norm.named_buffers(recurse=False), *norm.named_parameters(recurse=False))
    }
    with torch.no_grad():
        norm.running_mean.zero_()
        norm.running_var.fill_(_unit_variance(norm.eps, norm.running_var.dtype))
        if norm.weight is not None:
            norm.weight.fill_(1.0)
            norm.bias.zero_()

    def put_back() -> None:
        with torch.no_grad():
            for name, value in saved.items():
                getattr(norm, name).copy_(value)

    return put_back


def _unit_variance(eps: float, dtype: torch.dtype) -> float:
    """The variance nearest ``1 - eps`` whose sum with ``eps`` is exactly 1 in ``dtype``."""
    value = torch.tensor(1 - eps, dtype=dtype)
    for _ in range(64):
        total = value + eps
        if total == 1:
            return value.item()
        value = torch.nextafter(value, torch.tensor(2.0 if total < 1 else 0.0, dtype=dtype))
    raise ConfigError("quantize.target", eps, "no BatchNorm variance makes this eps neutral; fold it by hand")


def is_neutral(norm: nn.Module) -> bool:
    """Whether a BatchNorm was folded by :func:`_neutralize` (it computes the identity)."""
    affine = norm.weight is None or (bool((norm.weight == 1).all()) and bool((norm.bias == 0).all()))
    unit = _unit_variance(norm.eps, norm.running_var.dtype)
    return bool((norm.running_mean == 0).all()) and bool((norm.running_var == unit).all()) and affine


def folded_structure(model: nn.Module, pairs: list[tuple[str, str]]) -> nn.Module:
    """``model`` shaped as after :func:`fold_batchnorms` of ``pairs`` (each BatchNorm an identity,
    a subclass kept for its neutral statistics; each convolution with a bias), so that a folded
    model's state dict loads into it."""
    for conv_name, norm_name in pairs:
        conv = model.get_submodule(conv_name)
        if get_slot(conv, "bias") is None:
            set_slot(
                conv,
                "bias",
                nn.Parameter(torch.zeros(conv.out_channels, dtype=conv.weight.dtype, device=conv.weight.device)),
            )
        parent_name, _, child = norm_name.rpartition(".")
        if type(model.get_submodule(norm_name)) in classes_where(
            lambda k: k.normalises == "channel"
        ):  # a subclass keeps its neutral statistics
            setattr(model.get_submodule(parent_name), child, nn.Identity())
    return model
