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

from torch import nn

from surgery.core._compat import get_slot
from surgery.core.errors import ConfigError, SelectionError
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


LINEAR_LIKE = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear)


def is_hf_conv1d(module: nn.Module) -> bool:
    """Hugging Face's ``Conv1D`` (GPT-2 and relatives): a linear layer with a transposed weight
    of shape ``(in_features, out_features)``."""
    cls = type(module)
    return cls.__name__ == "Conv1D" and cls.__module__.startswith("transformers")


def default_layer(module: nn.Module, name: str = "") -> bool:
    """The default selection of prune and quantize: ``nn.Conv1d/2d/3d``, ``nn.Linear`` and
    Hugging Face's ``Conv1D``."""
    return isinstance(module, LINEAR_LIKE) or is_hf_conv1d(module)


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


@dataclass
class Targets:
    """The outcome of a selection: ``matched`` parameters (in model order) and ``skipped`` ones."""

    matched: dict[str, Target]
    skipped: list[Skipped]

    def as_dict(self) -> dict[str, list]:
        return {"matched": list(self.matched), "skipped": [asdict(s) for s in self.skipped]}


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
    chosen_modules -= excluded_modules
    chosen_params = {p for p in chosen_params - excluded_params if p.rpartition(".")[0] not in excluded_modules}
    matched: dict[str, Target] = {}
    skipped: list[Skipped] = []
    seen: dict[int, str] = {}
    embeddings = _input_embeddings(model, modules) if include is None else {}
    tied_heads: list[str] = []
    for name, module in modules.items():
        own = {attr: p for attr, p in module.named_parameters(recurse=False, remove_duplicate=False) if p is not None}
        for attr, param in own.items():
            qualified = f"{name}.{attr}" if name else attr
            wanted = qualified not in excluded_params and (
                qualified in chosen_params or name in chosen_modules and attr == "weight"
            )
            if wanted and id(param) in embeddings:
                skipped.append(
                    Skipped(
                        qualified,
                        type(module).__name__,
                        f"is the same tensor as the input embedding "
                        f"{embeddings[id(param)]} (a tied output head): left out by default; select "
                        f"'{name}' to {verb} both",
                    )
                )
                tied_heads.append(name)
                continue
            if not wanted:
                if name in chosen_modules and param.dim() >= 2 and param.is_floating_point():
                    skipped.append(
                        Skipped(
                            qualified,
                            type(module).__name__,
                            f"not the layer's 'weight'; select '{qualified}' to include it",
                        )
                    )
                continue
            if not param.is_floating_point():
                raise ConfigError(
                    f"{verb}.select",
                    name if attr == "weight" else qualified,
                    f"weight has dtype {param.dtype}; only floating weights can be {verb}d",
                )
            if param.dim() < min_dim:
                skipped.append(
                    Skipped(
                        qualified,
                        type(module).__name__,
                        f"has {param.dim()} dimension(s); {verb} works on weights of {min_dim}+",
                    )
                )
            elif id(param) in seen:
                skipped.append(
                    Skipped(
                        qualified, type(module).__name__, f"is tied to {seen[id(param)]} (handled once, stays tied)"
                    )
                )
            else:
                seen[id(param)] = qualified
                matched[qualified] = Target(qualified, name, module, attr)
        if name in chosen_modules and own and "weight" not in own:
            skipped.append(Skipped(_label(name, own), type(module).__name__, "has no 'weight' parameter of its own"))
    if include is None:
        skipped += _outside_default(modules, chosen_modules, seen, verb)
    if tied_heads:
        log.warning(
            "%s: %s left out: the same tensor as an input embedding (a tied output head, which would %s the "
            "embedding too); select it explicitly to include it",
            verb,
            ", ".join(tied_heads),
            verb,
        )
    if not matched and required:
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
    return Targets(matched, skipped)


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
    """(module names, parameter names) a selection picks; a string pattern matching no module
    is matched against parameter names; one matching neither raises."""
    chosen_modules: set[str] = set()
    chosen_params: set[str] = set()
    for pattern in as_patterns(selection, field_):
        hits = {n for n, m in modules.items() if matches(pattern, n, m)}
        if not hits and isinstance(pattern, str):
            param_hits = {n for n, owner in params.items() if matches(pattern, n, owner)}
            if param_hits:
                chosen_params |= param_hits
                continue
        if not hits:
            raise SelectionError(
                field_, describe(pattern), "matches no module or parameter", closest(pattern, {**modules, **params})
            )
        chosen_modules |= hits
    return chosen_modules, chosen_params


def _outside_default(modules: dict, chosen: set[str], seen: dict[int, str], verb: str) -> list[Skipped]:
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
        if own and default_layer(module, name):
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
