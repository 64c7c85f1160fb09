"""A stage's layers are solved and written one at a time, each Hessian dropped once used: what
keeps an offloaded block's peak at one block's work (see docs/scale.md)."""

from __future__ import annotations

import weakref

import torch
from torch import nn

from surgery.core.originals import Originals
from surgery.core.targets import Target
from surgery.ops.second_order.reconstruction import inverse_factor
from surgery.ops.second_order.second_order import reconstruct_layers


class SameInput(nn.Module):
    """Three layers fed the same input (as q, k and v): one stage, solved from one forward."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) + self.b(x) + self.c(x)


def test_each_layer_is_written_before_the_next_is_solved_and_its_hessian_dropped():
    torch.manual_seed(0)
    model = nn.Sequential(SameInput())
    layers = ("0.a", "0.b", "0.c")
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    targets = {f"{n}.weight": Target(f"{n}.weight", n, model.get_submodule(n)) for n in layers}
    seen: list[tuple[str, list[str], list[bool]]] = []  # (layer, layers already written, Hessians of those still alive)
    used: dict[str, weakref.ref] = {}

    def solver(layer: str, matrix: torch.Tensor, hessian: torch.Tensor) -> tuple[torch.Tensor, tuple]:
        written = [n for n in layers if not torch.equal(model.get_submodule(n).weight, before[f"{n}.weight"])]
        seen.append((layer, written, [used[n]() is not None for n in written]))
        used[layer] = weakref.ref(hessian._base if hessian._base is not None else hessian)
        return matrix * 0.5, ()

    calibration = [torch.randn(4, 8) for _ in range(2)]
    reconstruct_layers(model, targets, calibration, solver, Originals(), blocks=["0"], progress=False)
    assert [layer for layer, _, _ in seen] == list(layers)
    for index, (_, written, alive) in enumerate(seen):
        assert written == [layer for layer, _, _ in seen[:index]]  # written as soon as solved
        assert not any(alive)  # and its Hessian gone by then
    for name in layers:
        torch.testing.assert_close(model.get_submodule(name).weight, before[f"{name}.weight"] * 0.5, rtol=0, atol=0)


def test_a_hessian_positive_definite_only_with_more_damping_gets_it():
    """An indefinite Hessian (one negative eigenvalue a little below zero) fails at 1% damping
    and factors at 10%: the factor is that of (H + 0.1·mean diag·I)⁻¹, H itself untouched."""
    torch.manual_seed(0)
    q, _ = torch.linalg.qr(torch.randn(6, 6))
    eigenvalues = torch.tensor([-0.05, 1.0, 2.0, 3.0, 4.0, 5.0])
    h = (q * eigenvalues) @ q.T
    h = (h + h.T) / 2
    kept = h.clone()
    upper = inverse_factor(h, 0.01, "layer")
    damped = h + 0.1 * torch.diagonal(h).mean() * torch.eye(6)
    torch.testing.assert_close(upper.T @ upper, torch.linalg.inv(damped), rtol=1e-4, atol=1e-5)
    assert torch.equal(h, kept)
