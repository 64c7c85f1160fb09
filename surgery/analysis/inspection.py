"""Whole-model inspection: every module call's shapes, dtypes, parameters and wall time, and
per-layer gradient statistics (norms and each layer's share of the loss sensitivity)."""

from __future__ import annotations

import contextlib
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.modules import module as module_globals

from surgery.core._compat import full_backward_hook_flag, set_full_backward_hook_flag
from surgery.core.inputs import Inputs, batches, evaluating, flatten_tensors, run_backward_batches

Shape = tuple[int, ...]


@dataclass
class ModuleCall:
    """One call of one module of the inspected model.

    ``name`` is the qualified name (``""`` for the root), ``depth`` the number of enclosing
    module calls, ``ms`` the wall time from the forward-pre hook to the forward hook (``None``
    if the call raised). Shapes and dtypes cover the tensors among the positional inputs and
    every tensor in the output (nested tuples, lists and dicts included).
    """

    name: str
    type: str
    depth: int
    batch: int
    input_shapes: list[Shape] = field(default_factory=list)
    input_dtypes: list[str] = field(default_factory=list)
    output_shapes: list[Shape] = field(default_factory=list)
    output_dtypes: list[str] = field(default_factory=list)
    params_own: int = 0
    params_total: int = 0
    ms: float | None = None


def _describe(tensors: list[Tensor]) -> tuple[list[Shape], list[str]]:
    return [tuple(t.shape) for t in tensors], [str(t.dtype).removeprefix("torch.") for t in tensors]


class _Tracer:
    """The global hooks' state: which modules belong to the model, the open calls, the log."""

    def __init__(self, model: nn.Module) -> None:
        self.names = {id(m): name for name, m in model.named_modules()}
        self.modules = {id(m) for m in model.modules()}
        self.params = {
            id(m): (sum(p.numel() for p in m.parameters(recurse=False)), sum(p.numel() for p in m.parameters()))
            for m in model.modules()
        }
        self.thread = threading.get_ident()
        self.calls: list[ModuleCall] = []
        self.open: list[tuple[int, ModuleCall, float]] = []  # (module id, record, start)
        self.batch = 0

    def mine(self, module: nn.Module) -> bool:
        """Only modules of the inspected model, run from the thread that inspects it."""
        return id(module) in self.modules and threading.get_ident() == self.thread

    def pre_hook(self, module: nn.Module, args: tuple) -> None:
        if not self.mine(module):
            return
        own, total = self.params[id(module)]
        shapes, dtypes = _describe([a for a in args if isinstance(a, Tensor)])
        call = ModuleCall(
            self.names.get(id(module), ""),
            type(module).__name__,
            len(self.open),
            self.batch,
            shapes,
            dtypes,
            params_own=own,
            params_total=total,
        )
        self.calls.append(call)
        self.open.append((id(module), call, time.perf_counter()))

    def hook(self, module: nn.Module, args: tuple, output: Any) -> None:
        if not self.mine(module):
            return
        while self.open:  # frames of calls that raised inside this one are skipped
            key, call, start = self.open.pop()
            if key == id(module):
                call.ms = (time.perf_counter() - start) * 1000.0
                call.output_shapes, call.output_dtypes = _describe(flatten_tensors(output, floating_only=False))
                return


@contextlib.contextmanager
def _global_hooks(tracer: _Tracer) -> Iterator[None]:
    """Install the global forward-pre and forward hooks for the block only."""
    pre = module_globals.register_module_forward_pre_hook(tracer.pre_hook)
    try:
        post = module_globals.register_module_forward_hook(tracer.hook)
        try:
            yield
        finally:
            post.remove()
    finally:
        pre.remove()


