"""Which channels of a model are coupled: traced from one forward on example inputs.

Every output channel of a Conv/Linear layer is a *slot*; ops that combine tensors element by
element (residual adds, multiplications, activations), normalisation layers and depthwise
convolutions tie the slots of their inputs together (union-find), ``cat`` along the channel
axis concatenates slot lists, and ``flatten`` spreads a channel over its spatial positions.
Each layer that reads a tensor records which slot each of its input channels carries. The
trace runs under ``no_grad`` with module hooks for layers and a ``TorchFunctionMode`` for the
functions called between them, so frozen parameters, modules called more than once and
tuple/dict outputs are fine. Anything it does not understand *freezes* the slots involved:
they are never removed (a channel that reaches the model's outputs is frozen too, so output
shapes stay). Nothing here changes the model.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from surgery.core._compat import module_has_hooks, tree_leaves
from surgery.core.inputs import Call, evaluating, flatten_tensors
from surgery.core.layer_kinds import is_kind
from surgery.core.routing import routed_as
from surgery.ops.shrink.coupling import AttentionHeads, Channels, ChannelTrace, LayerChannels, Slots
from surgery.ops.shrink.experts import couple_expert, is_expert
from surgery.ops.shrink.following import (
    couple_heads,
    indexed_axis,
    kept_axis,
    moved_axis,
    read_axis,
    union_groups,
)
from surgery.ops.shrink.heads import head_counts, layout_of
from surgery.ops.shrink.smaller import is_norm, rebuildable

PASSTHROUGH = (
    nn.ReLU,
    nn.ReLU6,
    nn.GELU,
    nn.SiLU,
    nn.Hardswish,
    nn.Hardsigmoid,
    nn.Sigmoid,
    nn.Tanh,
    nn.LeakyReLU,
    nn.ELU,
    nn.Mish,
    nn.Dropout,
    nn.Dropout2d,
    nn.Identity,
    nn.MaxPool1d,
    nn.MaxPool2d,
    nn.AvgPool1d,
    nn.AvgPool2d,
    nn.AdaptiveAvgPool1d,
    nn.AdaptiveAvgPool2d,
    nn.AdaptiveMaxPool2d,
)
ELEMENTWISE = {
    "add",
    "sub",
    "mul",
    "div",
    "__add__",
    "__radd__",
    "__iadd__",
    "__sub__",
    "__rsub__",
    "__isub__",
    "__mul__",
    "__rmul__",
    "__imul__",
    "__truediv__",
    "__itruediv__",
    "add_",
    "mul_",
    "relu",
    "relu_",
    "gelu",
    "silu",
    "sigmoid",
    "tanh",
    "hardswish",
    "hardsigmoid",
    "relu6",
    "dropout",
    "clamp",
    "clamp_",
    "neg",
    "leaky_relu",
    "elu",
    "mish",
    "hardtanh",
    "hardtanh_",
    "contiguous",
    "clone",
    "detach",
}
SPATIAL = {
    "adaptive_avg_pool1d",
    "adaptive_avg_pool2d",
    "adaptive_max_pool2d",
    "max_pool1d",
    "max_pool2d",
    "avg_pool1d",
    "avg_pool2d",
    "interpolate",
    "max_pool2d_with_indices",
}
IGNORED = {
    "size",
    "dim",
    "shape",
    "__get__",
    "numel",
    "__len__",
    "__getattribute__",
    "is_floating_point",
    "__format__",
    "__repr__",
    "__bool__",
    "item",
    "__index__",
    "requires_grad_",
}
CASTS = {"to", "float", "double", "half", "bfloat16", "type", "cpu", "cuda"}  # same values, maybe another dtype


def _convolution(module: nn.Module) -> bool:
    return is_kind(module, lambda kind: kind.convolution)


def _is_depthwise(module: nn.Module) -> bool:
    return _convolution(module) and module.groups > 1 and module.groups == module.in_channels == module.out_channels


class _Op(NamedTuple):
    """One torch call seen by the tracer: its name, arguments, result, flat operands and the
    operands whose channels are known."""

    name: str
    args: tuple
    kwargs: dict
    result: Tensor
    flat: list
    tracked: list[tuple[Tensor, Channels]]


class _Tracer(TorchFunctionMode):
    """Follows channel slots through the functions called outside the traced layers."""

    def __init__(
        self,
        trace: ChannelTrace,
        known: dict[int, Channels],
        alive: list[Tensor],
        parameters: dict[int, tuple[str, str]],
    ) -> None:
        super().__init__()
        self.trace, self.known, self.depth, self.alive = trace, known, 0, alive
        self.parameters = parameters  # parameters of modules that are not traced layers: id -> (module, name)

    def _track(self, tensor: Tensor, channels: Channels) -> None:
        """Record ``tensor``'s channels, keeping it alive: a freed tensor's id is reused."""
        self.alive.append(tensor)
        self.known[id(tensor)] = channels

    def __torch_function__(self, func: Callable, types: tuple, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if self.depth == 0:
            self._follow(getattr(func, "__name__", str(func)), args, kwargs, result)
        return result

    def _follow(self, name: str, args: tuple, kwargs: dict, result: Any) -> None:
        flat = tree_leaves((args, kwargs))
        if name not in ELEMENTWISE | IGNORED:  # a parameter used other than element-wise cannot be sliced
            self.trace.unsliceable.update(self.parameters[id(t)] for t in flat if id(t) in self.parameters)
        tracked = [(t, self.known[id(t)]) for t in flat if isinstance(t, Tensor) and id(t) in self.known]
        if not tracked or name in IGNORED:
            return
        if name in CASTS:  # a cast keeps channels; ``type()`` without a dtype returns a string
            if isinstance(result, Tensor) and result.shape == tracked[0][0].shape:
                self._track(result, tracked[0][1])
            return
        op = _Op(name, args, kwargs, result, flat, tracked)
        if not isinstance(result, Tensor) or not any(follow(self, op) for follow in _FOLLOWERS):
            self._freeze(name, [info for _, info in tracked])

    def _elementwise(self, op: _Op) -> bool:
        """An element-wise or spatial op keeps channels; operands' channels are coupled."""
        if op.name not in ELEMENTWISE | SPATIAL:
            return False
        first, channels = op.tracked[0]
        if op.name in ELEMENTWISE and not self._couple_operands(op, channels):
            return True
        if op.result.dim() == first.dim() and op.result.shape[channels.dim] == len(channels.slots):
            self._track(op.result, Channels(channels.slots, channels.dim))
            return True
        return False

    def _couple_operands(self, op: _Op, channels: Channels) -> bool:
        """Couple the channels of every operand of an element-wise op; False once frozen."""
        slots = self.trace.slots
        for _, other in op.tracked[1:]:
            if other.dim != channels.dim or len(other.slots) != len(channels.slots):
                self._freeze(op.name, [channels, other])
                return False
            for a, b in zip(channels.slots, other.slots):
                slots.union(a, b)
        for tensor in op.flat:  # an untracked operand with full channels: a parameter sliced, or unknown
            if not isinstance(tensor, Tensor) or id(tensor) in self.known:
                continue
            axis = channels.dim - (op.result.dim() - tensor.dim())  # broadcasting aligns the last axes
            if 0 <= axis < tensor.dim() and tensor.shape[axis] == len(channels.slots) > 1:
                owner = self.parameters.get(id(tensor))
                if owner is None:
                    self._freeze(op.name, [channels])
                    return False
                sliced = self.trace.parameters.setdefault(owner, Channels([], axis))
                if sliced.dim != axis:
                    self.trace.unsliceable.add(owner)
                elif not sliced.slots:
                    sliced.slots.extend(channels.slots)
                for a, b in zip(sliced.slots, channels.slots):
                    slots.union(a, b)
        return True

    def _concatenated(self, op: _Op) -> bool:
        """``cat`` along the channel axis joins the operands' channels."""
        if op.name not in {"cat", "concat"}:
            return False
        channels = op.tracked[0][1]
        dim = op.kwargs.get("dim", op.args[1] if len(op.args) > 1 else 0) % op.result.dim()
        if dim != channels.dim:
            return False
        joined: list[int] = []
        for tensor in op.args[0]:
            info = self.known.get(id(tensor))
            if info is None or info.dim != dim:
                fresh = self.trace.slots.new(tensor.shape[dim])
                self.trace.slots.freeze(fresh)
                joined += fresh
            else:
                joined += info.slots
        self._track(op.result, Channels(joined, dim))
        return True

    def _moved(self, op: _Op) -> bool:
        """Permutes, transposes and indexing that move the channel axis whole."""
        first, channels = op.tracked[0]
        if first is not op.args[0]:
            return False
        if op.name == "__getitem__":
            moved = indexed_axis(op.args[1], first, channels.dim)
            moved = moved % op.result.dim() if moved is not None and op.result.dim() else moved
        else:
            moved = moved_axis(op.name, op.args, op.kwargs, first, channels.dim)
        if moved is not None and op.result.shape[moved] == len(channels.slots):
            self._track(op.result, Channels(channels.slots, moved))
            return True
        return False

    def _reshaped(self, op: _Op) -> bool:
        """Reshapes that keep the channel axis, or flatten (N, C, ...) into (N, C × spatial)."""
        if op.name not in {"flatten", "view", "reshape", "unflatten"}:
            return False
        first, channels = op.tracked[0]
        kept = kept_axis(first, op.result, channels.dim) if first is op.args[0] else None
        if kept is not None:
            self._track(op.result, Channels(channels.slots, kept))
            return True
        if (
            op.name != "unflatten"
            and channels.dim == 1
            and op.result.dim() == 2
            and first.dim() > 2
            and op.result.shape[0] == first.shape[0]
        ):
            spread = first.shape[2:].numel()
            self._track(op.result, Channels([s for s in channels.slots for _ in range(spread)], 1))
            return True
        return False

    def _reduced(self, op: _Op) -> bool:
        """Reductions over other axes keep the channels."""
        if op.name not in {"mean", "sum", "amax"}:
            return False
        first, channels = op.tracked[0]
        dims = op.kwargs.get("dim", op.args[1] if len(op.args) > 1 else None)
        dims = [dims] if isinstance(dims, int) else list(dims or [])
        keep = op.kwargs.get("keepdim", op.args[2] if len(op.args) > 2 else False)
        dims = [d % first.dim() for d in dims]
        if not dims or channels.dim in dims:
            return False
        new_dim = channels.dim if keep else channels.dim - sum(d < channels.dim for d in dims)
        self._track(op.result, Channels(channels.slots, new_dim))
        return True

    def _freeze(self, name: str, infos: list[Channels]) -> None:
        for info in infos:
            self.trace.slots.freeze(info.slots)
        if name not in self.trace.unknown:
            self.trace.unknown.append(name)


