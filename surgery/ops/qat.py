"""Quantization-aware training: float shadow weights, fake-quantized in the forward (STE).

With ``surgery.quantize(..., train=True)`` a weight keeps its float values — the *shadow* the
optimizer updates, so small steps accumulate instead of being rounded away — and every forward
sees it fake-quantized: forward-pre hooks put ``fake_quantize(weight)`` in the owner's
parameter slot for the duration of the call and an always-called forward hook puts the
parameter back, even when the forward raises. PyTorch's fake-quantization ops pass gradients
straight through inside the range (the straight-through estimator), so ``backward`` reaches the
shadow. Scales follow the weight: they are observed on the shadow at every forward.

The swap hooks sit on every module from the root down to the owner, so a parent that reads
``child.weight`` itself (``nn.MultiheadAttention`` reads ``out_proj.weight``) sees the
quantized weight too; the outermost call swaps and puts back.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from surgery.core import guards
from torch.utils.weak import WeakIdKeyDictionary

from surgery.core.errors import AlreadyModifiedError, ParameterReplacedError
from surgery.core.handles import Handle
from surgery.core.targets import Target
from surgery.core.transforms import SavedTensor
from surgery.ops.observers import Observer, QuantSpec, fake_quantize


_shadowed = WeakIdKeyDictionary()  # parameter -> its ShadowWeight while quantization-aware training is attached


def check_free(param: nn.Parameter, name: str) -> None:
    """Refuse a second quantization of a weight: fake-quantized in place, or trained as a shadow."""
    if param in _shadowed or any(t.kind == "quantize" for t in guards.transforms_of(param)):
        raise AlreadyModifiedError(f"quantize: {name} already has quantize attached; bake() or restore() that "
                                   "handle first")


class ShadowWeight:
    """One weight trained in float and seen fake-quantized: ``spec``, ``axis``, and the
    ``scale``/``zero_point`` its current values give."""

    kind = "quantize"

    def __init__(self, name: str, target: Target, spec: QuantSpec, axis: int | None) -> None:
        self.name, self.spec, self.axis = name, spec, axis
        self.owner, self.attribute, self.param = target.module, target.attribute, target.param
        self.active = False

    def qparams(self, value: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Scale and zero point observed on ``value`` (default: the shadow as it is now)."""
        observer = Observer(self.spec, self.axis, self.name)
        observer.observe(self.param.detach() if value is None else value)
        return observer.qparams()

    @property
    def scale(self) -> Tensor:
        return self.qparams()[0]

    @property
    def zero_point(self) -> Tensor:
        return self.qparams()[1]

    def quantized(self, value: Tensor) -> Tensor:
        """``value`` fake-quantized with the range of its own values (gradients pass straight through)."""
        scale, zero_point = self.qparams(value.detach())
        return fake_quantize(value, scale.to(value.device), zero_point.to(value.device), self.axis, self.spec)

    def swap(self) -> None:
        current = self.owner._parameters.get(self.attribute)
        if current is not self.param:
            raise ParameterReplacedError(
                f"{type(self.owner).__name__}.{self.attribute} ({self.name}) was replaced by a new object after "
                "quantize(train=True) was attached; restore() the handle before replacing parameters")
        guards.settle(self.param)  # masks and other transforms first: the forward sees them quantized
        weight = self.quantized(self.param)
        weight._surgery_source = self.param  # lets surgery's own checks know the slot is on loan
        self.owner._parameters[self.attribute] = weight
        self.active = True

    def put_back(self) -> None:
        self.owner._parameters[self.attribute] = self.param
        self.active = False

    def fold(self) -> None:
        """Write the fake-quantized values into the parameter (``bake``)."""
        with torch.no_grad():
            self.param.copy_(self.quantized(self.param.detach()))


class SwapHooks:
    """The forward-pre and always-called forward hook of one module on the path to shadow weights:
    the outermost call swaps every weight below it that is not swapped yet; its exit puts them back."""

    def __init__(self, shadows: list[ShadowWeight]) -> None:
        self.shadows = shadows
        self.stack: list[list[ShadowWeight]] = []

    def pre(self, module: nn.Module, args: tuple) -> None:
        mine: list[ShadowWeight] = []
        self.stack.append(mine)
        for shadow in self.shadows:
            if not shadow.active:
                shadow.swap()
                mine.append(shadow)

    def post(self, module: nn.Module, args: tuple, output: object) -> None:
        for shadow in self.stack.pop() if self.stack else []:
            shadow.put_back()


class ShadowRecord:
    """Undo record of one shadow weight: restore puts the original floats back, bake folds to the grid."""

    def __init__(self, shadow: ShadowWeight) -> None:
        self.shadow, self.name, self.transform = shadow, shadow.name, shadow
        self.saved = SavedTensor(shadow.param)

    @property
    def param(self) -> nn.Parameter:
        return self.shadow.param

    @property
    def description(self) -> str:
        return f"undo quantization-aware training of {self.name}"

    def restore(self) -> None:
        self.shadow.put_back()
        _shadowed.pop(self.shadow.param, None)
        with torch.no_grad():
            self.saved.put_back(self.shadow.param)

    def keep(self) -> None:
        self.shadow.put_back()
        self.shadow.fold()
        _shadowed.pop(self.shadow.param, None)

    def enforce(self, handle: Handle) -> None:
        """Nothing to re-apply: the forward quantizes the shadow as it is."""


def attach_shadows(handle: Handle, model: nn.Module, shadows: dict[str, ShadowWeight]) -> None:
    """Own undo records and swap hooks (on the path from the root to each owner) for ``shadows``."""
    for shadow in shadows.values():
        check_free(shadow.param, shadow.name)
    for shadow in shadows.values():
        handle.add_record(ShadowRecord(shadow))
        _shadowed[shadow.param] = shadow
    by_param = {id(s.param): s for s in shadows.values()}
    for module, below, _ in guards.paths_to_owners(model, [s.param for s in shadows.values()]):
        hooks = SwapHooks([by_param[i] for i in below])
        handle.add_hook("quantization-aware weight hook", module.register_forward_pre_hook(hooks.pre))
        handle.add_hook("quantization-aware weight hook",
                        module.register_forward_hook(hooks.post, always_call=True))
