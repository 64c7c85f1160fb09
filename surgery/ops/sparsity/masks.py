"""Masks on weights: the hook that keeps them holding (``MaskEnforcer``) and the handle that owns them (``PruneHandle``)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from surgery.core.handles import Handle
from surgery.core.originals import Originals
from surgery.core.sequential import SequentialReport
from surgery.core.targets import Skipped, Targets
from surgery.core.transforms import Saved, SavedEntries, SavedTensor, attach_all
from surgery.ops.numerics.deployment import SparsityMask
from surgery.ops.sparsity.criteria import (
    pack,
    unpack,
)
from surgery.ops.sparsity.spec import PruneSpec


class MaskEnforcer:
    """The pruning transform of one parameter: its pruned entries are kept at zero.

    The mask is applied in place when pruning is attached, so everything that reads the
    parameter (its module's forward, or a parent that reads ``child.weight`` directly) sees
    the pruned values; the parameter's guard re-applies it whenever the tensor changes and
    after every optimizer step, and :meth:`on_gradient` zeroes the accumulated gradient of
    pruned entries. The mask is stored packed, one bit per entry; undo keeps only the entries
    it zeroes. Once training starts (the first gradient), the flat indices of the pruned
    entries are kept too (8 bytes per pruned entry), because zeroing by index is about five
    times faster than by boolean mask and a training step pays it twice.
    """

    kind = "prune"

    def __init__(self, mask: Tensor, update: Tensor | None = None, saved: Saved | None = None) -> None:
        self.shape = mask.shape
        self.packed = pack(mask)
        self._indices: Tensor | None = None  # flat indices of the pruned entries, while training
        self.pending = update  # updated weights, written once when attached
        self.rewrites = update is not None or saved is not None
        self.saved = saved  # the originals, kept before a method wrote its values into the weight

    def mask(self) -> Tensor:
        """The boolean keep-mask (``True`` keeps the entry)."""
        return unpack(self.packed, self.shape)

    def save(self, param: Tensor) -> SavedEntries | SavedTensor:
        """The original values of the entries about to be zeroed (all of them when the kept
        weights are updated too, as kept before they were)."""
        if self.saved is not None:
            return self.saved
        if self.rewrites:
            return SavedTensor(param)
        return SavedEntries(param, ~self.mask(), lambda: ~self.mask())

    def apply(self, param: Tensor) -> None:
        """Zero the pruned entries of ``param`` in place (first writing the updated weights, once)."""
        with torch.no_grad():
            if self.pending is not None:
                param.copy_(self.pending.to(param.device, param.dtype))
                self.pending = None
            self._zero(param, train=False)

    def on_gradient(self, param: Tensor) -> None:
        """Zero the pruned entries of ``param.grad`` (a post-accumulate-grad hook), so
        momentum and Adam states of pruned weights stay zero and no step moves them."""
        grad = param.grad
        if grad is None:
            return
        if grad.layout != torch.strided:  # a sparse gradient (nn.Embedding(sparse=True))
            keep = self.mask().to(grad.device)
            param.grad = (grad.to_dense() * keep).to_sparse() if grad.is_sparse else grad.to_dense() * keep
            return
        self._zero(grad, train=True)

    def release(self) -> None:
        """Drop the training cache (the transform was restored or baked)."""
        self._indices = None

    def _zero(self, tensor: Tensor, train: bool) -> None:
        if tensor.is_contiguous() and (train or self._indices is not None):
            if self._indices is None or self._indices.device != tensor.device:
                self._indices = torch.nonzero(~self.mask().flatten()).flatten().to(tensor.device)
            tensor.view(-1).index_fill_(0, self._indices, 0)
        else:  # not yet training, or a strided layout (channels_last) a flat index cannot address
            tensor.masked_fill_(~self.mask().to(tensor.device), 0)


class PruneHandle(Handle):
    """Handle returned by :func:`prune`; also reports the masks and the sparsity it made."""

    def __init__(self, model: nn.Module, selection: Targets | None = None, spec: PruneSpec | None = None) -> None:
        super().__init__("prune", model)
        self.enforcers: dict[str, MaskEnforcer] = {}
        self.selection = selection or Targets({}, [])
        self.spec = spec
        self.sequential: SequentialReport | None = None  # a second-order method's calibration pass

    @property
    def parameters(self) -> list[str]:
        """Qualified names of the masked parameters: what :meth:`sparsity` is computed over."""
        return list(self.enforcers)

    @property
    def skipped(self) -> list[Skipped]:
        """Selected (or, by default, unselected) layers and parameters left unpruned, with why."""
        return list(self.selection.skipped)

    def export_parts(self) -> list:
        if self.state != "attached":
            return []
        return [SparsityMask(name, mask) for name, mask in self.masks().items()]

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


def mask_enforcers(
    params: dict[str, nn.Parameter], masks: dict[str, Tensor], spilled: Originals | None
) -> dict[str, tuple[nn.Parameter, MaskEnforcer]]:
    """The mask of each parameter; with ``spilled``, its original kept there first (on disk)."""
    made = {}
    for name, param in params.items():
        if spilled is not None:
            spilled.keep(name, param)  # unless a calibration pass kept it before writing
        made[name] = (param, MaskEnforcer(masks[name], saved=None if spilled is None else spilled.saved(name)))
    return made


def attach_masks(
    handle: PruneHandle,
    model: nn.Module,
    enforcers: Callable[[], dict[str, tuple[nn.Parameter, MaskEnforcer]]],
    written: Originals | None = None,
) -> PruneHandle:
    """Attach the masks ``enforcers()`` makes to ``handle``, all or nothing (weights a method
    already ``written`` into are put back from there on failure)."""
    try:
        made = enforcers()
        handle.enforcers.update({name: enforcer for name, (_, enforcer) in made.items()})
        attach_all(handle, model, made, "mask hook")
    except BaseException as err:
        handle.rollback(err)
        if written is not None:
            written.put_back()
        raise
    return handle
