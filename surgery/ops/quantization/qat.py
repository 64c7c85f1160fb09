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
from surgery.core._compat import get_slot, set_slot
from surgery.core.errors import ConfigError, ParameterReplacedError
from surgery.core.handles import Handle
from surgery.core.targets import Target
from surgery.core.transforms import SavedTensor
from surgery.ops.numerics.fake_quant import fake_quantize
from surgery.ops.numerics.grid import GridSpec
from surgery.ops.numerics.observers import Observer


class ShadowWeight:
    """One weight trained in float and seen fake-quantized: ``spec``, ``axis``, and the
    ``scale``/``zero_point`` its current values give. It sits in the parameter's guard like the
    in-place transforms (``apply`` does nothing: the forward quantizes), so undo order and
    "quantized once" are checked the same way."""

    kind = "quantize"

    def __init__(self, name: str, target: Target, spec: GridSpec, axis: int | None) -> None:
        self.name, self.spec, self.axis, self.param = name, spec, axis, target.param
        self.owners: list[tuple[nn.Module, str]] = [(target.module, target.attribute)]  # every slot holding it
        self.active = False

    def apply(self, param: Tensor) -> None:
        """Nothing to do in place: the float values are the point."""

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
        for owner, attribute in self.owners:
            if get_slot(owner, attribute) is not self.param:
                raise ParameterReplacedError(
                    f"{self.name} was replaced by a new object after quantize(train=True) was attached (load_state_dict("
                    "assign=True) or assignment); call enforce() on the handle to carry it over, or restore() it first"
                )
        guards.settle(self.param)  # masks and other transforms first: the forward sees them quantized
        weight = self.quantized(self.param)
        weight._surgery_source = self.param  # lets surgery's own checks know the slot is on loan
        for owner, attribute in self.owners:
            set_slot(owner, attribute, weight)
        self.active = True

    def put_back(self) -> None:
        for owner, attribute in self.owners:
            if getattr(get_slot(owner, attribute), "_surgery_source", None) is self.param:
                set_slot(owner, attribute, self.param)
        self.active = False

    def fold(self) -> None:
        """Write the fake-quantized values into the parameter (``bake``)."""
        with torch.no_grad():
            self.param.copy_(self.quantized(self.param.detach()))


class Loans:
    """The calls in progress of one handle's swap hooks, outermost first. A forward cut short by
    an interrupt runs no forward hook (PyTorch's ``always_call`` covers exceptions only), so the
    next outermost call finds weights still on loan and puts them back before anything else."""

    def __init__(self, shadows: list[ShadowWeight]) -> None:
        self.shadows = shadows
        self.stack: list[list[ShadowWeight]] = []

    def reset(self) -> None:
        for shadow in self.shadows:
            if shadow.active:
                shadow.put_back()
        self.stack.clear()


class SwapHooks:
    """The forward-pre and always-called forward hook of one module on the path to shadow weights:
    the outermost call swaps every weight below it that is not swapped yet; its exit puts them back."""

    def __init__(self, shadows: list[ShadowWeight], loans: Loans, root: bool) -> None:
        self.shadows, self.loans, self.root = shadows, loans, root

    def pre(self, module: nn.Module, args: tuple) -> None:
        if self.root or not self.loans.stack:  # an outermost call: nothing may be on loan from an interrupted one
            self.loans.reset()
        mine: list[ShadowWeight] = []
        self.loans.stack.append(mine)
        for shadow in self.shadows:
            if not shadow.active:
                shadow.swap()
                mine.append(shadow)

    def post(self, module: nn.Module, args: tuple, output: object) -> None:
        for shadow in self.loans.stack.pop() if self.loans.stack else []:
            shadow.put_back()


def return_loans(model: nn.Module) -> None:
    """Put back every parameter on loan to a forward (after an interrupted one)."""
    for module in model.modules():
        for attribute, value in list(module.named_parameters(recurse=False, remove_duplicate=False)):
            source = getattr(value, "_surgery_source", None)
            if source is not None:
                set_slot(module, attribute, source)


class ShadowRecord:
    """Undo record of one shadow weight: restore puts the original floats back, bake folds to the grid."""

    def __init__(self, shadow: ShadowWeight) -> None:
        self.shadow, self.name, self.transform = shadow, shadow.name, shadow
        self.saved = SavedTensor(shadow.param)
        self.guard: guards.TensorGuard | None = None

    @property
    def param(self) -> nn.Parameter:
        return self.shadow.param

    @property
    def description(self) -> str:
        return f"undo quantization-aware training of {self.name}"

    def restore(self) -> None:
        self.shadow.put_back()
        guards.detach(self.shadow.param, self.shadow, self.name)
        with torch.no_grad():
            self.saved.put_back(self.shadow.param)

    def keep(self) -> None:
        self.shadow.put_back()
        guards.detach(self.shadow.param, self.shadow, self.name)
        self.shadow.fold()

    def enforce(self, handle: Handle) -> None:
        """Carry the shadow over to a parameter that replaced it (``load_state_dict(assign=True)``)."""
        model = handle.model
        if model is None:
            return
        self.shadow.put_back()
        current = dict(model.named_parameters(remove_duplicate=False)).get(self.name)
        if current is None or current is self.shadow.param:
            return
        if current.shape != self.shadow.param.shape:
            raise ConfigError(
                "enforce",
                self.name,
                f"was replaced by a parameter of shape {tuple(current.shape)}; "
                f"the surgery was made for {tuple(self.shadow.param.shape)} (restore() instead)",
            )
        guards.adopt(self.guard, current)
        self.shadow.param = current
        self.shadow.owners = owners_of(model, current)


def owners_of(model: nn.Module, param: nn.Parameter) -> list[tuple[nn.Module, str]]:
    """Every (module, attribute) slot of ``model`` holding ``param`` (a tied weight has several)."""
    return [
        (module, attribute)
        for module in model.modules()
        for attribute, value in module.named_parameters(recurse=False, remove_duplicate=False)
        if value is param
    ]


def attach_shadows(handle: Handle, model: nn.Module, shadows: dict[str, ShadowWeight]) -> None:
    """Own undo records and swap hooks (on the path from the root to each owner) for ``shadows``."""
    for shadow in shadows.values():  # guards.attach refuses a weight already quantized, either way
        shadow.owners = owners_of(model, shadow.param)
        record = ShadowRecord(shadow)
        handle.add_record(record)
        record.guard = guards.attach(shadow.param, shadow, shadow.name)  # the record keeps the guard alive
    by_param = {id(s.param): s for s in shadows.values()}
    loans = Loans(list(shadows.values()))
    for module, below, _ in guards.paths_to_owners(model, [s.param for s in shadows.values()]):
        hooks = SwapHooks([by_param[i] for i in below], loans, root=module is model)
        handle.add_hook("quantization-aware weight hook", module.register_forward_pre_hook(hooks.pre))
        handle.add_hook("quantization-aware weight hook", module.register_forward_hook(hooks.post, always_call=True))
