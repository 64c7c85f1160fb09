"""``surgery.capture``: record what selected layers receive and return, reduced as it streams.

One primitive behind calibration statistics, criterion statistics and per-layer drift: forward
hooks (outputs) and forward-pre hooks (inputs) on the selected modules feed each layer's
tensor to a *reducer*, one per layer and side, that keeps only what it needs (a list, running
sums, per-feature squared norms, min/max). The hooks belong to a context manager that removes
them in reverse order on exit, also when the block raises.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from surgery.core import compiled, distributed
from surgery.core._compat import CHANNEL_NORMS, CONVOLUTIONS
from surgery.core.errors import ConfigError, ConfigTypeError
from surgery.core.inputs import flatten_tensors
from surgery.core.registry import Registry
from surgery.core.selection import Selection
from surgery.core.selection import select as select_modules

SIDES = ("inputs", "outputs", "weight_grads")


class Reducer(Protocol):
    """Streaming state of one layer's captured tensors: ``update`` per call, ``result`` at the end."""

    def update(self, tensor: Tensor) -> None: ...

    def result(self) -> Any: ...


ReducerFactory = Callable[[str, nn.Module], Reducer]  # (layer name, module) -> a fresh reducer
REDUCTIONS: Registry[ReducerFactory] = Registry("capture.reduce")


def feature_axis(module: nn.Module, tensor: Tensor) -> int:
    """The feature (channel) axis of a layer's activation: 1 for convolutions and batch norms,
    else the last axis (Linear, Hugging Face Conv1D, attention, LayerNorm)."""
    if isinstance(module, CONVOLUTIONS):  # (N, C, *spatial), or unbatched (C, *spatial)
        return 0 if tensor.dim() == len(module.kernel_size) + 1 else 1
    channel_first = (*CHANNEL_NORMS, nn.GroupNorm)
    return 1 if isinstance(module, channel_first) and tensor.dim() >= 2 else tensor.dim() - 1


class Keep:
    """Every call's tensor, detached and cloned (later in-place ops cannot touch it)."""

    def __init__(self, name: str = "", module: nn.Module | None = None) -> None:
        self.tensors: list[Tensor] = []

    def update(self, tensor: Tensor) -> None:
        self.tensors.append(tensor.detach().clone())

    def result(self) -> list[Tensor]:
        return self.tensors


class Sum:
    """Element-wise running sum over calls (float64; every call must have the same shape)."""

    def __init__(self, name: str = "", module: nn.Module | None = None) -> None:
        self.name, self.total = name, None

    def update(self, tensor: Tensor) -> None:
        value = tensor.detach().double()
        if self.total is not None and self.total.shape != value.shape:
            raise ConfigError(
                "capture.reduce",
                "sum",
                f"{self.name} produced shapes {tuple(self.total.shape)} and "
                f"{tuple(value.shape)}; 'sum' needs one shape (use 'sq_norms' or 'keep')",
            )
        self.total = value if self.total is None else self.total + value

    def result(self) -> Tensor | None:
        return self.total


class SquaredNorms:
    """Per-feature sums of squares over every other axis (batch, tokens, pixels), float64, and
    the number of rows summed: ``{"sq_norms": Tensor[features], "rows": int}`` (Wanda's ‖X_j‖²)."""

    def __init__(self, name: str = "", module: nn.Module | None = None) -> None:
        self.name, self.module = name, module
        self.sq_norms: Tensor | None = None
        self.rows = 0

    def update(self, tensor: Tensor) -> None:
        x = tensor.detach().double()
        axis = feature_axis(self.module, x) if self.module is not None else x.dim() - 1
        flat = x.movedim(axis, -1).reshape(-1, x.shape[axis])
        norms = (flat * flat).sum(0)
        if self.sq_norms is not None and self.sq_norms.shape != norms.shape:
            raise ConfigError(
                "capture.reduce",
                "sq_norms",
                f"{self.name} produced {norms.numel()} features after {self.sq_norms.numel()}",
            )
        self.sq_norms = norms if self.sq_norms is None else self.sq_norms + norms
        self.rows += flat.shape[0]

    def result(self) -> dict[str, Any] | None:
        if self.sq_norms is None:
            return None
        return {"sq_norms": distributed.summed(self.sq_norms), "rows": distributed.summed_count(self.rows)}


