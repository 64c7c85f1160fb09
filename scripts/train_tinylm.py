"""Train :class:`surgery.tasks.tinylm.TinyLM` on the shipped corpus and write its weights as safetensors."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from safetensors.torch import save_file

from surgery.analysis.metrics import perplexity
from surgery.core.checkpoints import write_atomically
from surgery.tasks.tinylm import CHECKPOINT, token_batches, train


def main(argv: list[str] | None = None) -> None:
    """Train (about 5 minutes on two cores), print held-out perplexity, save the checkpoint atomically.

    Example:
        $ python scripts/train_tinylm.py --out surgery/assets/tinylm.safetensors
    """
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=CHECKPOINT, help="checkpoint to write")
    parser.add_argument("--seed", type=int, default=0, help="seed of initialisation and sampling")
    parser.add_argument("--steps", type=int, default=1500, help="optimizer steps of 32 windows of 128 bytes")
    args = parser.parse_args(argv)

    start = time.perf_counter()
    model = train(seed=args.seed, steps=args.steps)
    print(
        f"trained in {time.perf_counter() - start:.1f} s: held-out perplexity "
        f"{perplexity(model, token_batches('test', 16)):.3f} (bytes)"
    )
    state = {k: v.detach().cpu().contiguous().clone() for k, v in model.state_dict().items()}
    write_atomically(args.out, lambda tmp: save_file(state, str(tmp)))
    print(f"wrote {args.out} ({args.out.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
