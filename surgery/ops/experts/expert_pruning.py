"""Remove whole experts of a mixture-of-experts model: the same number from every experts layer, the
ones a registered criterion (``"reap"``, ``"frequency"``, ``"random"``) scores lowest on calibration
tokens.

The fused experts' parameters (``gate_up_proj``, ``down_proj`` and their biases) and the router's
rows (``weight``, ``bias``, ``e_score_correction_bias``) keep the surviving experts in order; the
expert counts on the experts module, the router, the block and the model's config follow, so the
pruned model runs, saves and loads as a smaller model of its family. ``restore()`` puts the original
tensors and counts back (the same objects: bit for bit).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from surgery.core import guards
from surgery.core._compat import get_slot, set_slot
from surgery.core.errors import AlreadyModifiedError, ConfigError, ConfigTypeError
from surgery.core.handles import Handle, attached_after
from surgery.core.inputs import Inputs
from surgery.core.registry import Registry
from surgery.core.verbs import VerbCall, verb
from surgery.ops.experts.expert_scores import EXPERT_CRITERIA, ExpertStats, observe
from surgery.ops.experts.layouts import fused_experts
from surgery.ops.experts.linearizing import linearized
from surgery.ops.experts.routing import linear_experts_in

COUNT_ATTRS = ("num_experts", "num_local_experts", "n_routed_experts")  # where a count of experts is kept
RouterCheck = Callable[[nn.Module, int], "str | None"]
ROUTERS: Registry[RouterCheck] = Registry("prune_experts.router")


def register_router(class_name: str, check: RouterCheck, *, replace: bool = False) -> None:
    """Declare a router class whose experts can be removed: its forward returns ``(logits over all
    experts, top-k weights, top-k indices)``, its per-expert rows lie along dim 0, and ``check(router,
    new_count)`` says why it cannot route over ``new_count`` experts (``None``: it can)."""
    ROUTERS.register(class_name, check, replace=replace)


def _any_count(router: nn.Module, count: int) -> str | None:
    """A softmax top-k router routes over any number of experts."""
    return None


def _grouped(router: nn.Module, count: int) -> str | None:
    """DeepSeek-V3's grouped routing: ``n_group`` groups of at least two experts each."""
    groups = int(router.num_group)
    if count % groups or count // groups < 2:
        return f"which do not split into n_group={groups} groups of at least 2 (grouped routing)"
    return None


for _name in ("MixtralTopKRouter", "Qwen2MoeTopKRouter", "Qwen3MoeTopKRouter", "OlmoeTopKRouter", "GptOssTopKRouter"):
    register_router(_name, _any_count)
register_router("DeepseekV3TopkRouter", _grouped)


class ExpertPruneHandle(Handle):
    """The record of :func:`prune_experts`: per experts layer, the experts kept and removed (original
    indices), each expert's score and routed calibration tokens, and the counts before and after."""

    def __init__(self, model: nn.Module, criterion: str) -> None:
        super().__init__("prune_experts", model)
        self.criterion = criterion
        self.kept: dict[str, list[int]] = {}
        self.removed: dict[str, list[int]] = {}
        self.scores: dict[str, list[float]] = {}
        self.tokens_per_expert: dict[str, list[int]] = {}
        self.num_experts: dict[str, int] = {}  # {"before": E, "after": E'}

    def restore(self) -> None:
        """Put the original experts, router rows and counts back; refused (nothing changed) while a
        handle applied after it is still attached: it holds the smaller tensors, or was fitted to them."""
        later = attached_after(self) if self.state == "attached" else []
        if later:
            kinds = ", ".join(h.kind for h in later)
            raise AlreadyModifiedError(
                f"prune_experts: {kinds} was applied after it and is still attached (on the experts left); "
                f"restore {kinds} first (undo in reverse order), or compose them"
            )
        super().restore()


@dataclass(frozen=True)
class PruneExpertsSpec:
    """How to prune experts (see :func:`prune_experts`): ``amount`` (a fraction of each layer's
    experts, or a count), the registered ``criterion`` that scores them, and the ``seed`` of
    ``"random"``."""

    amount: float | int = 0.25
    criterion: str = "reap"
    seed: int = 0

    def __post_init__(self) -> None:
        EXPERT_CRITERIA.get(self.criterion)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ConfigTypeError("prune_experts.seed", self.seed, "must be an integer")


