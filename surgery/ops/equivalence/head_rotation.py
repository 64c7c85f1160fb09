"""Per-head rotations of attention values (SpinQuant's R2): inside each attention, the values
of every head are rotated by one orthogonal ``R`` (head_dim × head_dim) and the output
projection's inputs of that head by the same ``R``, so the attention computes the same function
(the attention weights mix tokens, never channels, and no position rotation touches values)
while ``o_proj``'s inputs lose their outliers."""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor, nn


class Heads(NamedTuple):
    """One attention's value projection, output projection and head width."""

    values: str
    output: str
    width: int


def find_heads(named: dict[str, nn.Module], blocks: list[str]) -> dict[str, Heads]:
    """Every attention inside ``blocks`` with Linear ``v_proj`` and ``o_proj`` children and a
    ``head_dim`` dividing both, by name."""
    found = {}
    for name, module in named.items():
        if not any(name.startswith(b + ".") for b in blocks):
            continue
        v, o = getattr(module, "v_proj", None), getattr(module, "o_proj", None)
        width = getattr(module, "head_dim", None)
        if not (isinstance(v, nn.Linear) and isinstance(o, nn.Linear) and isinstance(width, int) and width > 0):
            continue
        if v.out_features % width == 0 and o.in_features % width == 0:
            found[name] = Heads(f"{name}.v_proj", f"{name}.o_proj", width)
    return found


def rotate_heads(values: dict[str, Tensor], weights: dict[str, Tensor], heads: Heads, r: Tensor) -> None:
    """Into ``values``: ``heads``' value projection with each head's rows ``Rᵀ W_h`` (its bias
    ``b_h R``) and output projection with each head's columns ``W_h R``; ``weights`` holds the
    parameters' values before (``values`` first, where they were rotated already)."""

    def current(name: str) -> Tensor:
        return values.get(name, weights[name])

    v = current(f"{heads.values}.weight")
    r = r.to(v.device)
    rows = v.double().reshape(-1, heads.width, v.shape[-1])
    values[f"{heads.values}.weight"] = (r.double().t() @ rows).reshape(v.shape).to(v.dtype)
    if f"{heads.values}.bias" in weights:
        b = current(f"{heads.values}.bias")
        values[f"{heads.values}.bias"] = (b.double().reshape(-1, heads.width) @ r.double()).reshape(b.shape).to(b.dtype)
    o = current(f"{heads.output}.weight")
    columns = o.double().reshape(o.shape[0], -1, heads.width)
    values[f"{heads.output}.weight"] = (columns @ r.double()).reshape(o.shape).to(o.dtype)
