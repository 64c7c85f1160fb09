"""Where a verb keeps the original values it undoes to (core.originals)."""

from __future__ import annotations

import torch
from torch import nn

from surgery.core.originals import Originals, read_again_from


def test_values_that_can_be_read_again_are_not_copied_and_come_back_from_their_source():
    layer, other = nn.Linear(4, 3), nn.Linear(4, 3)
    source = {id(layer.weight): layer.weight.detach().clone()}  # as an offloaded stage's files hold them
    reads = []

    def reader(param):
        if id(param) not in source:
            return None
        return lambda: reads.append(id(param)) or source[id(param)]

    store = Originals()
    with read_again_from(reader):
        store.keep("layer.weight", layer.weight)
        store.keep("other.weight", other.weight)  # not the reader's: copied as usual
    assert store.nbytes() == other.weight.numel() * 4
    kept_other = other.weight.detach().clone()
    with torch.no_grad():
        layer.weight.mul_(0)
        other.weight.mul_(0)
    store.put_back()
    assert torch.equal(layer.weight, source[id(layer.weight)]) and reads == [id(layer.weight)]
    assert torch.equal(other.weight, kept_other)


def test_outside_the_block_a_store_copies_again():
    layer = nn.Linear(4, 3)
    with read_again_from(lambda param: lambda: param.detach().clone()):
        pass
    store = Originals()
    store.keep("weight", layer.weight)
    assert store.nbytes() == layer.weight.numel() * 4
