"""Learned rotations for ``surgery.rotate(learn=...)``, as SpinQuant does (Liu et al. 2024):
the residual stream's rotation ``R`` starts as the random Hadamard matrix and is trained on the
calibration batches through the *quantized* forward (weights and layer inputs fake-quantized,
gradients straight through), with Cayley SGD on the Stiefel manifold (Li et al. 2020), so that
``R`` stays orthogonal and still fuses into the weights exactly.

Each step, every reader, writer and embedding of the stream takes its rotated weight as a
function of ``R`` (the same products :func:`~surgery.ops.equivalence.rotation.rotate` fuses,
run through ``torch.func.functional_call``: no parameter of the model changes); only ``R``
gets a gradient. The loss is the KL divergence from the float model's next-token distribution
(``loss="kl"``) or the model's own loss on batches carrying labels (``loss="task"``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from surgery.core import guards
from surgery.core.errors import NO_VALUE, ConfigError, ConfigTypeError
from surgery.core.inputs import Call, evaluating
from surgery.core.progress import tqdm
from surgery.core.settings import whole_count
from surgery.ops.numerics.fake_quant import fake_quantize_dynamic
from surgery.ops.numerics.grid import GridSpec

LOSSES = ("kl", "task")
STEPS_LIMIT = 10_000  # SpinQuant learns in 100 to 800 steps


def _grid(value: Any, field: str) -> GridSpec | None:
    """A GridSpec from a spec, a dict of its fields, or None."""
    if value is None or isinstance(value, GridSpec):
        return value if value is None else value.validate(field)
    if isinstance(value, Mapping):
        return GridSpec.build(dict(value), field)
    raise ConfigTypeError(field, value, "must be a GridSpec, a dict of its fields, or null")


@dataclass(frozen=True)
class LearnSpec:
    """How a learned rotation is trained: ``steps`` of Cayley SGD at learning rate ``lr``
    (cosine-decayed to 0, SpinQuant's schedule; each step's size is also capped by the
    gradient's norm), through a forward whose block layers' ``weights`` and inputs
    (``activations``, dynamic scales only) are fake-quantized, minimising ``loss``; with
    ``heads``, each attention's per-head value rotation (SpinQuant's R2) is learned too.

    The defaults are SpinQuant's W4A4 setting: int4 symmetric per-channel weights (round to
    nearest) and int4 asymmetric per-token dynamic activations."""

    steps: int = 100
    lr: float = 1.5
    weights: Any = field(default_factory=lambda: GridSpec(bits=4, symmetric=True, per_channel=True))
    activations: Any = field(default_factory=lambda: GridSpec(bits=4, symmetric=False, dynamic="token"))
    loss: str = "kl"
    heads: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.heads, bool):
            raise ConfigTypeError("rotate.learn.heads", self.heads, "must be true or false")
        whole_count("rotate.learn.steps", self.steps, "steps", at_most=STEPS_LIMIT, example=100)
        lr = self.lr
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not (math.isfinite(lr) and lr > 0):
            raise ConfigError("rotate.learn.lr", lr, "must be a finite number > 0 (SpinQuant uses 1.5)")
        if self.loss not in LOSSES:
            raise ConfigError("rotate.learn.loss", self.loss, f"must be one of {', '.join(LOSSES)}")
        object.__setattr__(self, "weights", _grid(self.weights, "rotate.learn.weights"))
        activations = _grid(self.activations, "rotate.learn.activations")
        object.__setattr__(self, "activations", activations)
        if activations is not None and activations.dynamic is None:
            raise ConfigError(
                "rotate.learn.activations.dynamic",
                NO_VALUE,
                "must be 'token' or 'tensor': the quantized forward takes each input's scale from itself",
            )
        if self.weights is None and activations is None:
            raise ConfigError(
                "rotate.learn", "weights=None, activations=None", "learns through a quantized forward; quantize one"
            )

    @classmethod
    def of(cls, value: Any) -> LearnSpec | None:
        """The settings ``learn=`` names: None/False (no learning), True (the defaults), a dict
        of fields, or a LearnSpec."""
        if value is None or value is False:
            return None
        if value is True:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, Mapping):
            unknown = sorted(set(value) - set(cls.__dataclass_fields__))
            if unknown:
                allowed = ", ".join(cls.__dataclass_fields__)
                raise ConfigError(
                    f"rotate.learn.{unknown[0]}", value[unknown[0]], f"unknown setting; allowed: {allowed}"
                )
            return cls(**value)
        raise ConfigTypeError("rotate.learn", value, "must be null, true or false, a dict of settings, or a LearnSpec")


def cayley_step(r: Tensor, grad: Tensor, lr: float, iterations: int = 5) -> Tensor:
    """One Cayley SGD step on the Stiefel manifold (Li et al. 2020, Algorithm 2 without
    momentum, as SpinQuant's SGDG): the gradient projected to a skew-symmetric ``A`` at ``R``,
    then ``R`` moved along the Cayley curve ``(I - a/2 A)^-1 (I + a/2 A) R`` by a fixed-point
    iteration, with step ``a = min(lr, 1 / |A|_1)`` (the iteration contracts)."""
    x = r / (r.norm(dim=1, keepdim=True) + 1e-8)  # rows of unit norm, R's frame
    descent = -grad.t()
    mx = descent @ x
    half = mx - 0.5 * (x.t() @ (x @ mx))
    skew = half - half.t()
    step = min(lr, 1.0 / (skew.abs().sum(0).max().item() + 1e-8))
    y = x.t() + step * descent
    for _ in range(iterations):
        y = x.t() + step * skew @ (0.5 * (x.t() + y))
    return y.t()


def nearest_orthogonal(r: Tensor) -> Tensor:
    """The orthogonal matrix closest to ``r`` (its polar factor), so the fused rotation is exact."""
    u, _, vh = torch.linalg.svd(r.double())
    return (u @ vh).to(r.dtype)


@contextlib.contextmanager
def _frozen(model: nn.Module) -> Iterator[None]:
    """No parameter of ``model`` takes a gradient in the block; each one's flag and ``.grad``
    are as before afterwards."""
    saved = [(p, p.requires_grad, p.grad) for p in model.parameters()]
    try:
        for p, _, _ in saved:
            p.requires_grad_(False)
        yield
    finally:
        for p, flag, grad in saved:
            p.requires_grad_(flag)
            p.grad = grad


class _Switch:
    """Whether the learning hooks act: off while the float model computes its targets."""

    def __init__(self) -> None:
        self.on = True

    @contextlib.contextmanager
    def off(self) -> Iterator[None]:
        self.on = False
        try:
            yield
        finally:
            self.on = True


@contextlib.contextmanager
def _quantized_inputs(layers: dict[str, nn.Module], spec: GridSpec | None, before: dict[str, Callable]) -> Iterator:
    """Forward-pre hooks fake-quantizing each layer's input (after ``before[name]``, the online
    rotation, where one is given); yields their :class:`_Switch`; all removed afterwards, even
    on an exception."""
    hooks, switch = [], _Switch()

    def hook_for(name: str) -> Callable:
        def hook(module: nn.Module, args: tuple) -> tuple | None:
            if not switch.on:
                return None
            x = before[name](module, args)[0] if name in before else args[0]
            if spec is not None:
                x = fake_quantize_dynamic(x, spec)[0]
            return (x, *args[1:])

        return hook

    try:
        for name, layer in layers.items():
            hooks.append(layer.register_forward_pre_hook(hook_for(name)))
        yield switch
    finally:
        for hook in hooks:
            hook.remove()


def fake_quantized_weight(weight: Tensor, spec: GridSpec) -> Tensor:
    """``weight`` rounded to nearest on ``spec``'s grid (per channel, per group or per tensor;
    groups that do not divide the inputs, per channel), its gradient passing straight through."""
    rows = weight.reshape(weight.shape[0], -1)
    size = spec.group_size
    if size is not None and rows.shape[1] % size == 0:
        rows = rows.reshape(-1, size)
    elif size is None and not spec.per_channel:
        rows = rows.reshape(1, -1)
    rounding = dataclasses.replace(
        spec.without_method(), dynamic="token", per_channel=False, group_size=None, observer="minmax"
    )
    return fake_quantize_dynamic(rows, rounding)[0].reshape(weight.shape)


class _Objective:
    """The loss of one batch through the quantized forward, the rotated weights a function of R."""

    def __init__(self, model: nn.Module, layers: dict[str, nn.Module], spec: LearnSpec, switch: _Switch) -> None:
        self.model, self.layers, self.spec, self.switch = model, layers, spec, switch

    def target(self, call: Call) -> Tensor | None:
        """The float model's next-token log-probabilities (``loss="kl"``), computed each step
        rather than held for every batch (a large vocabulary's are big)."""
        if self.spec.loss != "kl":
            return None
        with torch.no_grad(), self.switch.off():
            return torch.log_softmax(_logits(call(self.model)).float(), -1)

    def __call__(self, values: dict[str, Tensor], index: int, call: Call) -> Tensor:
        target = self.target(call)
        weights = dict(values)
        if self.spec.weights is not None:
            for name, layer in self.layers.items():
                key = f"{name}.weight"
                weights[key] = fake_quantized_weight(weights.get(key, layer.weight), self.spec.weights)
        out = torch.func.functional_call(
            self.model, guards.stand_ins(self.model, weights), call.args, dict(call.kwargs)
        )
        if target is None:
            loss = getattr(out, "loss", None)
            if not isinstance(loss, Tensor):
                raise ConfigError(
                    "rotate.learn.loss",
                    "task",
                    f"the model returned no loss on batch {index}; give batches with labels, or use loss='kl'",
                )
            return loss
        student = torch.log_softmax(_logits(out).float(), -1)
        return torch.nn.functional.kl_div(
            student.flatten(0, -2), target.flatten(0, -2), log_target=True, reduction="batchmean"
        )


def _logits(out: Any) -> Tensor:
    out = getattr(out, "logits", out)
    return out[0] if isinstance(out, (tuple, list)) else out


def learn_rotation(
    model: nn.Module,
    starts: dict[str, Tensor],
    values_of: Callable[[dict[str, Tensor]], dict[str, Tensor]],
    layers: dict[str, nn.Module],
    calls: list[Call],
    spec: LearnSpec,
    *,
    online: dict[str, Callable] | None = None,
    progress: bool = True,
) -> dict[str, Tensor]:
    """The rotations ``starts`` trained together for ``spec.steps`` Cayley SGD steps (batch
    ``i % len(calls)`` at step ``i``) on the quantized forward of ``model`` where
    ``values_of(rotations)`` gives the rotated parameters; ``layers`` (name → Linear) are
    quantized. Returns the learned rotations, orthogonal, by the same keys."""
    rotations = {key: r.detach().double().clone().requires_grad_(True) for key, r in starts.items()}
    calls = calls[: spec.steps]
    with _frozen(model), evaluating(model), _quantized_inputs(layers, spec.activations, online or {}) as switch:
        objective = _Objective(model, layers, spec, switch)
        with torch.enable_grad():
            bar = tqdm(
                range(spec.steps),
                desc="learning the rotation",
                unit="step",
                leave=False,
                disable=None if progress else True,
            )
            for step in bar:
                index = step % len(calls)
                loss = objective(values_of(rotations), index, calls[index])
                if not torch.isfinite(loss):
                    raise ConfigError(
                        "rotate.learn.lr", spec.lr, f"the loss became {loss.item()} at step {step}; use a smaller lr"
                    )
                grads = torch.autograd.grad(loss, list(rotations.values()), allow_unused=True)
                lr = spec.lr * 0.5 * (1 + math.cos(math.pi * step / spec.steps))
                with torch.no_grad():
                    rotations = {
                        key: (r if g is None else cayley_step(r.detach(), g, lr)).detach().requires_grad_(True)
                        for (key, r), g in zip(rotations.items(), grads, strict=True)
                    }
                bar.set_postfix(loss=f"{loss.item():.4g}")
    return {key: nearest_orthogonal(r.detach()).to(starts[key].dtype) for key, r in rotations.items()}