@verb(
    "prune_experts",
    PruneExpertsSpec,
    positional="amount",
    old_positional=("amount", "calibration"),
)
def prune_experts(model: nn.Module, spec: PruneExpertsSpec, call: VerbCall) -> ExpertPruneHandle:
    """Remove the experts scoring lowest by ``criterion`` from every experts layer of ``model``.

    ``amount``: a fraction of each layer's experts (``0 < amount < 1``) or a count (an int ``>= 1``);
    at least ``top_k`` experts stay. ``calibration``: batches run through the model to score the
    experts (every criterion but ``"random"`` needs them; before 0.3 the third positional
    argument); ``seed`` seeds ``"random"``. ``spec``: a :class:`PruneExpertsSpec` instead.

    Example:
        >>> handle = surgery.prune_experts(model, 0.25, calibration=batches, criterion="reap")
        >>> handle.removed            # {"model.layers.0.mlp.experts": [3, 5], ...}
        >>> handle.restore()          # the model as it was, bit for bit
    """
    amount, criterion, seed = spec.amount, spec.criterion, spec.seed
    calibration, progress = call.calibration, call.progress
    score = EXPERT_CRITERIA.get(criterion)
    layers = _layers(model)
    total = _common_count(layers)
    drop = _drop_count(amount, total)
    _check_count(model, layers, total - drop, ("prune_experts.amount", amount))
    _check_in_memory(layers)
    stats = _statistics(model, layers, calibration, criterion, seed, progress)
    scores = {name: score(stats[name]).double() for name in layers}
    kept = {name: _lowest_out(scores[name], drop, _groups(router)).tolist() for name, (_, router) in layers.items()}
    handle = remove_experts(model, kept)
    handle.criterion = criterion
    handle.scores = {name: found.tolist() for name, found in scores.items()}
    handle.tokens_per_expert = {name: stats[name].routed.tolist() for name in layers}
    return handle


def remove_experts(model: nn.Module, kept: dict[str, list[int]]) -> ExpertPruneHandle:
    """Keep only the experts ``kept`` names (original indices, per experts module; every layer keeps
    as many) and shrink routers and counts to match: what :func:`prune_experts` does once it has
    scored, and how a fresh model of the family is given a pruned one's shapes."""
    layers = _layers(model)
    total = _common_count(layers)
    left = _check_kept(kept, layers, total)
    _check_count(model, layers, left, ("prune_experts.kept", left))
    handle = ExpertPruneHandle(model, "given")
    handle.num_experts = {"before": total, "after": left}
    with handle.applying():
        for name, (experts, router) in layers.items():
            keep = torch.tensor(sorted(set(kept[name])), dtype=torch.long)
            handle.kept[name] = keep.tolist()
            handle.removed[name] = sorted(set(range(total)) - set(handle.kept[name]))
            parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
            for module in (experts, router):
                _slice_rows(handle, module, keep, total)
            for module in {id(m): m for m in (parent, experts, router)}.values():
                _set_counts(handle, module, total, left)
        for config in _configs(model):
            _set_counts(handle, config, total, left)
    return handle


def _check_kept(kept: dict[str, list[int]], layers: dict[str, tuple[nn.Module, nn.Module]], total: int) -> int:
    """Refuse a ``kept`` that misses a layer, keeps unequal counts, names no expert of ``total`` or
    unbalances a grouped router's groups; returns how many experts each layer keeps."""
    if set(kept) != set(layers) or len({len(set(k)) for k in kept.values()}) != 1:
        raise ConfigError(
            "prune_experts.kept",
            sorted(kept),
            f"must name every experts module ({', '.join(layers)}) with as many experts each",
        )
    for name, (_, router) in layers.items():
        if any(isinstance(e, bool) or not isinstance(e, int) or not 0 <= e < total for e in kept[name]):
            raise ConfigError("prune_experts.kept", kept[name], f"must be expert indices in [0, {total})")
        _check_groups_kept(kept[name], total, _groups(router))
    return len(set(next(iter(kept.values()))))


def _check_count(
    model: nn.Module, layers: dict[str, tuple[nn.Module, nn.Module]], left: int, given: tuple[str, object]
) -> None:
    """Refuse leaving fewer experts than a token is routed to, or a count a router cannot route over
    (``given``: the field and value that asked for it)."""
    tops = [getattr(router, "top_k", None) for _, router in layers.values()]
    tops += [getattr(config, "num_experts_per_tok", None) for config in _configs(model)]
    top_k = max((int(t) for t in tops if isinstance(t, int)), default=1)
    reasons = [] if left >= top_k else [f"fewer than the top_k={top_k} experts each token is routed to; remove fewer"]
    reasons += [ROUTERS.get(type(router).__name__)(router, left) for _, router in layers.values()]
    reason = next((r for r in reasons if r), None)
    if reason:
        raise ConfigError(*given, f"leaves {left} expert{'' if left == 1 else 's'} per layer, {reason}")