class MinMax:
    """Running minimum and maximum over every call: ``(min, max)`` as Python floats."""

    def __init__(self, name: str = "", module: nn.Module | None = None) -> None:
        self.low = self.high = None

    def update(self, tensor: Tensor) -> None:
        low, high = tensor.detach().min().item(), tensor.detach().max().item()
        self.low = low if self.low is None else min(self.low, low)
        self.high = high if self.high is None else max(self.high, high)

    def result(self) -> tuple[float, float] | None:
        return None if self.low is None else (self.low, self.high)


def register_reduction(name: str, factory: ReducerFactory, *, replace: bool = False) -> ReducerFactory:
    """Make ``factory(name, module) -> reducer`` available as ``capture(..., reduce=name)``."""
    return REDUCTIONS.register(name, factory, replace=replace)


for _name, _factory in (("keep", Keep), ("sum", Sum), ("sq_norms", SquaredNorms), ("minmax", MinMax)):
    register_reduction(_name, _factory)


class Capture:
    """What :func:`capture` returns: a context manager whose hooks feed one reducer per layer.

    After (or during) the block, :attr:`inputs` and :attr:`outputs` map each selected layer
    that ran to its reducer's result (a layer that never ran is absent).
    """

    def __init__(
        self, model: nn.Module, layers: dict[str, nn.Module], what: tuple[str, ...], reduce: ReducerFactory
    ) -> None:
        self.model, self.layers, self.what, self.reduce = model, layers, what, reduce
        self.reducers: dict[str, dict[str, Reducer]] = {side: {} for side in SIDES}
        self._hooks: list[RemovableHandle] = []
        self._paused = False
        self._entered = False

    @property
    def inputs(self) -> dict[str, Any]:
        return self._results("inputs")

    @property
    def outputs(self) -> dict[str, Any]:
        return self._results("outputs")

    @property
    def weight_grads(self) -> dict[str, Any]:
        """Each layer's ``weight`` gradient, one per backward pass through it (tensor hooks)."""
        return self._results("weight_grads")

    def _results(self, side: str) -> dict[str, Any]:
        if not self._entered:
            raise RuntimeError(
                "capture: nothing was recorded; use it as `with surgery.capture(...) as seen:` "
                "and run the model inside the block"
            )
        return {name: r.result() for name, r in self.reducers[side].items()}

    def clear(self) -> None:
        """Forget everything captured so far (the hooks stay)."""
        for side in SIDES:
            self.reducers[side].clear()

    @contextlib.contextmanager
    def paused(self, paused: bool = True) -> Iterator[None]:
        """Within the block, the hooks record nothing (``paused=False``: they do); e.g. while
        another model sharing these modules runs."""
        before, self._paused = self._paused, paused
        try:
            yield
        finally:
            self._paused = before

    def _feed(self, side: str, name: str, module: nn.Module, value: Any) -> None:
        if self._paused:
            return
        tensors = flatten_tensors(value)
        if not tensors:
            return
        reducer = self.reducers[side].get(name)
        if reducer is None:
            reducer = self.reducers[side][name] = self.reduce(name, module)
        reducer.update(tensors[0])

    def _input_hook(self, name: str) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            self._feed("inputs", name, module, [list(args), kwargs])

        return hook

    def _weight_grad_hook(self, name: str, module: nn.Module) -> Callable:
        def hook(grad: Tensor) -> None:
            self._feed("weight_grads", name, module, grad)

        return hook

    def _output_hook(self, name: str) -> Callable:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            self._feed("outputs", name, module, output)

        return hook

    def __enter__(self) -> Capture:
        if self._hooks:
            raise RuntimeError("capture: this capture is already active; a block cannot be entered twice")
        self._entered = True
        try:
            for name, module in self.layers.items():
                if "inputs" in self.what:
                    self._hooks.append(module.register_forward_pre_hook(self._input_hook(name), with_kwargs=True))
                if "outputs" in self.what:
                    self._hooks.append(module.register_forward_hook(self._output_hook(name)))
                weight = getattr(module, "weight", None)
                if "weight_grads" in self.what and isinstance(weight, nn.Parameter):
                    if not weight.requires_grad:
                        raise ConfigError(
                            "capture.select",
                            name,
                            "its weight does not require a gradient (frozen), "
                            "so no gradient can be captured; unfreeze it or exclude the layer",
                        )
                    self._hooks.append(weight.register_hook(self._weight_grad_hook(name, module)))
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Remove every hook, last installed first (idempotent)."""
        while self._hooks:
            self._hooks.pop().remove()


def capture(
    model: nn.Module,
    *,
    select: Selection = None,
    exclude: Selection = None,
    what: str | Iterable[str] = ("outputs",),
    reduce: str | ReducerFactory = "keep",
) -> Capture:
    """Record the inputs and/or outputs of the selected layers while ``model`` runs.

    Args:
        model: the model to watch (nothing about it changes; the hooks leave with the block).
        select, exclude: the layers (see :func:`surgery.select`); default every submodule.
        what: ``"inputs"`` (a layer's first floating input, positional or keyword),
            ``"outputs"`` (its first floating output: tensor, tuple, dict or ``ModelOutput``),
            ``"weight_grads"`` (the gradient of its ``weight`` at each backward pass, through
            a tensor hook; the block runs the backward), or several of them.
        reduce: how each layer's tensors are kept as they stream: ``"keep"`` (a list of
            clones), ``"sum"``, ``"sq_norms"`` (per-feature sums of squares and the row count),
            ``"minmax"``, another registered name, or a factory ``(name, module) -> reducer``
            whose reducer has ``update(tensor)`` and ``result()``.

    Example:
        >>> with surgery.capture(resnet, select=nn.Conv2d) as seen:
        ...     resnet(images)
        >>> seen.outputs["layer1.0.conv1"][0].shape
        torch.Size([8, 64, 56, 56])
    """
    sides = (what,) if isinstance(what, str) else tuple(what) if isinstance(what, Iterable) else None
    if not sides or any(side not in SIDES for side in sides):
        raise ConfigError("capture.what", what, f"must be one of {', '.join(SIDES)} or a tuple of them")
    if isinstance(reduce, str):
        factory = REDUCTIONS.get(reduce)
    elif callable(reduce):
        factory = reduce
    else:
        raise ConfigTypeError(
            "capture.reduce",
            reduce,
            f"must be one of {', '.join(REDUCTIONS.names())} or a factory (name, module) -> reducer",
        )
    model = compiled.prepare(model)  # a torch.compile wrapper: its model, with dynamo guarding hook dicts
    layers = select_modules(
        model,
        select if select is not None else _every_submodule,
        exclude=exclude,
        field="capture.select",
        exclude_field="capture.exclude",
    )
    return Capture(model, layers, sides, factory)


def _every_submodule(module: nn.Module, name: str) -> bool:
    return bool(name)


class TaylorSaliency:
    """``weight_grads`` reducer: Σ over backward passes of |w ⊙ ∂L/∂w| (first-order Taylor
    importance of each weight entry) and Σ (∂L/∂w)² (the diagonal Fisher information)."""

    def __init__(self, name: str = "", module: nn.Module | None = None) -> None:
        self.weight = module.weight
        self.products: Tensor | None = None
        self.squares: Tensor | None = None
        self.passes = 0

    def update(self, tensor: Tensor) -> None:
        grad = tensor.detach().float()
        product = (self.weight.detach().float() * grad).abs()
        self.products = product if self.products is None else self.products + product
        self.squares = grad.square() if self.squares is None else self.squares + grad.square()
        self.passes += 1

    def result(self) -> dict[str, Any] | None:
        return (
            None if self.products is None else {"taylor": self.products, "grad_sq": self.squares, "passes": self.passes}
        )


register_reduction("taylor", TaylorSaliency)


def input_statistics(model: nn.Module, layers: dict[str, nn.Module], run: Callable[[], None]) -> dict[str, dict]:
    """Per-feature squared norms of each layer's inputs while ``run()`` feeds the model (the
    statistics criteria receive): ``{layer: {"sq_norms": Tensor, "rows": int}}``."""
    with Capture(model, layers, ("inputs",), SquaredNorms) as seen:
        run()
    return seen.inputs


def gradient_statistics(model: nn.Module, layers: dict[str, nn.Module], run: Callable[[], None]) -> dict[str, dict]:
    """Taylor saliency and squared gradients of each layer's weight while ``run()`` runs the
    forward and backward passes: ``{layer: {"taylor", "grad_sq", "passes"}}``."""
    with Capture(model, layers, ("weight_grads",), TaylorSaliency) as seen:
        run()
    return seen.weight_grads


__all__ = [
    "Capture",
    "Keep",
    "MinMax",
    "REDUCTIONS",
    "Reducer",
    "SquaredNorms",
    "Sum",
    "TaylorSaliency",
    "capture",
    "feature_axis",
    "gradient_statistics",
    "input_statistics",
    "torch",
]
