"""The tensors of an offloaded model's files under the model's own names, as transformers loads them.

transformers saves some models under other names than their parameters have and converts them on
load: a mixture-of-experts layer's experts are written one tensor per expert and projection
(``block_sparse_moe.experts.0.w1.weight``, ``mlp.experts.0.gate_proj.weight``) and stacked into
the fused parameters (``mlp.experts.gate_up_proj``) by ``from_pretrained``; a router is renamed.
:class:`ModelNamedFiles` reads the files through transformers' own conversion rules
(``get_model_conversion_mapping`` on the model built on ``meta``, ``rename_source_key``, and each
``WeightConverter`` given its sources lazily), so each fused parameter is built from its sources
only when its block is brought in. Models outside transformers read their files' names as they are.
"""

from __future__ import annotations

import copy
import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from surgery.core.errors import ConfigError

FIELD = "offloaded.source"


@dataclass
class Fused:
    """A parameter transformers builds from several tensors of the files: its converter (an
    unused template), its sources as ``(file name, pattern)`` in load order, its shape and dtype."""

    converter: Any
    sources: list[tuple[str, str]]
    shape: tuple[int, ...] = ()
    dtype: torch.dtype | None = None


class FilesView:
    """Files (a ``WeightFiles``) seen through another naming or reading: their paths, digest and
    identity are the files' own."""

    files: Any

    @property
    def paths(self) -> list[Path]:
        return self.files.paths

    @property
    def digest(self) -> str | None:
        return self.files.digest

    def identity(self) -> list[dict[str, Any]]:
        """Each file as it was opened (see ``WeightFiles.identity``)."""
        return self.files.identity()


class ModelNamedFiles(FilesView):
    """Checkpoint files (a ``WeightFiles``) read by the model's parameter names: a renamed tensor
    from its file name, a fused one built from its sources when loaded. ``unmapped`` holds, for
    each name the files give that is no tensor of the model, the file name it came from."""

    def __init__(self, files: Any, renamed: dict[str, str], fused: dict[str, Fused], model: nn.Module | None) -> None:
        self.files, self.renamed, self.fused, self._model = files, renamed, fused, model
        self.unmapped: dict[str, str] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.renamed or name in self.fused

    def names(self) -> list[str]:
        return [*self.renamed, *self.fused, *self.unmapped]

    def describe(self, name: str) -> tuple[tuple[int, ...], torch.dtype | str, str]:
        """(shape, dtype, file name) of ``name``: a fused tensor's as its conversion gives it."""
        if name in self.fused:
            fused = self.fused[name]
            return fused.shape, fused.dtype, self.files.describe(fused.sources[0][0])[2]
        return self.files.describe(self.renamed[name])

    def load(self, name: str) -> Tensor:
        """The tensor ``name``, read from its file (or its sources, converted) now."""
        if name in self.fused:
            return _convert(name, self.fused[name], self.files.load, self._model)
        return self.files.load(self.renamed[name])


def model_named(model: nn.Module, files: Any) -> ModelNamedFiles:
    """``files`` read by ``model``'s names, through transformers' conversion rules for its models."""
    if not _is_transformers_model(model):
        return ModelNamedFiles(files, {name: name for name in files.names()}, {}, None)
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

    rules = get_model_conversion_mapping(model, add_legacy=True)
    renamings = [rule for rule in rules if isinstance(rule, WeightRenaming)]
    converters = [rule for rule in rules if isinstance(rule, WeightConverter)]
    by_pattern = {pattern: rule for rule in converters for pattern in rule.source_patterns}
    state = model.state_dict(keep_vars=True)
    prefix = getattr(model, "base_model_prefix", None) or None
    view = ModelNamedFiles(files, {}, {}, model)
    for key in sorted(files.names(), key=dot_natural_key):  # experts in their order, as transformers sorts them
        target, pattern = rename_source_key(key, renamings, converters, prefix, state)
        if target not in state and key in state:  # as transformers: a name of the model is kept as it is
            target, pattern = rename_source_key(key, [], [], prefix, state)
        if target not in state:
            view.unmapped.setdefault(target, key)
        elif pattern is None:
            _rename(view, target, key)
        else:
            view.fused.setdefault(target, Fused(by_pattern[pattern], [])).sources.append((key, pattern))
    for target, fused in view.fused.items():
        try:
            _describe_fused(target, fused, files, model)
        except ConfigError as err:  # a source named otherwise is likely why: say which
            raise ConfigError(err.field, err.value, err.allowed + unmapped_hint(view)) from None
    return view


def unmapped_hint(view: ModelNamedFiles) -> str:
    """A tensor of the files that is no tensor of the model (even through transformers' renaming), if any."""
    if not view.unmapped:
        return ""
    key = next(iter(view.unmapped.values()))
    return f"; {key} in the files is no tensor of the model, even as transformers renames checkpoint names"


def _rename(view: ModelNamedFiles, target: str, key: str) -> None:
    """``target`` read from the file's ``key``; a name the files give twice is refused."""
    other = view.renamed.get(target) or (view.fused[target].sources[0][0] if target in view.fused else None)
    if other is not None:
        raise ConfigError(
            FIELD, key, f"is {target} of the model as transformers renames it, and so is {other}; keep one of them"
        )
    view.renamed[target] = key


def _describe_fused(target: str, fused: Fused, files: Any, model: nn.Module) -> None:
    """Shape and dtype of a fused tensor, from its conversion run on ``meta`` (nothing read)."""

    def empty(key: str) -> Tensor:
        shape, dtype, _ = files.describe(key)
        if not isinstance(dtype, torch.dtype):
            raise ConfigError(FIELD, key, f"is {dtype} in the files, which torch has no dtype for")
        return torch.empty(shape, dtype=dtype, device="meta")

    value = _convert(target, fused, empty, model)
    fused.shape, fused.dtype = tuple(value.shape), value.dtype


def _convert(target: str, fused: Fused, read: Callable[[str], Tensor], model: nn.Module | None) -> Tensor:
    """``target`` built by a copy of its converter from its sources, each read when it asks."""
    converter = copy.deepcopy(fused.converter)
    for key, pattern in fused.sources:
        converter.add_tensor(target, key, pattern, functools.partial(read, key))
    try:
        value = converter.convert(target, model=model, config=getattr(model, "config", None)).get(target)
    except ConfigError:
        raise
    except Exception as err:  # a conversion transformers' rules cannot make of these tensors
        first = " ".join(str(err).split())[:120]
        raise ConfigError(
            FIELD, target, f"cannot be made from {fused.sources[0][0]} and the others like it ({first})"
        ) from None
    if not isinstance(value, Tensor):
        raise ConfigError(FIELD, target, f"is not what transformers' conversion of {fused.sources[0][0]} gives")
    return value


def _is_transformers_model(model: nn.Module) -> bool:
    """Whether ``model`` is a transformers ``PreTrainedModel`` (without importing transformers)."""
    transformers = sys.modules.get("transformers")
    return transformers is not None and isinstance(model, transformers.PreTrainedModel)
