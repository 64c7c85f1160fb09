"""Where the channel axis goes through indexing."""

from __future__ import annotations

import torch

from surgery.ops.shrink.following import indexed_axis


def test_gathering_tokens_keeps_the_last_axis_but_indexing_it_does_not():
    x = torch.zeros(6, 4)
    token = torch.tensor([0, 2])
    assert indexed_axis(token, x, 1) == -1
    assert indexed_axis((token, slice(None)), x, 1) is None  # only leading axes, no slice after
    assert indexed_axis((slice(None), token), x, 1) is None
    assert indexed_axis(torch.tensor([0.5]), x, 1) is None