def inspect_model(model: nn.Module, inputs: Inputs) -> list[ModuleCall]:
    """Run ``model`` on ``inputs`` and record every module call, in call order.

    Torch's global forward hooks see every module call in the process, so they are installed
    only for the duration of this function and ignore any module that is not part of
    ``model`` or that runs in another thread: a reference copy or another model running
    meanwhile is not recorded. The model runs in eval mode under ``torch.no_grad()``; its
    training flags are put back afterwards. If the model raises, the hooks are removed and
    the error propagates.

    Args:
        model: the model to inspect.
        inputs: one input tensor, or an iterable of batches (each batch's calls are recorded,
            with its index in ``ModuleCall.batch``).

    Example:
        >>> calls = inspect_model(torchvision.models.resnet18(), torch.randn(1, 3, 224, 224))
        >>> print(format_table(calls))
    """
    tracer = _Tracer(model)
    with _global_hooks(tracer), evaluating(model), torch.no_grad():
        for index, batch in enumerate(batches(inputs)):
            tracer.batch = index
            tracer.open.clear()
            batch(model)
    return tracer.calls


def _shapes(shapes: list[Shape]) -> str:
    return ", ".join(str(list(s)) for s in shapes) or "--"


def format_table(calls: list[ModuleCall]) -> str:
    """A torchinfo-like text table: one aligned row per call, names indented by depth.

    Example:
        >>> print(format_table(inspect_model(model, x)))
        Layer         Type    Input shape  Output shape  Params  ms
        (root)        MLP     [2, 8]       [2, 4]        0       0.081
          fc1         Linear  [2, 8]       [2, 16]       144     0.020
    """
    header = ("Layer", "Type", "Input shape", "Output shape", "Params", "ms")
    rows = [
        (
            "  " * c.depth + (c.name or "(root)"),
            c.type,
            _shapes(c.input_shapes),
            _shapes(c.output_shapes),
            f"{c.params_own:,}",
            "--" if c.ms is None else f"{c.ms:.3f}",
        )
        for c in calls
    ]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    right = {4, 5}  # numbers align right

    def line(row: tuple[str, ...]) -> str:
        cells = [cell.rjust(w) if i in right else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths))]
        return "  ".join(cells).rstrip()

    rule = "-" * len(line(tuple("-" * w for w in widths)))
    roots = [c for c in calls if c.depth == 0]
    total_params = max((c.params_total for c in roots), default=0)
    total_ms = sum(c.ms for c in roots if c.ms is not None)
    footer = f"{len(calls)} calls, {total_params:,} parameters, {total_ms:.3f} ms"
    return "\n".join([line(header), rule, *(line(r) for r in rows), rule, footer])


def calls_as_rows(calls: list[ModuleCall]) -> list[dict[str, Any]]:
    """The calls as JSON-ready dicts (shapes as lists).

    Example:
        >>> json.dumps(calls_as_rows(inspect_model(model, x)))
    """
    return [
        {
            "name": c.name,
            "type": c.type,
            "depth": c.depth,
            "batch": c.batch,
            "input_shapes": [list(s) for s in c.input_shapes],
            "input_dtypes": list(c.input_dtypes),
            "output_shapes": [list(s) for s in c.output_shapes],
            "output_dtypes": list(c.output_dtypes),
            "params_own": c.params_own,
            "params_total": c.params_total,
            "ms": c.ms,
        }
        for c in calls
    ]


@dataclass
class LayerGradients:
    """Gradient statistics of one module over the batches: the root-mean-square over batches of
    ‖∂L/∂output‖ and of ‖∂L/∂w‖ (its own parameters), ``sensitivity`` Σ |w · ∂L/∂w| (the
    first-order loss change if its parameters were removed) and ``share`` of the model's total."""

    name: str
    type: str
    grad_output_norm: float | None
    weight_grad_norm: float | None
    sensitivity: float | None
    share: float | None


