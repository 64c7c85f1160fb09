"""``surgery.rewrite_inputs``: forward-pre hooks that rewrite a module's inputs, and built-in rewrites.

The file holds the verb :func:`rewrite_inputs`, its picklable hook :class:`InputRewriter`, the
handle :class:`RewriteHandle`, the built-in rewrites (:class:`Cast`, :class:`Normalize`,
:class:`Resize`, :class:`ChannelsLast`, :class:`Clamp`, :class:`AddNoise`, :class:`Identity`),
:func:`rewrite_from_config` (a rewrite by name or dotted import path) and
:func:`identity_rewrite` (a plain-function rewrite usable as a dotted path).

A rewrite is any callable ``(args: tuple, kwargs: dict) -> (args, kwargs)``. The built-ins act
on floating-point tensors only: positional inputs (all, or those listed in ``index``) and
keyword values (all, or those listed in ``keys``); every other input passes through untouched.
"""

from __future__ import annotations

import difflib
import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from surgery.core import compiled
from surgery.core.errors import ConfigError, ConfigTypeError
from surgery.core.handles import Handle
from surgery.core.importing import import_object
from surgery.core.registry import Registry
from surgery.core.selection import select as select_modules
from surgery.core.verbs import VerbCall, verb

Rewrite = Callable[[tuple, dict], tuple[tuple, dict]]

RESIZE_MODES = ("nearest", "nearest-exact", "linear", "bilinear", "bicubic", "trilinear", "area")
_ALIGNABLE = ("linear", "bilinear", "bicubic", "trilinear")


# --------------------------------------------------------------------------- the hook and verb


@compiled.eager_at_top_level
class InputRewriter:
    """The forward-pre hook (registered ``with_kwargs=True``) that applies one rewrite.

    A module-level class rather than a closure, so a model with the hook attached can be
    deep-copied and pickled whenever ``fn`` can.
    """

    def __init__(self, fn: Rewrite, name: str) -> None:
        self.fn = fn
        self.name = name

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        result = self.fn(tuple(args), dict(kwargs))
        if not (isinstance(result, (tuple, list)) and len(result) == 2):
            raise ConfigTypeError("rewrite", self.label, f"must return (args, kwargs), got {type(result).__name__}")
        new_args, new_kwargs = result
        if not isinstance(new_args, (tuple, list)) or not isinstance(new_kwargs, dict):
            raise ConfigTypeError(
                "rewrite",
                self.label,
                "must return (args, kwargs) as (tuple, dict), got "
                f"({type(new_args).__name__}, {type(new_kwargs).__name__})",
            )
        if len(new_args) != len(args):
            raise ConfigError(
                "rewrite", self.label, f"changed the number of positional inputs from {len(args)} to {len(new_args)}"
            )
        return tuple(new_args), new_kwargs

    @property
    def label(self) -> str:
        """The qualified name of the hooked module (``"<root>"`` for the model itself)."""
        return self.name or "<root>"

    def __repr__(self) -> str:
        return f"InputRewriter({self.fn!r} on {self.label})"


