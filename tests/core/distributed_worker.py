"""One rank of ``test_distributed.py``: GPTQ (and SparseGPT, Wanda) on a seeded tiny Llama with
the calibration shared across the processes torchrun started, each rank's weights written to
OUT/in-memory/rank-R-METHOD.safetensors, then the same on the Llama saved in FOLDER, offloaded,
into OUT/offloaded/, then ranks given different models, settings or batches into OUT/disagree/
(see :func:`disagree`): one torchrun for the three, as its start-up takes seconds.

Usage: ``torchrun --standalone --nproc-per-node 2 tests/core/distributed_worker.py OUT FOLDER``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).parents[1]))
from support import tiny_llama  # noqa: E402 - tests/support.py

import surgery  # noqa: E402
from surgery import GridSpec  # noqa: E402


def batches(count: int = 4, seed: int = 1) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (2, 16), generator=generator) for _ in range(count)]


def run(method: str, model, calibration: list[torch.Tensor] | None = None, **keywords):
    calibration = batches() if calibration is None else calibration
    if method == "gptq":
        spec = GridSpec(bits=4, group_size=32)
        return surgery.quantize(model, weights=spec, method="gptq", calibration=calibration, progress=False, **keywords)
    return surgery.prune(model, 0.5, method=method, calibration=calibration, progress=False, **keywords)


def shards() -> list[torch.Tensor]:
    """Each rank's own shard: 6 batches on rank 0, 4 others on rank 1."""
    rank = torch.distributed.get_rank()
    return batches(6, seed=2) if rank == 0 else batches(4, seed=3)


def disagree(out: str) -> None:
    """Rank 1 holds another model, then excludes a layer rank 0 keeps, then has no batches: each rank writes the
    refusals it met to OUT/refusals-R.txt; then each rank calibrates on its own shard of
    batches, writing OUT/rank-R-shards.safetensors."""
    rank = torch.distributed.get_rank()
    refusals = []
    model = tiny_llama(layers=2)
    if rank == 1:
        model.lm_head.weight.data[0, 0] += 1.0
    for method, other, keywords in (
        ("gptq", model, {}),
        ("sparsegpt", tiny_llama(layers=2), {"exclude": "model.layers.0.mlp.down_proj"}),
    ):
        try:
            run(method, other, **(keywords if rank == 1 else {}))
            refusals.append("finished")
        except surgery.ConfigError as err:
            refusals.append(str(err))
    try:  # rank 1 refuses its own (empty) batches: rank 0 must not wait for it
        run("gptq", tiny_llama(layers=2), [] if rank == 1 else None)
        refusals.append("finished")
    except surgery.ConfigError as err:
        refusals.append(str(err))
    Path(f"{out}/refusals-{rank}.txt").write_text("\n".join(refusals))
    model = tiny_llama(layers=2)
    run("sparsegpt", model, shards()).bake()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, f"{out}/rank-{rank}-shards.safetensors")


def main(out: str, folder: str) -> None:
    torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank()
    with surgery.distributed_calibration():
        for where in ("in-memory", "offloaded"):
            Path(out, where).mkdir(exist_ok=True)
            for method in ("gptq", "sparsegpt", "wanda"):
                if where == "offloaded":
                    source = surgery.offloaded(folder)
                    run(method, source)
                    state = {k: source.value_of(v) for k, v in source.model.state_dict(keep_vars=True).items()}
                else:
                    model = tiny_llama(layers=2)
                    run(method, model).bake()
                    state = model.state_dict()
                save_file(
                    {k: v.contiguous() for k, v in state.items()}, f"{out}/{where}/rank-{rank}-{method}.safetensors"
                )
        Path(out, "disagree").mkdir(exist_ok=True)
        disagree(f"{out}/disagree")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