_FOLLOWERS = (_Tracer._elementwise, _Tracer._concatenated, _Tracer._moved, _Tracer._reshaped, _Tracer._reduced)


def trace_channels(model: nn.Module, example: Call) -> ChannelTrace:
    """Run ``model`` once on ``example`` (eval mode, no grad) and return the coupled channels."""
    trace = ChannelTrace(Slots())
    shared: dict[int, int] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            shared[id(param)] = shared.get(id(param), 0) + 1
    loose = {
        id(param): (name, attr)
        for name, module in model.named_modules()
        if not _traced(module)
        for attr, param in module.named_parameters(recurse=False)
    }
    layers = _LayerHooks(trace, _Tracer(trace, {}, [], loose))
    known = layers.known
    with layers.installed(model), evaluating(model), torch.no_grad(), routed_as("trace"), layers.tracer:
        output = example(model)
    layers.keep_alive.append(output)
    for layer in trace.layers.values():  # a weight tied to another module's (an LM head) cannot be resized alone
        if any(shared.get(id(p), 0) > 1 for p in layer.module.parameters(recurse=False)):
            trace.slots.freeze((layer.inputs or []) + (layer.outputs or []))
    for owner in trace.unsliceable & set(trace.parameters):
        trace.slots.freeze(trace.parameters.pop(owner).slots)
    trace.output_shapes = output_shapes(output)
    for tensor in _leaves(output):
        if isinstance(tensor, Tensor) and id(tensor) in known:
            trace.slots.freeze(known[id(tensor)].slots)
    return trace


