"""Which parameters a verb (prune, quantize) works on: what was matched, what was skipped, why.

A selection names modules (their ``weight`` is the target) or, for any other floating
parameter, the parameter itself by qualified name (``"**.weight_ih_l0"``,
``"attn.in_proj_weight"``): a string pattern that matches no module is tried against
parameter names. Nothing is dropped without a word: every module selected without a usable
weight, every other 2-D+ parameter of a selected layer and, with the default selection,
every layer outside it that has such weights (``nn.LSTM``, ``nn.MultiheadAttention``'s
``in_proj_weight``, embeddings) is listed in :attr:`Targets.skipped` with the reason.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field

from torch import Tensor, nn

from surgery.core._compat import get_slot
from surgery.core.errors import ConfigError, SelectionError
from surgery.core.layer_kinds import is_hf_conv1d, is_kind  # noqa: F401 - is_hf_conv1d: its old home
from surgery.core.selection import Selection, as_patterns, closest, describe, matches

log = logging.getLogger("surgery")
_SELECTION_LEVEL: contextvars.ContextVar[int] = contextvars.ContextVar("selection_level", default=logging.INFO)


@contextlib.contextmanager
def selections_logged_at(level: int) -> Iterator[None]:
    """Log what each selection matched at ``level`` inside the block (a check that applies the
    same steps again says it at DEBUG: the user read it once)."""
    token = _SELECTION_LEVEL.set(level)
    try:
        yield
    finally:
        _SELECTION_LEVEL.reset(token)


def default_layer(module: nn.Module, name: str = "") -> bool:
    """The default selection of prune and quantize: layers of a kind marked ``default`` in
    :mod:`surgery.core.layer_kinds` (``nn.Conv1d/2d/3d``, ``nn.Linear``, Hugging Face's ``Conv1D``)."""
    return is_kind(module, lambda kind: kind.default)


default_layer.__name__ = "Conv*d|Linear|Conv1D"


@dataclass(frozen=True)
class Target:
    """One parameter a verb works on."""

    name: str  # qualified parameter name, e.g. "layer1.0.conv1.weight"
    module_name: str
    module: nn.Module = field(repr=False, compare=False)
    attribute: str = "weight"

    @property
    def param(self) -> nn.Parameter:
        return get_slot(self.module, self.attribute)


@dataclass(frozen=True)
class Skipped:
    """A module or parameter left out, and why."""

    name: str
    type: str
    reason: str


@dataclass(frozen=True)
class Left:
    """A tensor a verb left unchanged: its size and why."""

    name: str
    numel: int
    bytes: int
    reason: str


@dataclass(frozen=True)
class Coverage:
    """How much of a model a selection reaches: parameters and bytes (each tensor counted once),
    of the weights (2-D and more) too, and the largest tensors left out with the reason."""

    changed_params: int
    total_params: int
    changed_bytes: int
    total_bytes: int
    weight_bytes: int  # every weight of 2+ dimensions
    left_weight_bytes: int  # of those, not changed, not excluded by the user, not an embedding table
    largest_left: tuple[Left, ...] = ()

    @property
    def share(self) -> float:
        """The share of the model's parameters changed."""
        return self.changed_params / self.total_params if self.total_params else 0.0

    @property
    def left_share(self) -> float:
        """The share of the weight bytes left unchanged without the user excluding them."""
        return self.left_weight_bytes / self.weight_bytes if self.weight_bytes else 0.0

    def as_dict(self) -> dict[str, object]:
        found = asdict(self)
        found["largest_left"] = [asdict(item) for item in self.largest_left]
        found["share"] = round(self.share, 4)
        found["left_share"] = round(self.left_share, 4)
        return found


@dataclass
class Targets:
    """The outcome of a selection: ``matched`` parameters (in model order), ``skipped`` ones, and
    the :class:`Coverage` of the model."""

    matched: dict[str, Target]
    skipped: list[Skipped]
    coverage: Coverage | None = None

    def as_dict(self) -> dict[str, object]:
        found: dict[str, object] = {"matched": list(self.matched), "skipped": [asdict(s) for s in self.skipped]}
        if self.coverage is not None:
            found["coverage"] = self.coverage.as_dict()
        return found


def select_parameters(
    model: nn.Module, include: Selection, exclude: Selection, *, verb: str, min_dim: int = 2, required: bool = True
) -> Targets:
    """Resolve ``include``/``exclude`` to the parameters ``verb`` (``"prune"``, ``"quantize"``)
    works on; ``include=None`` is :func:`default_layer`. See the module docstring. With
    ``required=False`` an empty result is returned instead of raising.

    Raises:
        SelectionError: a pattern matches no module and no parameter.
        ConfigError: the selection holds no floating parameter of ``min_dim``+ dimensions, or
            a selected weight is not floating.
    """
    field_, exclude_field = f"{verb}.select", f"{verb}.exclude"
    modules = dict(model.named_modules(remove_duplicate=True))
    params = _named_parameters(model)
    chosen_modules, chosen_params = _resolve(modules, params, default_layer if include is None else include, field_)
    excluded_modules, excluded_params = _resolve(modules, params, exclude, exclude_field) if exclude else (set(), set())
    excluded_modules = _with_descendants(modules, excluded_modules)  # excluding a block excludes its layers
    chosen_modules -= excluded_modules
    chosen_params = {p for p in chosen_params - excluded_params if p.rpartition(".")[0] not in excluded_modules}
    walk = _Walk(verb, min_dim, chosen_modules, chosen_params, excluded_params, routers_in(modules, include))
    walk.embeddings = _input_embeddings(model, modules) if include is None else {}
    for name, module in modules.items():
        own = {attr: p for attr, p in module.named_parameters(recurse=False, remove_duplicate=False) if p is not None}
        for attr, param in own.items():
            walk.visit(name, module, attr, param)
        if name in chosen_modules and own and "weight" not in own:
            walk.skipped.append(
                Skipped(_label(name, own), type(module).__name__, "has no 'weight' parameter of its own")
            )
    matched, skipped = walk.matched, walk.skipped
    if include is None:
        skipped += _outside_default(modules, chosen_modules, walk.seen, verb, walk.routers)
    if walk.tied_heads:
        log.warning(
            "%s: %s left out: the same tensor as an input embedding (a tied output head, which would %s the "
            "embedding too); select it explicitly to include it",
            verb,
            ", ".join(walk.tied_heads),
            verb,
        )
    if not matched and required:
        _refuse_empty(modules, chosen_modules, include, field_, min_dim)
    log.log(
        _SELECTION_LEVEL.get(),
        "%s: %d parameter(s) matched, %d skipped%s",
        verb,
        len(matched),
        len(skipped),
        f" ({', '.join(s.name for s in skipped[:3])}{' ...' if len(skipped) > 3 else ''})" if skipped else "",
    )
    for item in skipped:
        log.debug("%s: skipped %s (%s): %s", verb, item.name, item.type, item.reason)
    lookups = set(_input_embeddings(model, modules))  # tables read by index: not counted as weights left
    coverage = coverage_of(model, matched, skipped, excluded_modules, excluded_params, lookups=lookups)
    return Targets(matched, skipped, coverage)


@dataclass
class _Walk:
    """:func:`select_parameters`' pass over every parameter: what it matched, skipped and why."""

    verb: str
    min_dim: int
    chosen_modules: set[str]
    chosen_params: set[str]
    excluded_params: set[str]
    routers: dict[str, str]
    embeddings: dict[int, str] = field(default_factory=dict)
    matched: dict[str, Target] = field(default_factory=dict)
    skipped: list[Skipped] = field(default_factory=list)
    seen: dict[int, str] = field(default_factory=dict)  # id of a parameter matched -> its name (ties)
    tied_heads: list[str] = field(default_factory=list)

    def visit(self, name: str, module: nn.Module, attr: str, param: Tensor) -> None:
        """Match ``module``'s parameter ``attr``, or skip it saying why."""
        qualified, kind, verb = f"{name}.{attr}" if name else attr, type(module).__name__, self.verb
        wanted = qualified not in self.excluded_params and (
            qualified in self.chosen_params or name in self.chosen_modules and attr == "weight"
        )
        if not wanted:
            if name in self.chosen_modules and param.dim() >= 2 and param.is_floating_point():
                self.skipped.append(
                    Skipped(qualified, kind, f"not the layer's 'weight'; select '{qualified}' to include it")
                )
            return
        if name in self.routers:
            self.skipped.append(Skipped(qualified, kind, self.routers[name]))
            return
        if id(param) in self.embeddings:
            why = (
                f"is the same tensor as the input embedding {self.embeddings[id(param)]} (a tied output head): "
                f"left out by default; select '{name}' to {verb} both"
            )
            self.skipped.append(Skipped(qualified, kind, why))
            self.tied_heads.append(name)
            return
        if not param.is_floating_point():
            raise ConfigError(
                f"{verb}.select",
                name if attr == "weight" else qualified,
                f"weight has dtype {param.dtype}; only floating weights can be {verb}d",
            )
        if param.dim() < self.min_dim:
            why = f"has {param.dim()} dimension(s); {verb} works on weights of {self.min_dim}+"
            self.skipped.append(Skipped(qualified, kind, why))
        elif id(param) in self.seen:
            why = f"is tied to {self.seen[id(param)]} (handled once, stays tied)"
            self.skipped.append(Skipped(qualified, kind, why))
        else:
            self.seen[id(param)] = qualified
            self.matched[qualified] = Target(qualified, name, module, attr)


def _refuse_empty(
    modules: dict[str, nn.Module], chosen_modules: set[str], include: Selection, field_: str, min_dim: int
) -> None:
    """A selection that holds no weight to work on: one line, pointing at the layers inside a container."""
    containers = [n for n in modules if n in chosen_modules and not any(True for _ in modules[n].parameters(False))]
    why = (
        f"{len(containers)} selected module(s) hold no parameters of their own, e.g. {containers[0] or '(root)'}: "
        f"'{containers[0]}.**' reaches the layers inside; "
        if containers and containers[0]
        else ""
    )
    raise ConfigError(
        field_,
        describe(include),
        f"selects no floating weight of {min_dim}+ dimensions",
        f"{why}select layers such as 'layer1.**' or 'type:Conv2d', or parameters by name such as '**.weight_ih_l0'",
    )


LARGEST_LEFT = 5  # tensors named in Coverage.largest_left


def coverage_of(
    model: nn.Module,
    matched: dict[str, Target | nn.Parameter],
    skipped: list[Skipped],
    excluded_modules: set[str] = frozenset(),
    excluded_params: set[str] = frozenset(),
    *,
    left_reason: str = "not selected",
    lookups: set[int] = frozenset(),
) -> Coverage:
    """What share of ``model`` the ``matched`` parameters (targets, or the parameters themselves)
    are, and the largest tensors left, why (``left_reason`` when no skip names one). Embedding
    tables (``lookups``, by id) are listed when left but not counted in ``left_weight_bytes``: a
    table read by index is left out by default, not missed."""
    reasons = {item.name: item.reason for item in skipped}
    changed = {id(t.param if isinstance(t, Target) else t) for t in matched.values()}
    seen: set[int] = set()
    counts = {"changed_params": 0, "total_params": 0, "changed_bytes": 0, "total_bytes": 0}
    weight_bytes = left_bytes = 0
    left: list[Left] = []
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            continue
        seen.add(id(param))
        size = param.numel() * param.element_size()
        counts["total_params"] += param.numel()
        counts["total_bytes"] += size
        if id(param) in changed:
            counts["changed_params"] += param.numel()
            counts["changed_bytes"] += size
        weight_bytes += size if param.dim() >= 2 else 0
        if id(param) in changed:
            continue
        owner = name.rpartition(".")[0]
        excluded = name in excluded_params or any(owner == m or owner.startswith(f"{m}.") for m in excluded_modules)
        reason = "excluded (exclude=)" if excluded else _why_left(name, owner, param.dim(), reasons, left_reason)
        left_bytes += size if param.dim() >= 2 and not excluded and id(param) not in lookups else 0
        left.append(Left(name, param.numel(), size, reason))
    left.sort(key=lambda item: -item.bytes)
    return Coverage(
        **counts, weight_bytes=weight_bytes, left_weight_bytes=left_bytes, largest_left=tuple(left[:LARGEST_LEFT])
    )


def _why_left(name: str, owner: str, dims: int, reasons: dict[str, str], otherwise: str) -> str:
    """The reason a selection gave for leaving ``name`` (or its layer) out, else a general one."""
    for key in (name, owner):
        if key in reasons:
            return reasons[key]
    return "1-D (norm scales and biases are not selected)" if dims < 2 and otherwise == "not selected" else otherwise


def _input_embeddings(model: nn.Module, modules: dict[str, nn.Module]) -> dict[int, str]:
    """``id(weight) -> name`` of the input embeddings: every ``nn.Embedding``, and what a
    Hugging Face model's ``get_input_embeddings()`` returns."""
    found = {id(m.weight): name for name, m in modules.items() if isinstance(m, nn.Embedding)}
    getter = getattr(model, "get_input_embeddings", None)
    try:
        embedding = getter() if callable(getter) else None
    except (NotImplementedError, AttributeError):  # a transformers base class without embeddings
        embedding = None
    weight = getattr(embedding, "weight", None)
    if isinstance(weight, nn.Parameter) and id(weight) not in found:
        found[id(weight)] = next((n for n, m in modules.items() if m is embedding), "input embedding")
    return found


def _named_parameters(model: nn.Module) -> dict[str, nn.Module]:
    """Qualified parameter name -> owning module, for every (also shared) parameter."""
    return {
        f"{name}.{attr}" if name else attr: module
        for name, module in model.named_modules()
        for attr, p in module.named_parameters(recurse=False, remove_duplicate=False)
        if p is not None
    }


def _resolve(modules: dict, params: dict, selection: Selection, field_: str) -> tuple[set[str], set[str]]:
    """(module names, parameter names) a selection picks. A string pattern takes the modules it
    names, the parameters it names whose module it does not (a fused expert tensor beside a Linear
    of the same name), and the layers a module stands in for under a name it no longer has (a
    mixture-of-experts layer's per-expert layers under their fused parameter's name, through the
    module's ``selection_aliases``); one matching none of these raises."""
    chosen_modules: set[str] = set()
    chosen_params: set[str] = set()
    aliases = _aliases(modules)
    for pattern in as_patterns(selection, field_):
        hits = {n for n, m in modules.items() if matches(pattern, n, m)}
        if isinstance(pattern, str):
            param_hits = {n for n, owner in params.items() if matches(pattern, n, owner)}
            for alias, (owner, names) in aliases.items():
                if matches(pattern, alias, owner):
                    hits |= {n for n in names if n in modules}
                    param_hits |= {n for n in names if n not in modules and n in params}
            if param_hits and not hits:
                chosen_params |= param_hits
                continue
            _say_untaken(pattern, field_, param_hits, hits, params)
        if not hits:
            raise SelectionError(
                field_, describe(pattern), "matches no module or parameter", closest(pattern, {**modules, **params})
            )
        chosen_modules |= hits
    return chosen_modules, chosen_params


def _say_untaken(pattern: str, field_: str, names: set[str], hits: set[str], params: dict[str, nn.Module]) -> None:
    """A pattern naming layers takes the layers; say so when it also names weights of other layers."""
    other = sorted(
        n for n in names
        if n.rpartition(".")[0] not in hits and getattr(params[n], n.rpartition(".")[2]).dim() >= 2
    )  # fmt: skip
    if other:
        log.warning(
            "%s: %r names layers and also %d weight(s) of other layers (%s%s); it takes the layers: name those "
            "weights in a pattern of their own to take them too",
            field_, pattern, len(other), ", ".join(other[:3]), " ..." if len(other) > 3 else "",
        )  # fmt: skip


def _with_descendants(modules: dict[str, nn.Module], names: set[str]) -> set[str]:
    """``names`` and every module below one of them."""
    if "" in names:
        return set(modules)
    return {n for n in modules if n in names or any(n.startswith(f"{name}.") for name in names)}


def _aliases(modules: dict[str, nn.Module]) -> dict[str, tuple[nn.Module, list[str]]]:
    """``alias -> (module, the layers it names)`` for modules that answer to names they stand in for."""
    found = {}
    for name, module in modules.items():
        for alias, layers in getattr(module, "selection_aliases", {}).items():
            prefix = f"{name}." if name else ""
            found[f"{prefix}{alias}"] = (module, [f"{prefix}{layer}" for layer in layers])
    return found


def routers_in(modules: dict[str, nn.Module], include: Selection) -> dict[str, str]:
    """The routers and gates of mixture-of-experts layers (a layer with a weight of its own beside an
    ``experts`` module: Mixtral's ``gate``, PhiMoE's ``router``, Qwen2-MoE's ``shared_expert_gate``),
    each with the reason it stays float: all of them, but those a selection pattern names."""
    named = [p for p in as_patterns(include, "select") if isinstance(p, str)] if include is not None else []
    found = {}
    for name, module in modules.items():
        children = dict(module.named_children())
        if "experts" not in children:
            continue
        for local, child in children.items():
            weight = getattr(child, "weight", None)
            if local == "experts" or not isinstance(weight, nn.Parameter) or weight.dim() < 2:
                continue
            qualified = f"{name}.{local}" if name else local
            if not any(local in pattern for pattern in named):
                found[qualified] = (
                    "the router of a mixture-of-experts layer: routers stay float (a small error in them "
                    f"sends tokens to other experts); select it with a pattern naming it, such as '**.{local}'"
                )
    return found


def _outside_default(
    modules: dict, chosen: set[str], seen: dict[int, str], verb: str, routers: dict[str, str]
) -> list[Skipped]:
    """Layers the default selection leaves out that hold 2-D+ floating weights (a weight tied to
    a matched one is named as changed with it)."""
    out = []
    for name, module in modules.items():
        if name in chosen:
            continue
        heavy = {
            attr: p
            for attr, p in module.named_parameters(recurse=False, remove_duplicate=False)
            if p is not None and p.dim() >= 2 and p.is_floating_point()
        }
        own = [attr for attr, p in heavy.items() if id(p) not in seen]
        for attr, p in heavy.items():
            if id(p) in seen:
                qualified = f"{name}.{attr}" if name else attr
                out.append(
                    Skipped(
                        qualified,
                        type(module).__name__,
                        f"not selected itself, but it is the same tensor as {seen[id(p)]}, so it is {verb}d with it",
                    )
                )
        if own and name in routers:
            out.append(Skipped(_label(name, own), type(module).__name__, routers[name]))
        elif own and default_layer(module, name):
            out.append(Skipped(_label(name, own), type(module).__name__, f"excluded ({verb}.exclude)"))
        elif own:
            example = f"{name}.{own[0]}" if name else own[0]
            out.append(
                Skipped(
                    _label(name, own),
                    type(module).__name__,
                    f"not in the default selection ({default_layer.__name__}); "
                    f"select '{example}' (or its layer) to include its {', '.join(own)}",
                )
            )
    return out


def _label(name: str, attributes: Iterable[str]) -> str:
    """A skipped module's name; the model itself (whose name is empty) by its parameters' names."""
    return name or ", ".join(attributes)
