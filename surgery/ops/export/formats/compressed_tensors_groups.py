"""A compressed-tensors folder whose layers carry different weight grids (a plan mixing int8,
int4 in groups, FP8, FP4): one ``config_groups`` entry per distinct grid, its ``targets`` the
exact names of its layers (so no layer is matched by two groups or by none), each group with
its own ``format``, the folder's ``format`` ``mixed-precision``, the experts' group first.
What transformers cannot load from such a folder is refused in one line before anything is
written."""

from __future__ import annotations

from typing import Any

from torch import nn

from surgery.core.errors import ConfigError
from surgery.ops.export.formats.checkpoint_names import checkpoint_names
from surgery.ops.export.formats.compressed_tensors_experts import WHY_PER_EXPERT, expert_layers
from surgery.ops.numerics.grid import GridSpec

MIXED = "mixed-precision"  # compressed-tensors' CompressionFormat.mixed_precision


def specs_by_grid(specs: dict[str, GridSpec]) -> list[dict[str, GridSpec]]:
    """``specs`` (weight key -> grid) split by grid, in the order each grid first appears."""
    groups: dict[GridSpec, dict[str, GridSpec]] = {}
    for key, spec in specs.items():
        groups.setdefault(spec, {})[key] = spec
    return list(groups.values())


def group_targets(model: nn.Module, layers: list[str]) -> list[str]:
    """The exact names compressed-tensors matches ``layers`` by: each module name (transformers
    matches those) and its checkpoint name where it differs (loaders building their modules from
    the checkpoint match those); exact names match only themselves (no ``re:`` prefix)."""
    names = checkpoint_names(model, layers, WHY_PER_EXPERT)
    return sorted(set(layers) | {names[layer] for layer in layers if layer in names})


def mixed_format(schemes: list[Any]) -> str:
    """The folder's ``format``: the groups' one format, or ``mixed-precision`` when they differ."""
    formats = {scheme.format for scheme in schemes}
    return formats.pop() if len(formats) == 1 else MIXED


def mixed_groups(
    model: nn.Module, groups: list[tuple[Any, list[str]]], dequantized: list[bool]
) -> list[tuple[Any, list[str]]]:
    """``groups`` (scheme, layers) in the order transformers 5.24 loads right: it dequantizes
    every quantized expert with the first group targeting exact names (``get_experts_scheme``),
    so the experts' group goes first. Refused in one line, naming a layer of two groups: a mix
    with experts on two grids, or one marked ``dequantize`` (zero points of packed weights,
    Conv1D), which it loads with one group's scheme for every layer (``get_dense_scheme``)."""
    if len(groups) < 2:
        return groups
    first, second = groups[0][1][0], groups[1][1][0]
    if any(dequantized):
        index = dequantized.index(True)
        why = "has zero points of packed weights or is a Conv1D, which transformers loads dequantized"
        raise ConfigError(
            "export.format",
            "compressed-tensors",
            f"{groups[index][1][0]} {why}, with one group's scheme for every layer, and {first} and {second} "
            "are on different grids; quantize every layer on one grid or use format='safetensors'",
        )
    holding = [index for index, (_, layers) in enumerate(groups) if expert_layers(model, layers)]
    if len(holding) > 1:
        one, other = (expert_layers(model, groups[index][1])[0] for index in holding[:2])
        raise ConfigError(
            "export.format",
            "compressed-tensors",
            f"experts {one} and {other} are on different grids, and transformers loads every expert "
            "dequantized with one group's scheme; quantize every expert layer on one grid",
        )
    return [groups[index] for index in holding] + [g for index, g in enumerate(groups) if index not in holding]


def refuse_pruned_floats(masks: dict[str, Any], weights: dict[str, Any], version: str) -> None:
    """A pruned weight left unquantized (a plan's ``2:4`` layer) would be written dense:
    compressed-tensors ``version`` has no sparse compressor, so the folder would not hold the
    bytes the pruning saves; refused in one line naming the layer."""
    floats = [key for key in masks if key not in weights]
    if floats:
        layer = floats[0].rpartition(".")[0]
        raise ConfigError(
            "export.format",
            "compressed-tensors",
            f"{layer} is pruned but not quantized, and compressed-tensors {version} has no sparse compressor "
            "(it would be written dense); plan without '2:4', quantize it too, or use format='safetensors'",
        )
