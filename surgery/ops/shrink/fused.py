"""Shrink a mixture-of-experts model's fused experts: traced and shrunk as per-expert layers
(:func:`surgery.ops.experts.linearizing.linearize`), then written back into the model's own fused
class at the smaller width, with its config following. The handle restores every original
object: the per-expert layers, the fused parameters and the config values."""

from __future__ import annotations

import logging
from collections.abc import Callable

from torch import Tensor, nn

from surgery.core._compat import get_slot, set_slot
from surgery.ops.experts.linearizing import Swapped, fold_back, linearize
from surgery.ops.shrink.replacing import ShrinkHandle
from surgery.ops.shrink.structure import FUSED_WIDTHS, ShrinkError, fingerprint

log = logging.getLogger("surgery")
CONFIG_WIDTHS = ("moe_intermediate_size", "intermediate_size")  # the config field they read it from


def shrink_experts(model: nn.Module, run: Callable[[], ShrinkHandle]) -> ShrinkHandle:
    """Run a shrink (``run``) with ``model``'s fused experts made per-expert layers, then give the
    fused modules the smaller tensors; without fused experts, just ``run()``."""
    original = fingerprint(model)  # a structure is sealed with the model as its constructor builds it
    swapped = linearize(model, release=False)  # a shrink puts the fused tensors back as they were
    if not swapped:
        return run()
    try:
        handle = run()
    except BaseException:
        fold_back(swapped)  # the shrink restored itself: the per-expert layers hold the originals
        raise
    handle.fingerprint = original
    with handle.applying():
        handle.add("put back the fused experts", lambda: _put_back(swapped), first=True)
        for name, parent, local, fused, linear in swapped:
            _refuse_uneven(name, linear)
            _write_smaller(handle, name, fused, linear.fused_tensors())
            setattr(parent, local, fused)
            handle.add(f"per-expert layers of {name}", lambda p=parent, n=local, e=linear: setattr(p, n, e))
        _forget_expert_layers(handle, [name for name, *_ in swapped])
        _update_config(handle, model, [(name, fused) for name, _, _, fused, _ in swapped])
    return handle


def _put_back(swapped: list[Swapped]) -> None:
    """The fused modules back in place of the per-expert layers (their tensors are the originals again)."""
    for _, parent, local, fused, _ in reversed(swapped):
        setattr(parent, local, fused)


def _refuse_uneven(name: str, linear: nn.Module) -> None:
    widths = {expert.down_proj.in_features for expert in linear}
    if len(widths) > 1:
        raise ShrinkError(
            f"shrink: the experts of {name} kept different widths {sorted(widths)}; one fused parameter "
            "holds one width (exclude the experts or select all of them)"
        )


def _write_smaller(handle: ShrinkHandle, name: str, fused: nn.Module, tensors: dict[str, Tensor]) -> None:
    """New, smaller parameters in ``fused`` where a tensor's shape changed (the originals go back on restore)."""
    changed = {attr: value for attr, value in tensors.items() if value.shape != get_slot(fused, attr).shape}
    if not changed:
        return
    for attr, value in changed.items():
        old = get_slot(fused, attr)
        new = nn.Parameter(value.to(old.dtype).contiguous(), requires_grad=old.requires_grad)
        set_slot(fused, attr, new)
        handle.parameters.setdefault(name, {})[attr] = (old, new)
        handle.add(f"put back {name}.{attr}", lambda a=attr, o=old: set_slot(fused, a, o))
    width = tensors["down_proj"].shape[1 if fused_transposed(fused) else 2]
    changes = {
        attr: (getattr(fused, attr), width) for attr in FUSED_WIDTHS if isinstance(getattr(fused, attr, None), int)
    }
    for attr, (_, new) in changes.items():
        setattr(fused, attr, new)
    if changes:
        handle.attributes[name] = changes
        handle.add(f"put back the width of {name}", lambda: [setattr(fused, a, old) for a, (old, _) in changes.items()])


def fused_transposed(fused: nn.Module) -> bool:
    """Whether ``fused`` keeps ``(E, in, out)`` weights (GPT-OSS)."""
    return bool(getattr(fused, "is_transposed", False))


def _forget_expert_layers(handle: ShrinkHandle, modules: list[str]) -> None:
    """The per-expert layers are gone from the model: they are no entries of the structure."""
    for name in [n for n in handle.replaced if any(n.startswith(f"{m}.") for m in modules)]:
        del handle.replaced[name]


def _update_config(handle: ShrinkHandle, model: nn.Module, fused: list[tuple[str, nn.Module]]) -> None:
    """Set the config's experts width (``moe_intermediate_size`` or ``intermediate_size``) when
    every experts module lost channels and now has the same width; else say why it stays."""
    config = getattr(model, "config", None)
    changed = [changes for name, _ in fused for changes in handle.attributes.get(name, {}).values()]
    if config is None or not changed:
        return
    olds, news = {old for old, _ in changed}, {new for _, new in changed}
    field = next((f for f in CONFIG_WIDTHS if len(olds) == 1 and getattr(config, f, None) in olds), None)
    if len(changed) < len(fused) or len(news) != 1 or field is None:
        log.warning(
            "shrink: the experts modules now have widths %s (%d of %d changed), not one the config can "
            "hold: model.config keeps its experts width (rebuild the model with surgery.rebuild)",
            sorted(news),
            len(changed),
            len(fused),
        )
        return
    old, new = getattr(config, field), next(iter(news))
    setattr(config, field, new)
    handle.config_changes = {field: (old, new)}
    handle.add(f"put back config.{field}", lambda: setattr(config, field, old))
