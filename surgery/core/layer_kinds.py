"""One table of layer kinds: what every verb needs to know about a layer type, registered once.

A :class:`LayerKind` says, for one family of layer classes, where its weight keeps its output
and input channels (Hugging Face's ``Conv1D`` stores ``(in, out)``), where its activations keep
their channels, whether it is a convolution, a normalisation (and over what), whether the
second-order methods can see it as a matrix, whether a BatchNorm after it folds into it, how
to describe it (the constructor arguments that rebuild it at its shape) and how to build it
smaller (a slot the shrink family fills). Prune, quantize, the Hessians, folding, the export
formats and shrink all read this table; a new layer kind is one :func:`register_layer_kind`.

Example:
    >>> surgery.register_layer_kind(LayerKind("dense", (MyDense,), output_axis=0, input_axis=1,
    ...                                       activation_axis=-1, default=True))
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from surgery.core.errors import ConfigError
from surgery.core.registry import Registry

NORMALISES = (None, "channel", "group", "features")  # channel: BatchNorm; features: LayerNorm/RMSNorm


@dataclass(frozen=True)
class LayerKind:
    """One layer kind. ``classes`` are matched with ``isinstance`` (``match``, when given,
    recognises the kind by another test, as Hugging Face's ``Conv1D`` by name).

    ``output_axis``/``input_axis``: the weight's output and input channel axes (None: none).
    ``activation_axis``: the channel axis of its inputs and outputs that per-channel activation
    quantization uses (1: channels first, -1: last; None: refused, as for norms and embeddings). ``normalises``: None, ``"channel"``
    (BatchNorm: per-channel statistics), ``"group"`` (GroupNorm) or ``"features"`` (LayerNorm,
    RMSNorm: statistics over every channel, so fewer channels change them). ``default``: in
    prune's and quantize's default selection. ``hessian``: the second-order methods can unfold
    its inputs. ``foldable``: a BatchNorm it feeds folds into its weight. ``describe(module)``:
    the constructor arguments that rebuild it at its shape. ``smaller(module, keep_in,
    keep_out, factory)``: the same layer holding only the kept channels (the shrink family
    registers these), applied only when output channels go if ``smaller_needs_outputs``."""

    name: str
    classes: tuple[type, ...]
    output_axis: int | None = None
    input_axis: int | None = None
    activation_axis: int | None = None
    convolution: bool = False
    normalises: str | None = None
    default: bool = False
    hessian: bool = False
    foldable: bool = False
    describe: Callable[[nn.Module], dict[str, Any]] | None = None
    smaller: Callable[..., nn.Module] | None = None
    smaller_needs_outputs: bool = False
    match: Callable[[nn.Module], bool] | None = None

    def __post_init__(self) -> None:
        if self.normalises not in NORMALISES:
            raise ConfigError(f"layer kind {self.name}.normalises", self.normalises, f"must be one of {NORMALISES}")
        if not isinstance(self.classes, tuple) or not all(isinstance(c, type) for c in self.classes):
            raise ConfigError(f"layer kind {self.name}.classes", self.classes, "must be a tuple of classes")

    def __call__(self, module: nn.Module) -> bool:
        """Whether ``module`` is of this kind."""
        return isinstance(module, self.classes) or (self.match is not None and self.match(module))

    @property
    def renormalises(self) -> bool:
        """Statistics over every channel: a layer of this kind that loses channels normalises differently."""
        return self.normalises == "features"

    def base_of(self, cls: type) -> type | None:
        """The class of this kind that ``cls`` is (or derives from), None if none."""
        return next((base for base in self.classes if issubclass(cls, base)), None)


LAYER_KINDS: Registry[LayerKind] = Registry("layer kind")


def register_layer_kind(kind: LayerKind, *, replace: bool = False) -> LayerKind:
    """Add a layer kind: every verb then handles layers of its classes as the kind says."""
    if not isinstance(kind, LayerKind):
        raise ConfigError("layer kind", type(kind).__name__, "must be a LayerKind")
    return LAYER_KINDS.register(kind.name, kind, replace=replace)


def fill_layer_kind(name: str, **fields: Any) -> LayerKind:
    """Set fields of a registered kind (the shrink family fills ``smaller`` this way)."""
    return LAYER_KINDS.register(name, dataclasses.replace(LAYER_KINDS.get(name), **fields), replace=True)


def kind_of(module: nn.Module | type) -> LayerKind | None:
    """The kind of ``module`` (or of a class): the registered kind naming its closest class,
    a ``match`` first; None for a module of no registered kind."""
    cls = module if isinstance(module, type) else type(module)
    best, depth = None, len(cls.__mro__)
    for name in LAYER_KINDS:
        kind = LAYER_KINDS.get(name)
        if kind.match is not None and not isinstance(module, type) and kind.match(module):
            return kind
        for base in kind.classes:
            if base in cls.__mro__ and cls.__mro__.index(base) < depth:
                best, depth = kind, cls.__mro__.index(base)
    return best


def is_kind(module: nn.Module | type, test: Callable[[LayerKind], Any]) -> bool:
    """Whether ``module`` is of a kind for which ``test(kind)`` holds."""
    kind = kind_of(module)
    return kind is not None and bool(test(kind))


def classes_where(test: Callable[[LayerKind], Any]) -> tuple[type, ...]:
    """Every class of every kind for which ``test(kind)`` holds (for ``isinstance``; read it
    at use time, so kinds registered later count)."""
    return tuple(cls for name in LAYER_KINDS for cls in LAYER_KINDS.get(name).classes if test(LAYER_KINDS.get(name)))


def weight_axis_of(module: nn.Module, attribute: str = "weight") -> int:
    """The output-channel axis of ``module``'s ``attribute``: the kind's for its ``weight``, 0
    otherwise (an LSTM's ``weight_ih_l0``: rows are outputs)."""
    kind = kind_of(module) if attribute == "weight" else None
    return kind.output_axis if kind is not None and kind.output_axis is not None else 0


def input_axis_of(module: nn.Module) -> int:
    """The axis of ``module``'s weight holding its input channels (1 unless the kind says otherwise)."""
    kind = kind_of(module)
    return kind.input_axis if kind is not None and kind.input_axis is not None else 1


def is_hf_conv1d(module: nn.Module) -> bool:
    """Hugging Face's ``Conv1D`` (GPT-2 and relatives): a linear layer with a transposed weight
    of shape ``(in_features, out_features)``."""
    cls = type(module)
    return cls.__name__ == "Conv1D" and cls.__module__.startswith("transformers")


def _conv_args(module: nn.Module) -> dict[str, Any]:
    return {
        "in_channels": module.in_channels,
        "out_channels": module.out_channels,
        "kernel_size": list(module.kernel_size),
        "stride": list(module.stride),
        "padding": module.padding if isinstance(module.padding, str) else list(module.padding),
        "dilation": list(module.dilation),
        "groups": module.groups,
        "bias": module.bias is not None,
        "padding_mode": module.padding_mode,
    }


def _attributes(module: nn.Module, *names: str) -> dict[str, Any]:
    """``{name: module.name}``: the constructor arguments a layer keeps as attributes of the same name."""
    return {name: getattr(module, name) for name in names}


def _embedding_args(module: nn.Embedding) -> dict[str, Any]:
    return _attributes(
        module,
        "num_embeddings",
        "embedding_dim",
        "padding_idx",
        "max_norm",
        "norm_type",
        "scale_grad_by_freq",
        "sparse",
    )


def _batchnorm_args(module: nn.Module) -> dict[str, Any]:
    return _attributes(module, "num_features", "eps", "momentum", "affine", "track_running_stats")


def _groupnorm_args(module: nn.GroupNorm) -> dict[str, Any]:
    return _attributes(module, "num_groups", "num_channels", "eps", "affine")


def _layernorm_args(module: nn.LayerNorm) -> dict[str, Any]:
    return {
        "normalized_shape": list(module.normalized_shape),
        "eps": module.eps,
        "elementwise_affine": module.elementwise_affine,
        "bias": module.bias is not None,
    }


def _rmsnorm_args(module: nn.RMSNorm) -> dict[str, Any]:
    return {
        "normalized_shape": list(module.normalized_shape),
        "eps": module.eps,
        "elementwise_affine": module.elementwise_affine,
    }


def _linear_args(module: nn.Linear) -> dict[str, Any]:
    return {"in_features": module.in_features, "out_features": module.out_features, "bias": module.bias is not None}


def _register_builtins() -> None:
    """The kinds torch and transformers ship. Conv3d: quantized, pruned, folded, shrunk and
    exported like Conv1d/2d, but not seen by the second-order methods (``F.unfold`` is 2-d);
    a transposed convolution holds outputs on weight axis 1 and is quantized only."""
    linear = {"output_axis": 0, "input_axis": 1, "activation_axis": -1, "default": True, "hessian": True}
    register_layer_kind(LayerKind("linear", (nn.Linear,), describe=_linear_args, **linear))
    register_layer_kind(LayerKind("hf_conv1d", (), **{**linear, "output_axis": 1, "input_axis": 0}, match=is_hf_conv1d))
    conv = {"output_axis": 0, "input_axis": 1, "activation_axis": 1, "convolution": True, "default": True}
    for cls, second_order in ((nn.Conv1d, True), (nn.Conv2d, True), (nn.Conv3d, False)):
        register_layer_kind(
            LayerKind(cls.__name__.lower(), (cls,), hessian=second_order, foldable=True, describe=_conv_args, **conv)
        )
    transposed = {**conv, "output_axis": 1, "input_axis": 0, "default": False}
    for cls in (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d):
        register_layer_kind(LayerKind(cls.__name__.lower(), (cls,), **transposed))
    register_layer_kind(LayerKind("embedding", (nn.Embedding,), output_axis=0, describe=_embedding_args))
    batch_norms = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)
    norm = {"normalises": "channel", "describe": _batchnorm_args}
    register_layer_kind(LayerKind("batch_norm", batch_norms, **norm))
    register_layer_kind(
        LayerKind("group_norm", (nn.GroupNorm,), **{**norm, "normalises": "group", "describe": _groupnorm_args})
    )
    features = {"normalises": "features"}
    register_layer_kind(LayerKind("layer_norm", (nn.LayerNorm,), describe=_layernorm_args, **features))
    register_layer_kind(LayerKind("rms_norm", (nn.RMSNorm,), describe=_rmsnorm_args, **features))


_register_builtins()


def describe_layer(module: nn.Module) -> dict[str, Any] | None:
    """The class and constructor arguments that rebuild ``module`` at its shape (None: its kind
    does not say)."""
    kind = kind_of(module)
    if kind is None or kind.describe is None:
        return None
    return {"class": f"{type(module).__module__}.{type(module).__qualname__}", "args": kind.describe(module)}


def channel_axis(module: nn.Module, axis: str, name: str, field: str) -> int:
    """The kind's ``axis`` (``"output_axis"``, ``"activation_axis"``) for ``module``; a one-line
    error naming the kinds that have one when its kind has none (per-channel cannot apply)."""
    kind = kind_of(module)
    found = getattr(kind, axis) if kind is not None else None
    if found is not None:
        return found
    allowed = ", ".join(sorted(_names_where(lambda k: getattr(k, axis) is not None)))
    raise ConfigError(
        f"{field}.per_channel",
        True,
        f"{name} ({type(module).__name__}) has no channel axis; per-channel works on {allowed}",
    )


def _names_where(test: Callable[[LayerKind], Any]) -> set[str]:
    """The class names of the kinds for which ``test`` holds (a kind matched otherwise: its name)."""
    kinds = [LAYER_KINDS.get(name) for name in LAYER_KINDS]
    return {c.__name__ for k in kinds if test(k) for c in k.classes} | {
        k.name for k in kinds if test(k) and k.match is not None
    }
