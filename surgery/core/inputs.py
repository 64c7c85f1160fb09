"""Model inputs: one batch as a call (positional and keyword arguments), batches streamed.

A batch may be a tensor (``model(x)``), a tuple or list of positional arguments
(``model(*batch)``), or a mapping of keyword arguments, Hugging Face style
(``model(**{"input_ids": ..., "attention_mask": ...})``). Every verb that runs a model on
user batches (compare, calibration, capture, inspection) reads them through :func:`batches`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from surgery.core.errors import ConfigError, ConfigTypeError
from surgery.core.progress import tqdm

Batch = Tensor | Sequence[Any] | Mapping[str, Any]
Inputs = Tensor | Mapping[str, Any] | Iterable[Batch]


@dataclass(frozen=True)
class Call:
    """One batch as the arguments of a model call: ``model(*args, **kwargs)``."""

    args: tuple = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)

    def __call__(self, model: nn.Module) -> Any:
        """``model(*args, **kwargs)``, with :meth:`for_model`'s tensors."""
        call = self.for_model(model)
        return model(*call.args, **call.kwargs)

    def for_model(self, model: Any) -> Call:
        """This call with its tensors on the device ``model`` computes on, where all of them are on
        one other device (a batch given on the CPU for a model on a GPU); otherwise this call as
        it is: a module on several devices (a block onloaded, weights set aside on ``meta``:
        their own hooks move inputs), a call on several devices (CPU lengths beside GPU
        activations), anything that is not a module."""
        device = _computes_on(model)
        if device is None:
            return self
        found = {tensor.device for tensor in flatten_tensors([list(self.args), dict(self.kwargs)], floating_only=False)}
        return moved(self, device) if len(found) == 1 and device not in found else self

    def tensors(self) -> list[Tensor]:
        """The floating tensors among the arguments, nested ones included."""
        return flatten_tensors([list(self.args), dict(self.kwargs)])


def moved(value: Any, device: torch.device | str) -> Any:
    """``value`` (a tensor, or tuples, lists and dicts of them, or a :class:`Call`) with every
    tensor in it on ``device``; anything else as it is."""
    return _each_tensor(value, lambda tensor: tensor.to(device))


def cast_floating(value: Any, dtype: torch.dtype) -> Any:
    """``value`` (as :func:`moved` takes it) with every floating tensor in ``dtype``."""
    return _each_tensor(value, lambda tensor: tensor.to(dtype) if tensor.is_floating_point() else tensor)


def _each_tensor(value: Any, change: Callable[[Tensor], Tensor]) -> Any:
    if isinstance(value, Tensor):
        return change(value)
    if isinstance(value, Call):
        return Call(_each_tensor(value.args, change), _each_tensor(dict(value.kwargs), change))
    if isinstance(value, (tuple, list)):
        items = [_each_tensor(item, change) for item in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)  # a namedtuple too
    if isinstance(value, Mapping):
        mapped = {key: _each_tensor(item, change) for key, item in value.items()}
        if type(value) is dict:
            return mapped
        try:
            return type(value)(mapped)  # a BatchEncoding stays one
        except TypeError:
            return mapped
    return value


def present_device(name: object, field: str) -> torch.device:
    """``name`` as a torch device this machine has; else one line naming ``field``."""
    try:
        device = torch.device(str(name))
    except RuntimeError:
        raise ConfigError(field, name, "must be cpu, cuda, cuda:N or mps") from None
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    present = {"cpu": True, "cuda": (device.index or 0) < count, "mps": torch.backends.mps.is_available()}
    if device.type not in present:
        raise ConfigError(field, name, "must be cpu, cuda, cuda:N or mps")
    if not present[device.type]:
        said = f"{count} CUDA devices" if count else "no CUDA GPU"
        raise ConfigError(field, name, f"is not on this machine ({said})")
    return device


