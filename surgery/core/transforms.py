"""``surgery.attach_transform``: an in-place, guarded, restorable change to parameters.

A *transform* rewrites a parameter in place (``apply(param)``) and names its ``kind``; once
attached, the parameter's guard re-applies it whenever the tensor changes, forward-pre hooks
on the path from the root to the parameter's owner check it before every forward, and an
*undo record* (:class:`AttachedTransform`) keeps what is needed to put the exact original
values back. ``prune`` and ``quantize`` attach their masks and quantizers through the same
function users call.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from typing import Protocol

import torch
from torch import Tensor, nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from surgery.core import compiled, guards
from surgery.core.errors import ConfigError, ConfigTypeError
from surgery.core.guards import StepEnforcer, SubtreeEnforcer, Transform
from surgery.core.handles import Handle


class Saved(Protocol):
    """What a transform keeps to undo itself: ``put_back(param)`` restores the exact values."""

    def put_back(self, param: Tensor) -> None: ...

    def tensors(self) -> list[Tensor]: ...


class SavedTensor:
    """A full copy of the original values, kept on the CPU (a GPU's memory holds the model)."""

    def __init__(self, param: Tensor) -> None:
        self.original = param.detach().to("cpu", copy=True)

    def put_back(self, param: Tensor) -> None:
        param.copy_(self.original.to(param.device, param.dtype))

    def tensors(self) -> list[Tensor]:
        return [self.original]


class SavedEntries:
    """The original values of the entries a boolean ``changed`` mask selects (a pruning mask's
    zeros): memory proportional to what the transform changes."""

    def __init__(self, param: Tensor, changed: Tensor, mask_of: Callable[[], Tensor]) -> None:
        self.values = param.detach()[changed.to(param.device)].cpu()  # on the CPU, as SavedTensor
        self.mask_of = mask_of  # recomputes the changed entries (stored packed by its owner)

    def put_back(self, param: Tensor) -> None:
        param.masked_scatter_(self.mask_of().to(param.device), self.values.to(param.device, param.dtype))

    def tensors(self) -> list[Tensor]:
        return [self.values]


class FunctionTransform:
    """A plain function ``fn(tensor) -> tensor`` as a transform: its result is copied into the
    parameter (``None``: ``fn`` edited the tensor in place itself)."""

    def __init__(self, fn: Callable[[Tensor], Tensor | None], kind: str) -> None:
        self.fn, self.kind = fn, kind

    def apply(self, param: Tensor) -> None:
        result = self.fn(param)
        if result is not None and result is not param:
            if not isinstance(result, Tensor) or result.shape != param.shape:
                got = tuple(result.shape) if isinstance(result, Tensor) else type(result).__name__
                raise ConfigError(
                    "transforms",
                    self.kind,
                    f"returned {got} for a parameter of shape "
                    f"{tuple(param.shape)}; a transform returns the same shape (or None after an "
                    "in-place edit)",
                )
            param.copy_(result)


class CheckedTransform:
    """A user's transform object, refused if ``apply`` returns a new tensor instead of editing in place."""

    def __init__(self, inner: Transform) -> None:
        self.inner, self.kind = inner, inner.kind

    def apply(self, param: Tensor) -> None:
        result = self.inner.apply(param)
        if isinstance(result, Tensor) and result is not param:
            raise ConfigError(
                "transforms",
                self.kind,
                "apply(param) returned a new tensor; it must edit param in "
                "place (or pass a function tensor -> tensor instead)",
            )

    def __getattr__(self, name: str):
        return getattr(self.inner, name)  # save(), and whatever else the transform offers


class GradientHook:
    """Tensor hook run once a parameter's gradient is accumulated: the transform's
    ``on_gradient(param)`` edits ``param.grad`` in place (a mask zeroes the gradient of its
    pruned entries, so momentum and Adam states stay zero too)."""

    __torch_unserializable__ = True  # a copy or pickle of the model simply has no such hook

    def __init__(self, transform: Transform) -> None:
        self.transform = transform

    def __call__(self, param: Tensor) -> None:
        self.transform.on_gradient(param)


class AttachedTransform:
    """The undo record of one transform on one parameter (what ``restore`` and ``bake`` run)."""

    def __init__(self, name: str, param: nn.Parameter, transform: Transform, saved: Saved) -> None:
        self.name, self.transform, self.saved = name, transform, saved
        self._param = param
        self.guard: guards.TensorGuard | None = None  # set once attached

    @property
    def param(self) -> nn.Parameter:
        """The parameter now carrying the transform (a replacement once adopted by ``enforce``)."""
        return self.guard.param if self.guard is not None else self._param

    @property
    def description(self) -> str:
        return f"undo {self.transform.kind} of {self.name}"

    def restore(self) -> None:
        """Detach the transform and put the original values back."""
        param = self.param
        guards.detach(param, self.transform, self.name)
        with torch.no_grad():
            self.saved.put_back(param)
        _release(self.transform)

    def keep(self) -> None:
        """Detach the transform and keep what it made (the originals go with the handle)."""
        guards.settle(self.param)  # changed since the last forward: bake what the hooks would enforce
        guards.detach(self.param, self.transform, self.name)
        _release(self.transform)

    def enforce(self, handle: Handle) -> None:
        """Re-apply the transform now (after a ``.data`` edit); if the model holds a new
        parameter under this name (``load_state_dict(assign=True)``), carry it over first."""
        model = handle.model
        if model is None or self.guard is None:
            return
        current = dict(model.named_parameters(remove_duplicate=False)).get(self.name)
        if current is not None and current is not self.guard.param:
            if current.shape != self.guard.param.shape:
                raise ConfigError(
                    "enforce",
                    self.name,
                    f"was replaced by a parameter of shape {tuple(current.shape)}; "
                    f"the surgery was made for {tuple(self.guard.param.shape)} (restore() instead)",
                )
            guards.adopt(self.guard, current)
            _own_gradient_hook(handle, current, self.transform)
        else:
            self.guard.enforce(force=True)


def _release(transform: Transform) -> None:
    """Let a detached transform drop what it cached for training (a mask's indices)."""
    release = getattr(transform, "release", None)
    if callable(release):
        release()


def _own_gradient_hook(handle: Handle, param: nn.Parameter, transform: Transform) -> None:
    """A frozen parameter gets the hook too (registered with ``requires_grad`` briefly on): it
    fires once the parameter is unfrozen and trained."""
    if not callable(getattr(transform, "on_gradient", None)) or not param.is_floating_point():
        return
    frozen = not param.requires_grad
    try:
        if frozen:
            param.requires_grad_(True)
        hook = param.register_post_accumulate_grad_hook(GradientHook(transform))
    finally:
        if frozen:
            param.requires_grad_(False)
    handle.add_hook("gradient hook", hook)


def attach_all(
    handle: Handle, model: nn.Module, transforms: Mapping[str, tuple[nn.Parameter, Transform]], hook_description: str
) -> dict[str, AttachedTransform]:
    """Attach each ``(param, transform)`` under its qualified name, recording undo records on
    ``handle`` before each change, then own the hooks that keep them applied: forward-pre hooks
    (before each forward), tensor hooks on accumulated gradients (transforms with
    ``on_gradient(param)``) and
    one global optimizer step post-hook (right after each step). On failure the caller rolls
    ``handle`` back."""
    records: dict[str, AttachedTransform] = {}
    for name, (param, transform) in transforms.items():
        save = getattr(transform, "save", None)
        record = AttachedTransform(name, param, transform, save(param) if save else SavedTensor(param))
        handle.add_record(record)  # recorded before the change
        record.guard = guards.attach(param, transform, name)
        records[name] = record
    by_param = {id(r.param): r.guard for r in records.values()}
    for module, below, owned in guards.paths_to_owners(model, [r.param for r in records.values()]):
        enforcer = SubtreeEnforcer(
            [by_param[i] for i in below], [(owner, attr, name, by_param[i]) for owner, attr, name, i in owned]
        )
        handle.add_hook(hook_description, module.register_forward_pre_hook(enforcer))
    for record in records.values():
        _own_gradient_hook(handle, record.param, record.transform)
    if records:
        own_step_hook(handle, model, StepEnforcer(list(dict.fromkeys(by_param.values()))))
    return records


def own_step_hook(handle: Handle, model: nn.Module, hook: Callable) -> None:
    """Register ``hook`` as a global optimizer step post-hook owned by ``handle``: removed by
    ``restore()``/``bake()``, and at the latest when ``model`` is garbage-collected (a model
    dropped with its surgery still attached does not leave the hook behind)."""
    removable = register_optimizer_step_post_hook(hook)
    handle.add_hook("optimizer step hook", removable)
    finalizer = weakref.finalize(model, removable.remove)
    handle.add("forget the model-lifetime removal", finalizer.detach, finalizer.detach)  # not one per handle forever


def _check_idempotent(name: str, param: nn.Parameter, transform: Transform) -> None:
    """Refuse a transform that changes its own result (``w * 2``): surgery re-applies transforms
    whenever the parameter changes, so it must be idempotent."""
    with torch.no_grad():
        once = guards.current_value(param).clone()
        transform.apply(once)
        twice = once.clone()
        transform.apply(twice)
    if not torch.equal(once.nan_to_num(), twice.nan_to_num()):
        raise ConfigError(
            f"transforms[{name!r}]",
            transform.kind,
            "is not idempotent: applying it twice changes the "
            "result, and surgery re-applies it whenever the weight changes (optimizer steps, restores); "
            "make apply(apply(w)) == apply(w), e.g. clamp or mask rather than scale",
        )


TransformLike = Transform | Callable[[Tensor], Tensor | None]


def attach_transform(model: nn.Module, transforms: Mapping[str, TransformLike], *, kind: str = "transform") -> Handle:
    """Attach in-place transforms to parameters by qualified name; return a handle that undoes them.

    Each transform is an object with ``kind`` and ``apply(param)`` (optionally ``save(param)``
    returning what undo needs; default a full copy), or a function ``fn(tensor) -> tensor``.
    It is applied now, re-applied whenever the parameter changes (an optimizer step,
    ``load_state_dict``) before the next forward, and stacks with prune/quantize in order.
    ``restore()`` gives back the exact original values; ``bake()`` keeps the result.

    Example:
        >>> handle = surgery.attach_transform(model, {"fc.weight": lambda w: w.clamp(-0.1, 0.1)})
        >>> handle.restore()  # the original weight, bit for bit
    """
    model = compiled.prepare(model)
    if not isinstance(kind, str) or not kind:
        raise ConfigTypeError("kind", kind, "must be a non-empty string naming the transform")
    if not isinstance(transforms, Mapping) or not transforms:
        raise ConfigTypeError("transforms", transforms, "must be a non-empty dict {parameter name: transform}")
    params = dict(model.named_parameters(remove_duplicate=False))
    resolved: dict[str, tuple[nn.Parameter, Transform]] = {}
    for name, transform in transforms.items():
        if name not in params:
            close = [n for n in params if n.endswith(str(name).split(".")[-1])][:3]
            raise ConfigError(
                "transforms",
                name,
                "is not a parameter of the model",
                f"closest: {', '.join(close)}" if close else "see model.named_parameters()",
            )
        if callable(getattr(transform, "apply", None)) and isinstance(getattr(transform, "kind", None), str):
            resolved[name] = (params[name], CheckedTransform(transform))
        elif callable(transform):
            resolved[name] = (params[name], FunctionTransform(transform, kind))
        else:
            raise ConfigTypeError(
                f"transforms[{name!r}]",
                transform,
                "must be a function tensor -> tensor or an object with kind and apply(param)",
            )
    guards.check_editable({name: p for name, (p, _) in resolved.items()}, "transforms")
    for name, (param, transform) in resolved.items():
        _check_idempotent(name, param, transform)
    handle = Handle(kind, model)
    with handle.applying():
        attach_all(handle, model, resolved, f"{kind} hook")
    return handle
