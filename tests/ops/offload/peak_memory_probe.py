"""Peak resident memory of a calibrated verb beyond the built model, as a multiple of the
weights it rewrites (run in a child process by ``test_originals.py``).

Usage: ``python tests/ops/offload/peak_memory_probe.py gptq|sparsegpt|wanda memory|disk``, or
``... write FILE`` then ``... offloaded FILE`` (a forward of the model offloaded to FILE, beyond
the process before it, as a multiple of the weights in FILE) or ``... gptq-offloaded FILE``
(GPTQ on it, block by block, likewise), or ``... activations memory|disk`` (GPTQ whose block
activations dwarf its weights, held in memory or spilled: the peak as a multiple of one
block's inputs for all batches).
"""

from __future__ import annotations

import gc
import os
import sys

import torch
from safetensors.torch import save_file
from torch import nn

import surgery
from surgery import GridSpec


class Wide(nn.Module):
    """Blocks whose one layer is wide and short (64 inputs, 32768 outputs: 8 MB of weights,
    a 64 x 64 Hessian), so that the weights dominate the memory a run needs."""

    def __init__(self, blocks: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.ModuleDict({"up": nn.Linear(64, 32768)}) for _ in range(blocks))

    def forward(self, x):
        for block in self.blocks:
            x = x + block["up"](x).view(*x.shape[:-1], 512, 64).mean(-2)
        return x


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(64, 32768)

    def forward(self, x):
        return x + self.up(x).view(*x.shape[:-1], 512, 64).mean(-2)


class WideBlocks(nn.Module):
    """``Wide`` whose blocks are modules called in turn (a decoder's layers)."""

    def __init__(self, blocks: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(blocks))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def probe(method: str, where: str) -> None:
    torch.set_num_threads(1)
    if method in ("write", "offloaded", "gptq-offloaded", "activations"):
        probes = {"write": write, "offloaded": forward_offloaded, "gptq-offloaded": gptq_offloaded}
        return {**probes, "activations": activations}[method](where)
    torch.manual_seed(0)
    model = Wide(24).eval()
    data = [torch.randn(8, 64) for _ in range(2)]
    weights = sum(block["up"].weight.nbytes for block in model.blocks)
    gc.collect()
    base = memory("VmRSS")
    if method == "gptq":
        spec = GridSpec(bits=4, method="gptq", group_size=16)
        surgery.quantize(model, weights=spec, calibration=data, progress=False, originals=where)
    else:
        surgery.prune(model, 0.5, method=method, calibration=data, progress=False, originals=where)
    print((memory("VmHWM") - base) / weights)


def write(path: str) -> None:
    torch.manual_seed(0)
    save_file(Wide(24).state_dict(), path)


def forward_offloaded(path: str) -> None:
    weights = os.path.getsize(path)
    base = memory("VmRSS")
    handle = surgery.offloaded(path, factory=lambda: Wide(24))
    with torch.no_grad():
        handle.model(torch.randn(8, 64))
    print((memory("VmHWM") - base) / weights)


def gptq_offloaded(path: str) -> None:
    weights = os.path.getsize(path)
    data = [torch.randn(8, 64) for _ in range(2)]
    base = memory("VmRSS")
    handle = surgery.offloaded(path, factory=lambda: WideBlocks(24))
    spec = GridSpec(bits=4, method="gptq", group_size=16)
    done = surgery.quantize(handle, weights=spec, calibration=data, progress=False)
    assert done.blocks == 24
    print((memory("VmHWM") - base) / weights)


class Narrow(nn.Module):
    """Blocks of one 256-wide layer: 256 KB of weights, against 2 MB of activations per batch."""

    def __init__(self, blocks: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(256, 256), nn.Tanh()) for _ in range(blocks))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def activations(where: str) -> None:
    torch.manual_seed(0)
    model = Narrow(4).eval()
    data = [torch.randn(4, 512, 256) for _ in range(48)]  # 96 MB: a block's inputs for all batches
    cached = sum(x.nbytes for x in data)
    gc.collect()
    base = memory("VmRSS")
    with surgery.activation_budget(None if where == "memory" else 0):
        spec = GridSpec(bits=4, method="gptq", group_size=16)
        handle = surgery.quantize(model, weights=spec, calibration=data, progress=False)
    assert (handle.sequential.spilled_bytes > 0) == (where == "disk")
    print((memory("VmHWM") - base) / cached)


def memory(field: str) -> int:
    """Bytes of this process's resident memory now (``VmRSS``) or at its peak (``VmHWM``: since
    exec, unlike ``ru_maxrss``, which keeps the peak of the forking parent)."""
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


if __name__ == "__main__":
    probe(*sys.argv[1:])