def inputs_to(device: torch.device) -> Callable[[nn.Module, tuple, dict], tuple[tuple, dict]]:
    """A forward-pre hook (``with_kwargs=True``) moving a module's positional and keyword inputs to ``device``."""

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return moved(args, device), moved(kwargs, device)

    return hook


def device_of(module: Any) -> torch.device:
    """The device ``module``'s first parameter or buffer is on; the CPU for anything else (a
    runtime's session, a module without tensors)."""
    if isinstance(module, nn.Module):
        first = next(itertools.chain(module.parameters(), module.buffers()), None)
        if first is not None and first.device.type != "meta":
            return first.device
    return torch.device("cpu")


def _computes_on(model: Any) -> torch.device | None:
    """The one device all of a module's parameters and buffers are on; None for a module on
    several (``meta`` among them) or none, and for anything that is not a module."""
    if not isinstance(model, nn.Module):
        return None
    found = {tensor.device for tensor in itertools.chain(model.parameters(), model.buffers())}
    return next(iter(found)) if len(found) == 1 and next(iter(found)).type != "meta" else None


def as_call(batch: Batch, field_name: str = "inputs", index: int = 0) -> Call:
    """The call for one batch: a tensor, a tuple/list of positional arguments or a mapping of
    keyword arguments (string keys); a :class:`Call` is taken as it is."""
    if isinstance(batch, Call):
        return batch
    if isinstance(batch, Mapping):
        bad = next((key for key in batch if not isinstance(key, str)), None)
        if bad is not None:
            raise ConfigError(
                field_name,
                f"batch {index}",
                f"has the key {bad!r}; a dict batch holds keyword "
                "arguments, so its keys must be argument names (strings)",
            )
        return Call((), dict(batch))
    if isinstance(batch, (tuple, list)):
        return Call(tuple(batch))
    return Call((batch,))


def batches(inputs: Inputs, field_name: str = "inputs") -> Iterator[Call]:
    """Yield each batch of ``inputs`` as a :class:`Call`. A single tensor or a single mapping is
    one batch; any other iterable yields one batch per item (streamed, one held at a time)."""
    if isinstance(inputs, (Tensor, Mapping)):
        yield as_call(inputs, field_name)
        return
    if isinstance(inputs, (str, bytes)) or not isinstance(inputs, Iterable):
        raise ConfigError(
            field_name,
            inputs if isinstance(inputs, (str, int, float)) else type(inputs).__name__,
            "must be a tensor, a dict of keyword inputs, or an iterable of batches",
        )
    for index, batch in enumerate(inputs):
        yield as_call(batch, field_name, index)


def check_batch_finite(call: Call, index: int, field: str, error: type[ConfigError] = ConfigError) -> None:
    """Raise ``error`` naming batch ``index`` if its floating tensors hold NaN or Inf, or if a tensor of
    it is empty (a sequence of no token: a model's own reshape would fail on it, far from the cause)."""
    every = flatten_tensors([list(call.args), dict(call.kwargs)], floating_only=False)
    empty = next((tensor for tensor in every if tensor.dim() and tensor.numel() == 0), None)
    if empty is not None:
        raise error(
            field, f"batch {index}", f"holds an empty tensor of shape {tuple(empty.shape)}; give batches with data"
        )
    for tensor in call.tensors():
        if not torch.isfinite(tensor).all():
            raise error(field, f"batch {index}", "contains NaN or Inf; give finite inputs")


def outputs(model: nn.Module, call: Call) -> list[Tensor]:
    """Run ``model`` on one batch and return its floating-point output tensors, flattened."""
    return flatten_tensors(call(model))