class _LayerHooks:
    """The forward hooks of one trace: each traced layer's input channels are coupled across
    its calls, and its output gets fresh channels (or its input's, for norms and depthwise)."""

    def __init__(self, trace: ChannelTrace, tracer: _Tracer) -> None:
        self.trace, self.tracer = trace, tracer
        self.known, self.keep_alive = tracer.known, tracer.alive  # ids must stay unique while the trace runs
        self.heads: dict[str, AttentionHeads] = {}
        self.experts: dict[str, nn.Module] = {}  # experts of mixture-of-experts layers, traced as units
        self.calls: list[Channels | None] = []  # the input of each traced call in progress (a module may nest)
        self.axes: list[int | None] = []  # and the channel axis its layer reads

    @contextlib.contextmanager
    def installed(self, model: nn.Module) -> Iterator[None]:
        """The hooks on every module of ``model``, removed on exit (last first)."""
        hooks = []
        traced = {name for name, module in model.named_modules() if _traced(module)}  # before hooks are added
        try:
            for name, module in model.named_modules():
                hooks.append(module.register_forward_pre_hook(functools.partial(self.entered, name)))
                layout = layout_of(module)
                counts = head_counts(module, layout) if layout is not None else None
                if counts is not None:
                    self.heads[name] = AttentionHeads(name, module, layout, counts)
                if is_expert(module):
                    self.experts[name] = module
                if name in traced or counts is not None or name in self.experts:
                    hooks.append(
                        module.register_forward_pre_hook(functools.partial(self.before, name), with_kwargs=True)
                    )
                    hooks.append(module.register_forward_hook(functools.partial(self.after, name)))
            yield
        finally:
            for hook in reversed(hooks):
                hook.remove()

    def entered(self, name: str, module: nn.Module, args: tuple) -> None:
        info = self.known.get(id(args[0])) if args and isinstance(args[0], Tensor) else None
        if info is not None:
            self.trace.module_inputs.setdefault(name, []).extend(info.slots)

    def before(self, name: str, module: nn.Module, args: tuple, kwargs: dict) -> None:
        trace = self.trace
        self.tracer.depth += 1
        x = args[0] if args and isinstance(args[0], Tensor) else None
        info = self.known.get(id(x)) if x is not None else None
        self.calls.append(info)
        if (
            isinstance(module, PASSTHROUGH) or name in self.heads or name in self.experts
        ):  # no parameters: each call passes its own input's channels
            self.axes.append(None)
            return
        layer = trace.layers.setdefault(name, LayerChannels(name, module))
        axis = read_axis(module, x)
        self.axes.append(axis)
        if info is not None and (axis is None or info.dim != axis):
            trace.slots.freeze(info.slots)
            info = None
        if info is not None:
            if layer.inputs is None:
                layer.inputs = list(info.slots)
            elif len(layer.inputs) == len(info.slots):
                for a, b in zip(layer.inputs, info.slots):
                    trace.slots.union(a, b)

    def after(self, name: str, module: nn.Module, args: tuple, output: Any) -> None:
        self.tracer.depth -= 1
        info, axis = self.calls.pop(), self.axes.pop()
        if name in self.heads:
            couple_heads(self.trace, self.heads[name], output, self.known, self.keep_alive)
        elif name in self.experts:
            couple_expert(self.trace, name, module)
        elif isinstance(module, PASSTHROUGH):
            self._passed(info, output)
        elif not isinstance(output, Tensor):
            inputs = self.trace.layers[name].inputs
            if inputs is not None:
                self.trace.slots.freeze(inputs)
        else:
            self.keep_alive.append(output)
            self._produced(self.trace.layers[name], module, axis, output)

    def _passed(self, info: Channels | None, output: Any) -> None:
        """A module without parameters passes its input's channels on, or freezes them."""
        if (
            info is not None
            and isinstance(output, Tensor)
            and output.dim() > info.dim
            and output.shape[info.dim] == len(info.slots)
        ):
            self.keep_alive.append(output)
            self.known[id(output)] = Channels(info.slots, info.dim)
        elif info is not None:
            self.trace.slots.freeze(info.slots)

    def _produced(self, layer: LayerChannels, module: nn.Module, axis: int | None, output: Tensor) -> None:
        """A traced layer's output channels: its inputs' (norms, depthwise) or its own."""
        trace = self.trace
        if is_norm(module) or _is_depthwise(module):
            layer.passthrough = True
            if (
                layer.inputs is not None
                and axis is not None
                and output.dim() > axis
                and output.shape[axis] == len(layer.inputs)
            ):
                self.known[id(output)] = Channels(layer.inputs, axis)
                layer.outputs = layer.inputs
                if isinstance(module, nn.GroupNorm):  # statistics per group: whole groups go together
                    union_groups(trace.slots, layer.inputs, module.num_groups)
            return
        # channels on the last axis: a matrix-like kind, or an embedding (its input holds indices)
        last = is_kind(module, lambda kind: kind.activation_axis == -1) or isinstance(module, nn.Embedding)
        channels = output.shape[-1 if last else 1]
        layer.positions += output.numel() // max(channels, 1)
        if layer.outputs is None:
            layer.outputs = trace.slots.new(channels)
        if _convolution(module) and module.groups > 1:
            if layer.inputs is None:  # whole groups must go, with their inputs: unknown inputs freeze
                trace.slots.freeze(layer.outputs)
            else:  # a group's inputs and outputs are one unit: removed together, groups shrink
                union_groups(
                    trace.slots,
                    layer.inputs + layer.outputs,
                    module.groups,
                    sizes=(len(layer.inputs) // module.groups, len(layer.outputs) // module.groups),
                )
        self.known[id(output)] = Channels(layer.outputs, output.dim() - 1 if last else 1)


def _leaves(output: Any) -> list[Tensor]:
    return flatten_tensors(output, floating_only=False)


def output_shapes(output: Any) -> list[tuple[int, ...]]:
    """The shapes of every tensor in a model's output (tuples, dicts, ``ModelOutput``)."""
    return [tuple(t.shape) for t in _leaves(output) if isinstance(t, Tensor)]


def replaceable(module: nn.Module) -> bool:
    """A layer shrink may replace by a smaller one: a rebuildable class, with no hooks (a user's
    forward hook, legacy ``weight_norm``) and no parametrizations, which a new layer would lose."""
    hooked = module_has_hooks(module)
    if hooked or hasattr(module, "parametrizations"):
        return False
    return rebuildable(type(module)) or is_norm(module)  # a norm of another constructor: resized in place


def _traced(module: nn.Module) -> bool:
    return isinstance(module, PASSTHROUGH) or replaceable(module)