class RewriteHandle(Handle):
    """Handle returned by :func:`rewrite_inputs`."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__("rewrite", model)

    def outside_weights(self) -> list[str]:
        return ["input rewrites"] if self.state == "attached" else []

    def bake(self) -> nn.Module | None:
        """Remove every rewrite hook and return the plain model, **without** the rewrite.

        An input rewrite cannot be folded into weights, so baking it is the same as restoring
        it, except that the handle ends in the ``"baked"`` state. Rewrite the inputs yourself
        (or keep the handle attached) if the baked model must still see rewritten inputs.
        """
        return super().bake()


@dataclass(frozen=True)
class RewriteSpec:
    """An input rewrite by name, validated when built: a built-in (``cast``, ``normalize``,
    ``resize``, ``channels_last``, ``clamp``, ``add_noise``, ``identity``) with its ``kwargs``,
    or the dotted path of a rewrite; ``select=None`` rewrites the root model's inputs."""

    name: str = "identity"
    kwargs: dict[str, Any] = field(default_factory=dict)
    select: Any = None
    exclude: Any = None
    fn: Any = None  # from Python: the rewrite function itself, instead of a name and its kwargs

    def __post_init__(self) -> None:
        object.__setattr__(self, "kwargs", dict(self.kwargs or {}))
        if self.fn is not None and (self.name != "identity" or self.kwargs):
            raise ConfigError("rewrite.fn", self.fn, "is the rewrite itself: give it or a name with kwargs, not both")
        if self.fn is not None and not callable(self.fn):
            raise ConfigTypeError("rewrite.fn", self.fn, "must be a callable (args, kwargs) -> (args, kwargs)")
        rewrite = self.rewrite()
        check_signature(rewrite, "rewrite.fn", getattr(rewrite, "__name__", type(rewrite).__name__))

    def rewrite(self) -> Rewrite:
        """The rewrite function this spec names (or holds)."""
        return self.fn if self.fn is not None else rewrite_from_config(self.name, **self.kwargs)


@verb("rewrite", RewriteSpec, positional="fn", calibration="none")
def rewrite_inputs(model: nn.Module, spec: RewriteSpec, call: VerbCall) -> RewriteHandle:
    """Rewrite the positional and keyword inputs of the model or of selected submodules.

    Each target gets a forward-pre hook registered with ``with_kwargs=True`` that calls
    ``fn(args, kwargs)`` and feeds the returned ``(args, kwargs)`` to ``forward``. Applying is
    all-or-nothing: if registering any hook fails, the ones already registered are removed.

    Args:
        model: the model to modify in place.
        fn: a rewrite ``(args: tuple, kwargs: dict) -> (args, kwargs)``: a built-in such as
            :class:`Normalize`, one from :func:`rewrite_from_config`, or any callable. It must
            keep the number of positional inputs (else :class:`~surgery.core.errors.ConfigError`
            naming the module is raised at call time).
        spec: a :class:`RewriteSpec` instead (a built-in rewrite by name, or ``fn``; and the selection).
        select: submodules to hook (see :func:`surgery.select`); ``None`` hooks the root only.
        exclude: submodules never hooked, even if selected; only with ``select``.

    Returns:
        A :class:`RewriteHandle`: ``restore()`` removes every hook; ``bake()`` also removes
        every hook and returns the plain model, *without* the rewrite (it cannot be folded
        into weights).

    Example:
        >>> with surgery.rewrite_inputs(model, Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))):
        ...     logits = model(images)       # images are normalised on the way in
    """
    fn, select, exclude = spec.rewrite(), spec.select, spec.exclude
    if select is None:
        if exclude:  # an empty list (the CLI default) is fine
            raise ConfigError(
                "rewrite.exclude",
                exclude,
                "only applies together with rewrite.select",
                "rewrite.select=null hooks the root model alone",
            )
        targets = {"": model}
    else:
        targets = select_modules(
            model, select, exclude=exclude, field="rewrite.select", exclude_field="rewrite.exclude"
        )
    handle = RewriteHandle(model)
    with handle.applying():
        for name, module in targets.items():
            hook = module.register_forward_pre_hook(InputRewriter(fn, name), with_kwargs=True)
            handle.add_hook(f"rewrite hook on {name or '<root>'}", hook)
    return handle