def _layers(model: nn.Module) -> dict[str, tuple[nn.Module, nn.Module]]:
    """Every fused experts module of ``model`` with its router (the block's child of a registered
    router class); refuses in one line when there is none, or a router is unknown."""
    if not isinstance(model, nn.Module):
        raise ConfigTypeError(
            "prune_experts.model",
            type(model).__name__,
            "must be a torch.nn.Module held in memory (an offloaded model, surgery.offloaded, has no experts "
            "removed yet: load it in memory)",
        )
    if linear_experts_in(model):
        raise ConfigError(
            "prune_experts",
            next(iter(linear_experts_in(model))),
            "is made per-expert layers by a verb still attached; restore or bake it first",
        )
    found = fused_experts(model)
    if not found:
        raise ConfigError(
            "prune_experts", type(model).__name__, "has no mixture-of-experts layer to remove experts from"
        )
    layers = {}
    for name in found:
        experts = model.get_submodule(name)
        parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
        router = next((m for m in parent.children() if type(m).__name__ in ROUTERS.names()), None)
        if router is None:
            kinds = ", ".join(type(m).__name__ for m in parent.children() if m is not experts)
            raise ConfigError(
                "prune_experts.router",
                f"{name} ({kinds})",
                f"is no router kind known to prune_experts ({', '.join(ROUTERS.names())}); "
                "register it with register_router",
            )
        _check_unmodified(name, experts, router)
        layers[name] = (experts, router)
    return layers


def _check_unmodified(name: str, *modules: nn.Module) -> None:
    """Refuse experts or a router that other surgery still holds (masks, grids on their tensors)."""
    for module in modules:
        for attr, param in module.named_parameters(recurse=False):
            if guards.transforms_of(param):
                raise ConfigError(
                    "prune_experts",
                    f"{name}.{attr}",
                    "has surgery applied to it still attached; restore or bake that first",
                )


def _check_in_memory(layers: dict[str, tuple[nn.Module, nn.Module]]) -> None:
    """Refuse experts or routers whose weights are on ``meta`` (an offloaded model's skeleton brings
    full-size ones in per block, so rows removed there would not stay removed)."""
    for name, modules in layers.items():
        for module in modules:
            meta = next((attr for attr, p in module.named_parameters(recurse=False) if p.is_meta), None)
            if meta is not None:
                raise ConfigError(
                    "prune_experts",
                    f"{name}.{meta}" if module is modules[0] else f"{name} router.{meta}",
                    "is on the meta device (an offloaded model's skeleton, or a model not loaded yet); "
                    "prune_experts needs the weights in memory",
                )


def _common_count(layers: dict[str, tuple[nn.Module, nn.Module]]) -> int:
    """The number of experts every layer has (one config value: layers must agree)."""
    counts = {name: int(experts.num_experts) for name, (experts, _) in layers.items()}
    if len(set(counts.values())) > 1:
        raise ConfigError("prune_experts", counts, "needs the same number of experts in every layer")
    return next(iter(counts.values()))


def _drop_count(amount: object, total: int) -> int:
    """How many experts ``amount`` removes from a layer of ``total``."""
    if isinstance(amount, bool) or not isinstance(amount, (int, float)):
        raise ConfigError("prune_experts.amount", amount, "must be a fraction in (0, 1) or a count of experts >= 1")
    if isinstance(amount, float) and not amount.is_integer():
        if not 0 < amount < 1:
            raise ConfigError("prune_experts.amount", amount, "must be a fraction in (0, 1) or a count of experts >= 1")
        drop = int(round(amount * total))
    else:
        drop = int(amount)
    if not 1 <= drop < total:
        raise ConfigError(
            "prune_experts.amount", amount, f"must remove between 1 and {total - 1} of the {total} experts per layer"
        )
    return drop


