"""One rank of ``test_distributed.py``: GPTQ (and SparseGPT, Wanda) on a seeded tiny Llama with
the calibration shared across the processes torchrun started, each rank's weights written to
OUT/rank-R-METHOD.safetensors.

Usage: ``torchrun --standalone --nproc-per-node 2 tests/core/distributed_worker.py OUT [offloaded FOLDER]``
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).parents[1]))
from support import tiny_llama  # noqa: E402 - tests/support.py

import surgery  # noqa: E402
from surgery import QuantSpec  # noqa: E402


def batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, 128, (2, 16), generator=generator) for _ in range(4)]


def run(method: str, model):
    if method == "gptq":
        spec = QuantSpec(bits=4, method="gptq", group_size=32)
        return surgery.quantize(model, weights=spec, calibration=batches(), progress=False)
    return surgery.prune(model, 0.5, method=method, calibration=batches(), progress=False)


def main(out: str, *offloaded: str) -> None:
    torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank()
    with surgery.distributed_calibration():
        for method in ("gptq", "sparsegpt", "wanda"):
            if offloaded:
                source = surgery.offloaded(offloaded[1])
                run(method, source)
                state = {k: source.value_of(v) for k, v in source.model.state_dict(keep_vars=True).items()}
            else:
                model = tiny_llama(layers=2)
                run(method, model).bake()
                state = model.state_dict()
            save_file({k: v.contiguous() for k, v in state.items()}, f"{out}/rank-{rank}-{method}.safetensors")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