def identity_rewrite(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A rewrite that changes nothing; ``rewrite_from_config("surgery.ops.rewrite.rewriting.identity_rewrite")``.

    It exists as the reference example of a plain-function rewrite given by dotted path.

    Example:
        >>> identity_rewrite((x,), {"scale": 2.0}) == ((x,), {"scale": 2.0})
        True
    """
    return args, kwargs


# --------------------------------------------------------------------------- built-in rewrites


@dataclass
class TensorRewrite:
    """Base of the built-ins: applies :meth:`apply` to each chosen floating-point tensor input.

    Attributes:
        index: positions of the positional inputs to rewrite (``None`` = all of them).
        keys: names of the keyword inputs to rewrite (``None`` = all of them).
    """

    index: int | Sequence[int] | None = field(default=None, kw_only=True)
    keys: str | Sequence[str] | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        if isinstance(self.index, int) and not isinstance(self.index, bool):
            self.index = (self.index,)
        if isinstance(self.keys, str):
            self.keys = (self.keys,)
        if self.index is not None:
            self.index = tuple(self.index)
            if any(isinstance(i, bool) or not isinstance(i, int) for i in self.index):
                raise ConfigTypeError("rewrite.index", self.index, "must be an int, a list of ints or None")
        if self.keys is not None:
            self.keys = tuple(self.keys)
            if not all(isinstance(k, str) for k in self.keys):
                raise ConfigTypeError("rewrite.keys", self.keys, "must be a name, a list of names or None")

    def __call__(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        count = len(args)
        chosen = range(count) if self.index is None else {i % count for i in self.index if -count <= i < count}
        new_args = tuple(self._maybe(a) if i in chosen else a for i, a in enumerate(args))
        new_kwargs = {k: self._maybe(v) if self.keys is None or k in self.keys else v for k, v in kwargs.items()}
        return new_args, new_kwargs

    def _maybe(self, value: Any) -> Any:
        return self.apply(value) if isinstance(value, Tensor) and value.is_floating_point() else value

    def apply(self, x: Tensor) -> Tensor:
        """Rewrite one floating-point tensor (subclasses)."""
        return x


@dataclass
class Identity(TensorRewrite):
    """Changes nothing: the inputs are passed on as the very same objects."""

    def __call__(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return args, kwargs


@dataclass
class Cast(TensorRewrite):
    """Casts floating-point inputs to ``dtype`` (a ``torch.dtype`` or a name like ``"float64"``)."""

    dtype: torch.dtype | str = torch.float32

    def __post_init__(self) -> None:
        super().__post_init__()
        self.dtype = _dtype(self.dtype)

    def apply(self, x: Tensor) -> Tensor:
        return x.to(self.dtype)


@dataclass
class Normalize(TensorRewrite):
    """Per-channel ``(x - mean) / std`` along dim 1 (a scalar applies to every channel)."""

    mean: float | Sequence[float] = 0.0
    std: float | Sequence[float] = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        self.mean = _floats("rewrite.mean", self.mean)
        self.std = _floats("rewrite.std", self.std)
        if any(not s > 0 for s in self.std):
            raise ConfigError("rewrite.std", self.std, "every std must be a positive number")
        if len(self.mean) != len(self.std) and 1 not in (len(self.mean), len(self.std)):
            raise ConfigError("rewrite.std", self.std, f"must have as many channels as rewrite.mean ({len(self.mean)})")

    def apply(self, x: Tensor) -> Tensor:
        return (x - self._per_channel(self.mean, x)) / self._per_channel(self.std, x)

    @staticmethod
    def _per_channel(values: tuple[float, ...], x: Tensor) -> Tensor:
        t = torch.tensor(values, dtype=x.dtype, device=x.device)
        if len(values) == 1:
            return t.reshape(())
        if x.dim() < 2 or x.shape[1] != len(values):
            raise ConfigError(
                "rewrite",
                tuple(x.shape),
                f"Normalize has {len(values)} channels but the input does not have them along dim 1",
            )
        return t.reshape(1, -1, *([1] * (x.dim() - 2)))


@dataclass
class Resize(TensorRewrite):
    """Resizes spatial dims with ``torch.nn.functional.interpolate`` (``align_corners=False``)."""

    size: int | Sequence[int] = 224
    mode: str = "bilinear"

    def __post_init__(self) -> None:
        super().__post_init__()
        sizes = (self.size,) if isinstance(self.size, int) else tuple(self.size)
        if not sizes or any(isinstance(s, bool) or not isinstance(s, int) or s <= 0 for s in sizes):
            raise ConfigError("rewrite.size", self.size, "must be a positive int or a list of positive ints")
        self.size = sizes[0] if isinstance(self.size, int) else sizes
        if self.mode not in RESIZE_MODES:
            raise ConfigError("rewrite.mode", self.mode, f"must be one of {', '.join(RESIZE_MODES)}")

    def apply(self, x: Tensor) -> Tensor:
        align = False if self.mode in _ALIGNABLE else None
        return F.interpolate(x, size=self.size, mode=self.mode, align_corners=align)


@dataclass
class ChannelsLast(TensorRewrite):
    """Makes 4-d inputs ``torch.channels_last`` contiguous; other tensors pass through."""

    def apply(self, x: Tensor) -> Tensor:
        return x.contiguous(memory_format=torch.channels_last) if x.dim() == 4 else x


@dataclass
class Clamp(TensorRewrite):
    """Clamps inputs to ``[min, max]`` (either bound may be ``None``, not both)."""

    min: float | None = None
    max: float | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("min", "max"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value)
            ):
                raise ConfigError(f"rewrite.{name}", value, "must be a number or None")
        if self.min is None and self.max is None:
            raise ConfigError("rewrite.min", None, "set rewrite.min, rewrite.max or both")
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ConfigError("rewrite.max", self.max, f"must be >= rewrite.min ({self.min})")

    def apply(self, x: Tensor) -> Tensor:
        return x.clamp(self.min, self.max)


@dataclass
class AddNoise(TensorRewrite):
    """Adds Gaussian noise of standard deviation ``std``, seeded and reproducible.

    The noise comes from a CPU ``torch.Generator`` seeded with ``seed`` on first use; the
    sequence *advances with every call*, so two fresh ``AddNoise`` with the same seed give the
    same outputs call after call, while one instance gives different noise on each call.
    Copies (``copy.deepcopy``, pickling) carry the generator's current position.
    """

    std: float = 0.1
    seed: int = 0
    _generator: torch.Generator | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if (
            isinstance(self.std, bool)
            or not isinstance(self.std, (int, float))
            or not self.std >= 0
            or math.isinf(self.std)
        ):
            raise ConfigError("rewrite.std", self.std, "must be a finite number >= 0")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ConfigTypeError("rewrite.seed", self.seed, "must be an integer")

    def apply(self, x: Tensor) -> Tensor:
        if self._generator is None:
            self._generator = torch.Generator().manual_seed(self.seed)
        noise = torch.randn(x.shape, generator=self._generator, dtype=x.dtype)
        return x + self.std * noise.to(x.device)

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        generator = state.pop("_generator")
        state["_generator_state"] = None if generator is None else generator.get_state()
        return state

    def __setstate__(self, state: dict) -> None:
        state = dict(state)
        generator_state = state.pop("_generator_state")
        self.__dict__.update(state)
        self._generator = None
        if generator_state is not None:
            self._generator = torch.Generator()
            self._generator.set_state(generator_state)


# --------------------------------------------------------------------------- by name


REWRITES: Registry[Callable[..., Rewrite]] = Registry("rewrite.name")


def register_rewrite(name: str, factory: Callable[..., Rewrite], *, replace: bool = False) -> Callable[..., Rewrite]:
    """Make ``factory(**params) -> rewrite`` available as ``rewrite.name=name`` (with
    ``rewrite.kwargs`` as its parameters) in recipes.

    Example:
        >>> surgery.register_rewrite("halve", lambda: lambda args, kwargs: ((args[0] / 2, *args[1:]), kwargs))
    """
    if not callable(factory):
        raise ConfigError("register_rewrite.factory", factory, "must be a callable returning a rewrite")
    return REWRITES.register(name, factory, replace=replace)


for _name, _factory in (
    ("cast", Cast),
    ("normalize", Normalize),
    ("resize", Resize),
    ("channels_last", ChannelsLast),
    ("clamp", Clamp),
    ("add_noise", AddNoise),
    ("identity", Identity),
):
    register_rewrite(_name, _factory)


def rewrite_from_config(name: str, **kwargs: Any) -> Rewrite:
    """Build a rewrite from its name and parameters (what the CLI's ``rewrite`` group holds).

    Args:
        name: a built-in (``cast``, ``normalize``, ``resize``, ``channels_last``, ``clamp``,
            ``add_noise``, ``identity``) or the dotted import path ``pkg.module.callable`` of a
            rewrite ``(args, kwargs) -> (args, kwargs)``, which takes no parameters.
        **kwargs: the built-in's parameters (``dtype`` for ``cast`` may be a name such as
            ``"float64"``).

    Example:
        >>> rewrite_from_config("normalize", mean=[0.5, 0.5, 0.5], std=[0.25, 0.25, 0.25])
        Normalize(index=None, keys=None, mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25))
    """
    if not isinstance(name, str):
        raise ConfigTypeError("rewrite.name", name, "must be a string")
    if name in REWRITES:
        cls = REWRITES.get(name)
        try:
            return cls(**kwargs)
        except ConfigError as err:  # name the field as the config spells it: rewrite.kwargs.<name>
            key = err.field.removeprefix("rewrite.")
            if key not in kwargs:
                raise
            raise type(err)(f"rewrite.kwargs.{key}", err.value, err.allowed, err.hint) from None
        except TypeError as err:
            raise ConfigError("rewrite.kwargs", kwargs, f"invalid parameters for '{name}': {err}") from None
    if "." in name:
        found = _import_callable(name)
        if kwargs:
            raise ConfigError("rewrite.kwargs", kwargs, f"the dotted-path rewrite '{name}' takes no parameters")
        return found
    close = difflib.get_close_matches(name, REWRITES.names(), n=1)
    raise ConfigError(
        "rewrite.name",
        name,
        f"must be one of {', '.join(REWRITES.names())} or an importable 'pkg.module.callable'",
        f"did you mean {close[0]!r}?" if close else "",
    )


def _import_callable(path: str) -> Rewrite:
    found = import_object(path, "rewrite.name")
    if not callable(found):
        raise ConfigError("rewrite.name", path, "is not callable; expected a rewrite (args, kwargs) -> (args, kwargs)")
    check_signature(found, "rewrite.name", path)
    return found


def check_signature(fn: Callable, field: str, value: object) -> None:
    """Raise :class:`ConfigError` unless ``fn`` can be called as ``fn(args, kwargs)``."""
    try:
        inspect.signature(fn).bind((), {})
    except TypeError:
        raise ConfigError(
            field, value, "cannot be called as a rewrite: it must accept (args, kwargs) and return (args, kwargs)"
        ) from None
    except ValueError:
        pass  # no signature to inspect (some builtins): the call itself will tell


def _dtype(value: object) -> torch.dtype:
    if isinstance(value, torch.dtype):
        return value
    found = getattr(torch, value.removeprefix("torch."), None) if isinstance(value, str) else None
    if not isinstance(found, torch.dtype):
        raise ConfigError("rewrite.dtype", value, "must be a torch dtype or its name, e.g. 'float64' or 'float16'")
    return found


def _floats(field_name: str, value: object) -> tuple[float, ...]:
    values = (value,) if isinstance(value, (int, float)) else value
    try:
        result = tuple(float(v) for v in values if not isinstance(v, bool))  # type: ignore[union-attr]
        ok = len(result) == len(values) and len(result) > 0 and all(math.isfinite(v) for v in result)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):
        ok = False
    if not ok or isinstance(value, (bool, str)):
        raise ConfigError(field_name, value, "must be a finite number or a list of finite numbers")
    return result