def flatten_tensors(value: Any, *, floating_only: bool = True) -> list[Tensor]:
    """Tensors of a model output (tensor, tuple, list, dict, dataclass or ``to_tuple()`` object
    such as a Hugging Face ``ModelOutput``): the floating ones, or all with ``floating_only=False``."""
    if isinstance(value, Tensor):
        keep = not floating_only or value.is_floating_point() or value.is_complex()
        return [value] if keep else []
    if hasattr(value, "to_tuple"):
        value = value.to_tuple()
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = [getattr(value, f.name) for f in dataclasses.fields(value)]
    if isinstance(value, Mapping):
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in flatten_tensors(item, floating_only=floating_only)]
    return []


def run_batches(
    model: nn.Module, inputs: Inputs, *, field: str, progress: bool = True, error: type[ConfigError] = ConfigError
) -> int:
    """Run ``model`` on every batch of ``inputs`` in eval mode without gradients, each batch
    checked finite (``error`` naming ``field``), streamed one at a time, with a progress bar on
    a terminal. Returns how many batches ran (calibration passes of prune and quantize)."""
    total = 1 if isinstance(inputs, (Tensor, Mapping)) else len(inputs) if hasattr(inputs, "__len__") else None
    count, device = 0, device_of(model)
    with evaluating(model), torch.no_grad():
        for index, batch in enumerate(
            tqdm(
                batches(inputs, field),
                total=total,
                unit="batch",
                desc="calibrating",
                disable=None if progress else True,
                leave=False,
            )
        ):
            batch = moved(batch, device)  # batches come on the CPU; the model may be elsewhere
            check_batch_finite(batch, index, field, error)
            batch(model)
            count += 1
    return count


@contextlib.contextmanager
def trainable(model: nn.Module) -> Iterator[nn.Module]:
    """For the block, every floating parameter requires a gradient and has none accumulated;
    afterwards ``.grad`` and ``requires_grad`` are as before (gradients taken as calibration
    data must not leak into a user's training state)."""
    saved = [(p, p.grad, p.requires_grad) for p in model.parameters()]
    try:
        for p, _, _ in saved:
            p.grad = None
            if p.is_floating_point():
                p.requires_grad_(True)
        yield model
    finally:
        for p, grad, requires in saved:
            p.requires_grad_(requires)
            p.grad = grad


def run_backward_batches(
    model: nn.Module,
    pairs: Iterable,
    loss: Callable[[Any, Any], Tensor],
    *,
    field: str,
    progress: bool = True,
    after_each: Callable[[], None] | None = None,
) -> int:
    """Run ``loss(model(inputs), target).backward()`` for every ``(inputs, target)`` pair, in
    eval mode (no dropout, batch-norm statistics untouched) and :func:`trainable`.
    ``after_each()`` runs after each backward, while the gradients are in ``.grad``; they are
    cleared before the next pair. Returns how many pairs ran."""
    count, device = 0, device_of(model)
    with trainable(model), evaluating(model), torch.enable_grad():
        total = len(pairs) if hasattr(pairs, "__len__") else None
        for index, pair in enumerate(
            tqdm(
                pairs,
                total=total,
                unit="batch",
                desc="calibrating (gradients)",
                disable=None if progress else True,
                leave=False,
            )
        ):
            if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
                raise ConfigTypeError(
                    field,
                    f"batch {index}",
                    "must be an (inputs, target) pair: gradients need a loss, loss(model(inputs), target)",
                )
            call = moved(as_call(pair[0], field, index), device)
            check_batch_finite(call, index, field, ConfigError)
            value = loss(call(model), moved(pair[1], device))
            if not isinstance(value, Tensor) or value.numel() != 1 or not torch.isfinite(value).all():
                raise ConfigError(field, f"batch {index}", f"the loss is {value!r}; it must be one finite number")
            value.backward()
            if after_each is not None:
                after_each()
            model.zero_grad(set_to_none=True)
            count += 1
    return count


@contextlib.contextmanager
def evaluating(model: nn.Module) -> Iterator[nn.Module]:
    """Put ``model`` in eval mode for the block, then restore every module's training flag."""
    flags = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield model
    finally:
        for module, flag in flags:
            module.training = flag
