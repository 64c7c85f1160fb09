"""How shrink builds each layer kind smaller, registered into the layer-kind table
(:mod:`surgery.core.layer_kinds`): a builder per kind makes a new layer of the same class
holding the kept slices. :func:`rebuildable` and :func:`describe` read the same table."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from surgery.core.errors import ConfigError
from surgery.core.layer_kinds import LAYER_KINDS, describe_layer, fill_layer_kind, is_kind, kind_of


def _sliced_weight(module: nn.Module, keep_in: Tensor | None, keep_out: Tensor | None, inputs: bool) -> Tensor:
    weight = module.weight.detach()
    weight = weight if keep_out is None else weight[keep_out]
    return weight if keep_in is None or not inputs else weight[:, keep_in]


def _copy_bias(module: nn.Module, new: nn.Module, keep_out: Tensor | None) -> nn.Module:
    if module.bias is not None:
        new.bias.copy_(module.bias if keep_out is None else module.bias[keep_out])
    return new


def _smaller_linear(module: nn.Linear, keep_in: Tensor | None, keep_out: Tensor | None, factory: dict) -> nn.Module:
    weight = _sliced_weight(module, keep_in, keep_out, inputs=True)
    new = type(module)(weight.shape[1], weight.shape[0], bias=module.bias is not None, dtype=weight.dtype, **factory)
    new.weight.copy_(weight)
    return _copy_bias(module, new, keep_out)


def _smaller_conv(module: nn.Module, keep_in: Tensor | None, keep_out: Tensor | None, factory: dict) -> nn.Module:
    weight = _sliced_weight(module, keep_in, keep_out, inputs=module.groups == 1)
    groups = 1 if module.groups == 1 else weight.shape[0] // (module.out_channels // module.groups)
    new = type(module)(
        weight.shape[1] * groups,
        weight.shape[0],
        module.kernel_size,
        stride=module.stride,
        padding=module.padding,
        dilation=module.dilation,
        groups=groups,
        bias=module.bias is not None,
        padding_mode=module.padding_mode,
        dtype=weight.dtype,
        **factory,
    )
    new.weight.copy_(weight)
    return _copy_bias(module, new, keep_out)


def _smaller_batchnorm(module: nn.Module, keep_in: Tensor | None, keep_out: Tensor, factory: dict) -> nn.Module:
    new = type(module)(
        len(keep_out),
        eps=module.eps,
        momentum=module.momentum,
        affine=module.affine,
        track_running_stats=module.track_running_stats,
        **factory,
    )
    for attr in ("weight", "bias", "running_mean", "running_var"):
        value = getattr(module, attr)
        if value is not None:
            getattr(new, attr).copy_(value[keep_out])
    if module.num_batches_tracked is not None:
        new.num_batches_tracked.copy_(module.num_batches_tracked)
    return new


def _smaller_embedding(module: nn.Embedding, keep_in: Tensor | None, keep_out: Tensor, factory: dict) -> nn.Module:
    new = type(module)(
        module.num_embeddings,
        len(keep_out),
        padding_idx=module.padding_idx,
        max_norm=module.max_norm,
        norm_type=module.norm_type,
        scale_grad_by_freq=module.scale_grad_by_freq,
        sparse=module.sparse,
        dtype=module.weight.dtype,
        **factory,
    )
    new.weight.copy_(module.weight[:, keep_out])
    return new


def _smaller_groupnorm(module: nn.GroupNorm, keep_in: Tensor | None, keep_out: Tensor, factory: dict) -> nn.Module:
    new = type(module)(
        len(keep_out) // (module.num_channels // module.num_groups),
        len(keep_out),
        eps=module.eps,
        affine=module.affine,
        **factory,
    )
    if module.affine:
        new.weight.copy_(module.weight[keep_out])
        new.bias.copy_(module.bias[keep_out])
    return new


def _smaller_layernorm(module: nn.LayerNorm, keep_in: Tensor | None, keep_out: Tensor, factory: dict) -> nn.Module:
    new = type(module)(
        len(keep_out),
        eps=module.eps,
        elementwise_affine=module.elementwise_affine,
        bias=module.bias is not None,
        **factory,
    )
    if module.weight is not None:
        new.weight.copy_(module.weight[keep_out])
    return _copy_bias(module, new, keep_out)


def _smaller_rmsnorm(module: nn.RMSNorm, keep_in: Tensor | None, keep_out: Tensor, factory: dict) -> nn.Module:
    new = type(module)(len(keep_out), eps=module.eps, elementwise_affine=module.elementwise_affine, **factory)
    if module.weight is not None:
        new.weight.copy_(module.weight[keep_out])
    return new


def _register() -> None:
    """Fill the ``smaller`` slot of the built-in kinds shrink rebuilds (``needs_outputs``: only
    when output channels go). Conv3d is shrunk like Conv1d/2d; a transposed convolution (its
    weight holds outputs on axis 1) and Hugging Face's Conv1D are not."""
    for name, build, needs_outputs in (
        ("linear", _smaller_linear, False),
        ("conv1d", _smaller_conv, False),
        ("conv2d", _smaller_conv, False),
        ("conv3d", _smaller_conv, False),
        ("batch_norm", _smaller_batchnorm, True),
        ("embedding", _smaller_embedding, True),
        ("group_norm", _smaller_groupnorm, True),
        ("layer_norm", _smaller_layernorm, True),
        ("rms_norm", _smaller_rmsnorm, True),
    ):
        fill_layer_kind(name, smaller=build, smaller_needs_outputs=needs_outputs)


_register()


def smaller(module: nn.Module, keep_in: Tensor | None, keep_out: Tensor | None) -> nn.Module | None:
    """A new layer of the same class holding the kept slices (None: nothing changes)."""
    kind = kind_of(module)
    if kind is None or kind.smaller is None or (keep_out is None and kind.smaller_needs_outputs):
        return None
    factory = {"device": next(module.parameters(), torch.empty(0)).device}
    with torch.no_grad():
        return kind.smaller(module, keep_in, keep_out, factory)


def rebuildable(cls: type) -> bool:
    """A layer class shrink can rebuild smaller: of a kind with a ``smaller`` builder and a
    ``describe``, and keeping its base's constructor (a subclass with its own, e.g. timm's
    ``Conv2dSame``, is not)."""
    kind = kind_of(cls)
    base = kind.base_of(cls) if kind is not None else None
    return base is not None and kind.smaller is not None and kind.describe is not None and cls.__init__ is base.__init__


def is_norm(module: nn.Module) -> bool:
    """A normalisation layer (BatchNorm, SyncBatchNorm, GroupNorm, LayerNorm, RMSNorm...) by its kind."""
    return is_kind(module, lambda kind: kind.normalises is not None)


def rebuildable_kinds() -> str:
    """The kinds shrink rebuilds, for error messages."""
    return ", ".join(n for n in LAYER_KINDS if LAYER_KINDS.get(n).smaller is not None)


def describe(module: nn.Module) -> dict[str, Any]:
    """A layer's class and the constructor arguments that rebuild it at its shape (its kind's ``describe``)."""
    found = describe_layer(module)
    if found is None:
        raise ConfigError(
            "shrink", type(module).__name__, f"has no layer kind that describes it ({rebuildable_kinds()})"
        )
    return found