class _GradientTracer:
    """State of the scoped global backward hooks: only modules of the inspected model, only
    backward passes run by the inspecting thread."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.names = {id(m): name for name, m in model.named_modules()}
        self.thread = threading.get_ident()
        self.output_sq: dict[str, float] = {}
        self.weight_sq: dict[str, float] = {}
        self.sensitivity: dict[str, float] = {}
        self.passes = 0

    def mine(self, module: nn.Module) -> bool:
        return id(module) in self.names and threading.get_ident() == self.thread

    def record(self, name: str, grad: Tensor | None) -> None:
        if grad is not None:
            self.output_sq[name] = self.output_sq.get(name, 0.0) + float(grad.detach().double().square().sum())

    def backward_hook(self, module: nn.Module, grad_input: tuple, grad_output: tuple) -> None:
        if self.mine(module):
            self.record(self.names[id(module)], next((g for g in grad_output if g is not None), None))

    def forward_hook(self, module: nn.Module, args: tuple, output: Any) -> None:
        """The fallback: a tensor hook on the output's gradient (no view wrapping)."""
        if not self.mine(module) or not torch.is_grad_enabled():
            return
        tensor = next((t for t in flatten_tensors(output) if t.requires_grad), None)
        if tensor is not None:
            name = self.names[id(module)]
            tensor.register_hook(lambda grad: self.record(name, grad))

    def weights(self) -> None:
        """After each backward: each module's own parameters' gradients."""
        self.passes += 1
        for _module_id, name in self.names.items():
            module = self.model.get_submodule(name) if name else self.model
            for param in module.parameters(recurse=False):
                if param.grad is not None:
                    grad, weight = param.grad.detach().double(), param.detach().double()
                    self.weight_sq[name] = self.weight_sq.get(name, 0.0) + float(grad.square().sum())
                    self.sensitivity[name] = self.sensitivity.get(name, 0.0) + float((weight * grad).abs().sum())

    def rows(self, model: nn.Module) -> list[LayerGradients]:
        total = sum(self.sensitivity.values())
        rows = []
        for name, module in model.named_modules():
            if name not in self.output_sq and name not in self.weight_sq:
                continue
            rms = {
                key: (table[name] / self.passes) ** 0.5 if name in table else None
                for key, table in (("out", self.output_sq), ("w", self.weight_sq))
            }
            sensitivity = self.sensitivity.get(name)
            rows.append(
                LayerGradients(
                    name,
                    type(module).__name__,
                    rms["out"],
                    rms["w"],
                    sensitivity,
                    sensitivity / total if sensitivity is not None and total > 0 else None,
                )
            )
        return rows


BACKWARD_HOOKS = "global full backward hooks"
TENSOR_HOOKS = "tensor hooks on module outputs (the model edits outputs in place, which full backward hooks forbid)"


def gradient_statistics(
    model: nn.Module, pairs: Iterable, loss: Callable[[Any, Any], Tensor], *, progress: bool = False
) -> tuple[list[LayerGradients], str]:
    """Per-module gradient statistics over ``(inputs, target)`` pairs, and how they were taken.

    Torch's global full backward hooks are installed for the call only and ignore modules of
    other models and backward passes of other threads, as :func:`inspect_model` does for the
    forward. A model that edits a module's output in place (``ReLU(inplace=True)``, ResNet's
    ``out += identity``) cannot run under full backward hooks; it is measured again with
    tensor hooks on the outputs instead (the same gradients), and the second value says so.
    Parameters' ``.grad`` and training flags are left as they were.
    """
    pairs = list(pairs)
    tracer = _GradientTracer(model)
    flag = full_backward_hook_flag()
    hook = module_globals.register_module_full_backward_hook(tracer.backward_hook)
    try:
        with warnings.catch_warnings():  # inputs need no gradient here: the hooks still see grad_output
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            run_backward_batches(
                model, pairs, loss, field="inspect.gradients", progress=progress, after_each=tracer.weights
            )
        return tracer.rows(model), BACKWARD_HOOKS
    except RuntimeError as err:
        if "inplace" not in str(err).replace("in-place", "inplace"):
            raise
    finally:
        hook.remove()
        set_full_backward_hook_flag(flag)  # torch leaves it set, and would refuse a later non-full global hook
    tracer = _GradientTracer(model)
    hook = module_globals.register_module_forward_hook(tracer.forward_hook)
    try:
        run_backward_batches(
            model, pairs, loss, field="inspect.gradients", progress=progress, after_each=tracer.weights
        )
    finally:
        hook.remove()
    return tracer.rows(model), TENSOR_HOOKS


def gradients_as_rows(rows: list[LayerGradients]) -> list[dict[str, Any]]:
    """JSON-ready dicts of :func:`gradient_statistics` rows."""
    return [vars(row) for row in rows]
