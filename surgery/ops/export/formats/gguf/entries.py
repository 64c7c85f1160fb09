"""The tensors a GGUF file holds, from a model's parameters: one per parameter, except a
mixture-of-experts layer's experts, which llama.cpp keeps stacked, one (experts, rows, columns)
tensor per projection (``blk.N.ffn_gate_exps``, ``ffn_up_exps``, ``ffn_down_exps``). Under
surgery each expert is a Linear of its own (``mlp.experts.E.gate_proj``, its own grid); a model
left as Hugging Face builds it keeps them fused (``mlp.experts.gate_up_proj``: the gate's rows,
then the up projection's), and so does an offloaded one whose experts a verb quantized (their
grids then named per expert, their values read fused)."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor, nn

from surgery.core.errors import ConfigError
from surgery.ops.export.formats.gguf.models import tensor_name
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
    fused: bool = False  # sources[0] holds every expert (experts, rows, columns); grids: one per expert

    @property
    def stacked(self) -> bool:
        """Whether it is a stack of experts (a 3-D tensor in the file)."""
        return len(self.sources) > 1 or self.sources[0].dim() == 3

    @property
    def one_shape(self) -> tuple[int, ...]:
        """The shape of one source's weight (one expert's, for a fused one)."""
        first = self.sources[0]
        if not self.fused:
            return tuple(first.shape)
        return (self.rows.stop - self.rows.start if self.rows else first.shape[1], *first.shape[2:])

    def values(self, read: Callable[[Tensor], Tensor]) -> list[Tensor]:
        """Each source's weight read with ``read`` (each expert's, split from a fused one, rows taken)."""
        if not self.fused:
            return [read(source) for source in self.sources]
        whole = read(self.sources[0])
        return list((whole if self.rows is None else whole[:, self.rows]).unbind(0))


def entries(model: nn.Module, grids: dict[str, WeightGrid]) -> list[Entry]:
    """Every parameter once, with its grid found by identity (a head tied to the embeddings is
    written once, as ``token_embd``, on the grid quantized under either name), the experts of
    each layer stacked per projection, at the place of the first."""
    by_identity, per_expert = {}, {}
    for key, grid in grids.items():
        try:
            by_identity[id(model.get_parameter(key))] = grid
        except AttributeError:  # an expert's layer of a model whose experts stay fused
            per_expert[key] = grid
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
            found.extend(_fused(key, value, grid, int(fused[1]), fused[2], per_expert))
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


def _fused(
    key: str, value: Tensor, grid: WeightGrid | None, layer: int, kind: str, per_expert: dict[str, WeightGrid]
) -> list[Entry]:
    """A fused experts parameter as llama.cpp's stacked tensors: ``gate_up_proj`` (experts,
    2 x rows, columns) as the gate's and the up projection's, ``down_proj`` as it is; each
    expert on its grid where ``per_expert`` names them (``...experts.3.gate_proj.weight``)."""
    if grid is not None:
        raise ConfigError(
            "export.format", "gguf", f"{key} is quantized fused; quantize() gives each expert its own grid"
        )
    owner = key.rpartition(".")[0]
    experts = value.shape[0]

    def entry(projection: str, rows: slice | None) -> Entry:
        name = f"blk.{layer}.ffn_{projection}_exps.weight"
        keys = [f"{owner}.{e}.{projection}_proj.weight" for e in range(experts)]
        grids = tuple(per_expert.get(k) for k in keys)
        if all(g is None for g in grids):
            return Entry(name, key, (value,), (None,), rows)
        if any(g is None for g in grids):
            raise ConfigError(
                "export.format", "gguf", f"{name} stacks experts some quantized, some not ({key}); quantize all"
            )
        return Entry(name, keys[0], (value,), grids, rows, fused=True)

    if kind == "down_proj":
        return [entry("down", None)]
    half = value.shape[1] // 2
    return [entry("gate", slice(0, half)), entry("up", slice(half, 2 * half))]
