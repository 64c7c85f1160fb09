"""The tensors a GGUF file holds, from a model's parameters: one per parameter, except a
mixture-of-experts layer's experts, which llama.cpp keeps stacked, one (experts, rows, columns)
tensor per projection (``blk.N.ffn_gate_exps``, ``ffn_up_exps``, ``ffn_down_exps``). Under
surgery each expert is a Linear of its own (``mlp.experts.E.gate_proj``, its own grid); a model
left as Hugging Face builds it keeps them fused (``mlp.experts.gate_up_proj``: the gate's rows,
then the up projection's)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from torch import Tensor, nn

from surgery.core.errors import ConfigError
from surgery.ops.export.formats.gguf_models import tensor_name
from surgery.ops.numerics.deployment import WeightGrid

_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
_FUSED = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")


@dataclass(frozen=True)
class Entry:
    """One GGUF tensor: its ``name``, the ``sources`` read for it in order (a parameter, or
    one per expert) with their ``grids``, and ``rows``: the half of a fused parameter's second
    axis it takes (None: all). ``key`` names it in messages (the first source's qualified name)."""

    name: str
    key: str
    sources: tuple[Tensor, ...]
    grids: tuple[WeightGrid | None, ...]
    rows: slice | None = None

    @property
    def stacked(self) -> bool:
        """Whether it is a stack of experts (a 3-D tensor in the file)."""
        return len(self.sources) > 1 or self.sources[0].dim() == 3


def entries(model: nn.Module, grids: dict[str, WeightGrid]) -> list[Entry]:
    """Every parameter once, with its grid found by identity (a head tied to the embeddings is
    written once, as ``token_embd``, on the grid quantized under either name), the experts of
    each layer stacked per projection, at the place of the first."""
    by_identity = {id(model.get_parameter(key)): grid for key, grid in grids.items()}
    found: list[Entry | tuple[int, str]] = []
    experts: dict[tuple[int, str], list[tuple[int, str, Tensor, WeightGrid | None]]] = {}
    for key, value in model.named_parameters():
        grid = by_identity.get(id(value))
        if expert := _EXPERT.match(key):
            layer, index, projection = int(expert[1]), int(expert[2]), expert[3]
            if (layer, projection) not in experts:
                found.append((layer, projection))
            experts.setdefault((layer, projection), []).append((index, key, value, grid))
        elif fused := _FUSED.match(key):
            found.extend(_fused(key, value, grid, int(fused[1]), fused[2]))
        else:
            found.append(Entry(tensor_name(key), key, (value,), (grid,)))
    return [item if isinstance(item, Entry) else _stack(*item, experts[item]) for item in found]


def _stack(layer: int, projection: str, members: list[tuple[int, str, Tensor, WeightGrid | None]]) -> Entry:
    members = sorted(members, key=lambda member: member[0])
    if [index for index, *_ in members] != list(range(len(members))):
        raise ConfigError("export.format", "gguf", f"layer {layer}'s experts are not numbered 0 to {len(members) - 1}")
    _, key, _, _ = members[0]
    sources = tuple(value for _, _, value, _ in members)
    return Entry(f"blk.{layer}.ffn_{projection}_exps.weight", key, sources, tuple(grid for *_, grid in members))


def _fused(key: str, value: Tensor, grid: WeightGrid | None, layer: int, kind: str) -> list[Entry]:
    """A fused experts parameter as llama.cpp's stacked tensors: ``gate_up_proj`` (experts,
    2 x rows, columns) as the gate's and the up projection's, ``down_proj`` as it is."""
    if grid is not None:
        raise ConfigError(
            "export.format", "gguf", f"{key} is quantized fused; quantize() gives each expert its own grid"
        )
    if kind == "down_proj":
        return [Entry(f"blk.{layer}.ffn_down_exps.weight", key, (value,), (None,))]
    half = value.shape[1] // 2
    return [
        Entry(f"blk.{layer}.ffn_gate_exps.weight", key, (value,), (None,), slice(0, half)),
        Entry(f"blk.{layer}.ffn_up_exps.weight", key, (value,), (None,), slice(half, 2 * half)),
    ]