def _statistics(
    model: nn.Module,
    layers: dict[str, tuple[nn.Module, nn.Module]],
    calibration: Inputs | None,
    criterion: str,
    seed: int,
    progress: bool,
) -> dict[str, ExpertStats]:
    """Each layer's :class:`ExpertStats` from ``calibration`` (empty ones without it, for ``random``)."""
    generator = torch.Generator().manual_seed(seed)
    if calibration is None:
        if criterion != "random":
            raise ConfigError("prune_experts.calibration", None, f"criterion {criterion!r} needs calibration batches")
        count = len(next(iter(layers.values()))[1].weight)
        zeros = torch.zeros(count, dtype=torch.long)
        return {name: ExpertStats(zeros, zeros.double(), generator) for name in layers}
    with linearized(model):
        routers = {name: router for name, (_, router) in layers.items()}
        stats = observe(model, routers, calibration, progress=progress)
    for found in stats.values():
        found.generator = generator
    return stats


def _groups(router: nn.Module) -> int:
    """How many groups ``router`` first picks among (DeepSeek-V3's ``n_group`` when ``topk_group`` is
    fewer; 1 otherwise): an expert's group is its index // group size, so each group loses as many."""
    groups = int(getattr(router, "num_group", 1) or 1)
    return groups if int(getattr(router, "topk_group", groups)) < groups else 1


def _check_groups_kept(kept: list[int], total: int, groups: int) -> None:
    """Refuse keeping unequal counts from the groups of a grouped router: the experts left would be
    regrouped by position, and tokens that never reached a removed expert would route elsewhere."""
    size = total // groups
    counts = [sum(1 for e in set(kept) if e // size == g) for g in range(groups)]
    if len(set(counts)) > 1:
        raise ConfigError(
            "prune_experts.kept",
            sorted(set(kept)),
            f"keeps {counts} experts from the n_group={groups} groups of {size}; keep as many from each "
            "(grouped routing picks whole groups by position)",
        )


def _lowest_out(scores: Tensor, drop: int, groups: int = 1) -> Tensor:
    """The indices kept, in order, once the ``drop`` lowest scores go (ties: the later expert goes),
    as many from each of ``groups`` consecutive groups."""
    size = len(scores) // groups
    kept: list[int] = []
    for start in range(0, size * groups, size):
        order = sorted(range(start, start + size), key=lambda e: (float(scores[e]), -e))
        kept += sorted(order[drop // groups :])
    return torch.tensor(kept, dtype=torch.long)


def _slice_rows(handle: ExpertPruneHandle, module: nn.Module, keep: Tensor, total: int) -> None:
    """Keep rows ``keep`` (dim 0) of every own parameter and buffer of ``module`` with one row per expert."""
    for kind in ("parameters", "buffers"):
        for attr, tensor in list(getattr(module, f"named_{kind}")(recurse=False)):
            if tensor is None or tensor.dim() == 0 or tensor.shape[0] != total:
                continue
            original = get_slot(module, attr, kind)
            with torch.no_grad():
                rows = original.detach().index_select(0, keep.to(original.device)).clone()
            value = nn.Parameter(rows, requires_grad=original.requires_grad) if kind == "parameters" else rows
            set_slot(module, attr, value, kind)
            handle.add(
                f"put back {type(module).__name__}.{attr}",
                lambda m=module, a=attr, t=original, k=kind: _put_back(m, a, t, k),
            )


def _put_back(module: nn.Module, attr: str, original: Tensor, kind: str) -> None:
    """Put ``original`` back in ``module``'s slot, moved to the dtype and device the slot holds now (the
    model was moved, ``model.to(torch.bfloat16)`` say, while the experts were removed): a Parameter
    stays the same object, its data moved as ``Module.to`` moves it."""
    current = get_slot(module, attr, kind)
    if current is not None and (current.dtype, current.device) != (original.dtype, original.device):
        moved = original.detach().to(device=current.device, dtype=current.dtype)
        if isinstance(original, nn.Parameter):
            original.data = moved
        else:
            original = moved
    set_slot(module, attr, original, kind)


def _set_counts(handle: ExpertPruneHandle, owner: Any, total: int, left: int) -> None:
    """Set ``owner``'s expert-count attributes that read ``total`` to ``left`` (undone on restore)."""
    for attr in COUNT_ATTRS:
        if getattr(owner, attr, None) == total and not isinstance(getattr(owner, attr), bool):
            setattr(owner, attr, left)
            handle.add(f"put back {type(owner).__name__}.{attr}", lambda o=owner, a=attr: setattr(o, a, total))


def _configs(model: nn.Module) -> list[Any]:
    """The model's config and the text config inside it, where there is one."""
    config = getattr(model, "config", None)
    if config is None:
        return []
    text = getattr(config, "text_config", None) if hasattr(config, "get_text_config") else None
    return [config] + ([text] if text is not None and text is not config else [])
