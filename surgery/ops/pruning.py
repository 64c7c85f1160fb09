"""``surgery.prune``: pruning masks enforced by forward-pre hooks, owned by a handle."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from surgery.core import compiled, guards
from surgery.core.errors import ConfigError, ConfigTypeError
from surgery.core.guards import SubtreeEnforcer
from surgery.core.handles import Handle
from surgery.ops.masks import METHODS, SCOPES, compute_masks, pack, unpack
from surgery.core.selection import Selection
from surgery.core.targets import Skipped, Targets, select_parameters


class MaskEnforcer:
    """The pruning transform of one parameter: its pruned entries are kept at zero.

    The mask is applied in place when pruning is attached, so everything that reads the
    parameter (its module's forward, or a parent that reads ``child.weight`` directly) sees
    the pruned values; the parameter's :class:`~surgery.core.guards.TensorGuard` re-applies it
    whenever the tensor changes. The mask is stored packed, one bit per entry.
    """

    kind = "prune"

    def __init__(self, param: nn.Parameter, mask: Tensor) -> None:
        self.param = param
        self.shape = mask.shape
        self.packed = pack(mask)

    def mask(self) -> Tensor:
        """The boolean keep-mask (``True`` keeps the entry)."""
        return unpack(self.packed, self.shape)

    def apply(self, param: Tensor) -> None:
        """Zero the pruned entries of ``param`` in place."""
        with torch.no_grad():
            param.masked_fill_(~self.mask().to(param.device), 0)


class PruneHandle(Handle):
    """Handle returned by :func:`prune`; also reports the masks and the sparsity it made."""

    def __init__(self, model: nn.Module, selection: Targets | None = None) -> None:
        super().__init__("prune", model)
        self.enforcers: dict[str, MaskEnforcer] = {}
        self.selection = selection or Targets({}, [])

    @property
    def parameters(self) -> list[str]:
        """Qualified names of the masked parameters: what :meth:`sparsity` is computed over."""
        return list(self.enforcers)

    @property
    def skipped(self) -> list[Skipped]:
        """Selected (or, by default, unselected) layers and parameters left unpruned, with why."""
        return list(self.selection.skipped)

    def check_undo(self) -> None:
        for name, enforcer in self.enforcers.items():
            guards.check_last(enforcer.param, enforcer, name)

    def masks(self) -> dict[str, Tensor]:
        """Boolean keep-masks by qualified parameter name (``"layer1.0.conv1.weight"``)."""
        return {name: e.mask() for name, e in self.enforcers.items()}

    def layer_sparsity(self) -> dict[str, float]:
        """Fraction of pruned entries per masked parameter."""
        return {name: 1.0 - e.mask().float().mean().item() for name, e in self.enforcers.items()}

    def sparsity(self) -> float:
        """Fraction of pruned entries over the masked parameters together (those listed by
        :attr:`parameters`; biases, norms and layers outside the selection do not count)."""
        masks = [e.mask() for e in self.enforcers.values()]
        total = sum(m.numel() for m in masks)
        return 1.0 - sum(int(m.sum()) for m in masks) / total if total else 0.0


def prune(
    model: nn.Module,
    amount: float,
    *,
    method: str = "l1_unstructured",
    scope: str = "layer",
    select: Selection = None,
    exclude: Selection = None,
    n: float = 2.0,
    dim: int = 0,
    seed: int = 0,
) -> PruneHandle:
    """Prune the ``weight`` of the selected layers and return a handle that can undo it.

    Args:
        model: the model to modify in place.
        amount: fraction in [0, 1] of weight entries (or of slices, for ``ln_structured``)
            to set to zero.
        method: ``"l1_unstructured"`` (smallest magnitudes), ``"random_unstructured"``
            (seeded by ``seed``) or ``"ln_structured"`` (whole slices along ``dim`` with the
            smallest Ln norm, ``dim=0`` = output channels/filters).
        scope: ``"layer"`` (each weight pruned by ``amount``) or ``"global"`` (one ranking
            across all selected weights).
        select: layers to prune (see :func:`surgery.select`; their ``weight``), or any
            floating parameter by qualified name (``"**.weight_ih_l0"``); default every
            ``nn.Conv1d/2d/3d``, ``nn.Linear`` and Hugging Face ``Conv1D``. What is left out
            and why is in :attr:`PruneHandle.skipped` (and logged).
        exclude: modules never pruned, even if selected.

    Returns:
        A :class:`PruneHandle`: ``restore()`` puts back the exact original values,
        ``bake()`` keeps the zeros and removes every hook.

    Example:
        >>> handle = surgery.prune(model, 0.5, method="ln_structured", select="layer4.*")
        >>> handle.sparsity()
        0.5
    """
    model = compiled.prepare(model)  # a torch.compile wrapper: the model it compiles
    amount, n = validate_arguments(amount, method, scope, n, seed)
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise ConfigTypeError("prune.dim", dim, "must be an integer (the dimension whose slices ln_structured prunes)")
    selection = prune_targets(model, select, exclude, dim)
    targets = {name: target.param for name, target in selection.matched.items()}
    guards.check_editable(targets, "prune.select")
    params = list(targets.values())
    current = [guards.current_value(p) for p in params]  # as attached transforms keep them
    if method != "random_unstructured":
        for name, value in zip(targets, current):
            if not torch.isfinite(value).all():
                raise ConfigError("prune.select", name, f"has NaN or Inf entries; {method} ranks by magnitude and "
                                  "needs finite weights (exclude the layer, fix the weights or use random_unstructured)")
    masks = compute_masks(current, amount, method=method, scope=scope, n=n, dim=dim, seed=seed)
    handle = PruneHandle(model, selection)
    try:
        by_param = {}
        for (name, param), mask in zip(targets.items(), masks):
            handle.enforcers[name] = _attach(handle, name, param, mask)
            by_param[id(param)] = guards.guard_of(param)
        for module, below in guards.paths_to_owners(model, params):
            hook = module.register_forward_pre_hook(SubtreeEnforcer([by_param[i] for i in below]))
            handle.add_hook("mask hook", hook)
    except BaseException as err:
        handle.rollback(err)
        raise
    return handle


def validate_arguments(amount: object, method: str, scope: str, n: object, seed: object) -> tuple[float, float]:
    """Check prune's settings (also used by the CLI config); return ``(amount, norm order)``."""
    if isinstance(amount, bool) or not isinstance(amount, (int, float)):
        raise ConfigTypeError("prune.amount", amount, "must be a number in [0, 1]")
    if amount != amount or not 0.0 <= amount <= 1.0:  # NaN, or out of range (huge integers too)
        raise ConfigError("prune.amount", amount, "must be a number in [0, 1]")
    if method not in METHODS:
        raise ConfigError("prune.method", method, f"must be one of {', '.join(METHODS)}")
    if scope not in SCOPES:
        raise ConfigError("prune.scope", scope, f"must be one of {', '.join(SCOPES)}")
    norm = {"inf": math.inf, "fro": 2.0}.get(n, n) if isinstance(n, str) else n
    if isinstance(norm, int) and not isinstance(norm, bool) and norm > 1e308:
        norm = math.inf  # an integer too large for a float: the max norm, as 'inf'
    if isinstance(norm, bool) or not isinstance(norm, (int, float)) or math.isnan(norm) or norm <= 0:
        raise ConfigError("prune.n", n, "must be a positive number, 'inf' or 'fro'")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ConfigTypeError("prune.seed", seed, "must be an integer")
    return float(amount), float(norm)


def prune_targets(model: nn.Module, include: Selection, exclude: Selection, dim: int = 0) -> Targets:
    """The weights :func:`prune` would mask, and those it would skip (also the dry run's)."""
    targets = select_parameters(model, include, exclude, verb="prune")
    for name, target in targets.matched.items():
        weight = target.param
        if not -weight.dim() <= dim < weight.dim():
            raise ConfigError("prune.dim", dim, f"must index a dimension of {name} {tuple(weight.shape)}")
    return targets


def _attach(handle: PruneHandle, name: str, param: nn.Parameter, mask: Tensor) -> MaskEnforcer:
    pruned = ~mask.to(param.device)
    original = param.detach()[pruned]  # only the entries about to be zeroed
    enforcer = MaskEnforcer(param, mask)

    def put_back() -> None:
        guards.detach(param, enforcer, name)
        with torch.no_grad():
            param.masked_scatter_(~enforcer.mask().to(param.device), original.to(param.device, param.dtype))

    def keep() -> None:  # the original goes with the handle's steps once the whole bake succeeded
        guards.settle(param)  # changed since the last forward: bake what the hooks would enforce
        guards.detach(param, enforcer, name)

    handle.add("restore pruned values", put_back, keep)  # recorded before the change
    guards.attach(param, enforcer, name)
    return enforcer
