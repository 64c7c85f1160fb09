"""Peak resident memory of surgery's work, measured in a process of its own (the ``memory_probe``
fixture starts one, with ``MALLOC_MMAP_THRESHOLD_`` set so that freed tensors go back to the
system, and asks it for each measurement in turn: ``python tests/memory_probe.py serve``).
Each probe restarts the peak (``VmHWM``) where it takes its base and prints one number:

- ``gptq|sparsegpt|wanda memory|disk``: a calibrated verb's peak beyond the built model, as a
  multiple of the weights it rewrites;
- ``offloaded FILE``: a forward of the model offloaded to FILE (:func:`write`), as a multiple of
  the weights in FILE; ``gptq-offloaded FILE``: GPTQ on it, block by block, likewise;
- ``activations memory|disk``: GPTQ whose block activations dwarf its weights, held in memory or
  spilled: the peak as a multiple of one block's inputs for all batches;
- ``cli FOLDER OVERRIDE...``: ``python -m surgery OVERRIDE...`` (FOLDER importable), in MiB.
"""

from __future__ import annotations

import contextlib
import gc
import io
import json
import os
import sys
import traceback

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


def probe(method: str, *args: str) -> None:
    torch.set_num_threads(1)
    if method in ("offloaded", "gptq-offloaded", "activations", "cli"):
        probes = {"offloaded": forward_offloaded, "gptq-offloaded": gptq_offloaded, "cli": command_line}
        return {**probes, "activations": activations}[method](*args)
    (where,) = args
    torch.manual_seed(0)
    model = Wide(24).eval()
    data = [torch.randn(8, 64) for _ in range(2)]
    weights = sum(block["up"].weight.nbytes for block in model.blocks)
    base = start_measuring()
    if method == "gptq":
        spec = GridSpec(bits=4, group_size=16)
        surgery.quantize(model, weights=spec, method="gptq", calibration=data, progress=False, originals=where)
    else:
        surgery.prune(model, 0.5, method=method, calibration=data, progress=False, originals=where)
    print((memory("VmHWM") - base) / weights)


def write(path: str) -> None:
    """Save ``Wide(24)``'s weights to ``path`` (run in the test's process: no measurement)."""
    torch.manual_seed(0)
    save_file(Wide(24).state_dict(), path)


def forward_offloaded(path: str) -> None:
    weights = os.path.getsize(path)
    base = start_measuring()
    handle = surgery.offloaded(path, factory=lambda: Wide(24))
    with torch.no_grad():
        handle.model(torch.randn(8, 64))
    print((memory("VmHWM") - base) / weights)


def gptq_offloaded(path: str) -> None:
    weights = os.path.getsize(path)
    data = [torch.randn(8, 64) for _ in range(2)]
    base = start_measuring()
    handle = surgery.offloaded(path, factory=lambda: WideBlocks(24))
    spec = GridSpec(bits=4, group_size=16)
    done = surgery.quantize(handle, weights=spec, method="gptq", calibration=data, progress=False)
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
    base = start_measuring()
    with surgery.activation_budget(None if where == "memory" else 0):
        spec = GridSpec(bits=4, group_size=16)
        handle = surgery.quantize(model, weights=spec, method="gptq", calibration=data, progress=False)
    assert (handle.sequential.spilled_bytes > 0) == (where == "disk")
    print((memory("VmHWM") - base) / cached)


def command_line(folder: str, *overrides: str) -> None:
    """The peak of one ``python -m surgery`` run beyond the process before it, in MiB."""
    from surgery.cli.app import run_command_line

    sys.path.insert(0, folder)
    sys.argv = ["surgery", *overrides]
    base = start_measuring()
    with contextlib.redirect_stdout(io.StringIO()):
        code = run_command_line(overrides)
    assert code in (0, 1), f"exit {code}"
    print((memory("VmHWM") - base) / 2**20)


def start_measuring() -> int:
    """Restart the peak at the memory held now (Linux: ``/proc/self/clear_refs``); that memory, in bytes."""
    gc.collect()
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")
    return memory("VmRSS")


def memory(field: str) -> int:
    """Bytes of this process's resident memory now (``VmRSS``) or at its peak (``VmHWM``)."""
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def serve() -> None:
    """Answer each JSON list of probe arguments read from stdin with one JSON line: the
    number the probe printed (``{"value": ...}``) or why it failed (``{"error": ...}``)."""
    for line in sys.stdin:
        printed = io.StringIO()
        try:
            with contextlib.redirect_stdout(printed):
                probe(*json.loads(line))
            reply = {"value": float(printed.getvalue().split()[-1])}
        except BaseException:  # noqa: BLE001 - the test that asked says why
            reply = {"error": traceback.format_exc()[-3000:]}
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    serve() if sys.argv[1:] == ["serve"] else probe(*sys.argv[1:])
