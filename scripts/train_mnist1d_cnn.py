"""Train :class:`surgery.tasks.mnist1d.MNIST1DCNN` on MNIST-1D and write its weights as safetensors."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from safetensors.torch import save_file

from surgery.core.checkpoints import write_atomically
from surgery.tasks.mnist1d import CHECKPOINT, accuracy, mnist1d_batches, train


def main(argv: list[str] | None = None) -> None:
    """Train (about 20 s on one core), print train/test accuracy, save the checkpoint atomically.

    Example:
        $ python scripts/train_mnist1d_cnn.py --out surgery/assets/mnist1d_cnn.safetensors
    """
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=CHECKPOINT, help="checkpoint to write")
    parser.add_argument("--seed", type=int, default=0, help="seed of initialisation and shuffling")
    parser.add_argument("--epochs", type=int, default=60, help="passes over the 4000 training signals")
    args = parser.parse_args(argv)

    start = time.perf_counter()
    model = train(seed=args.seed, epochs=args.epochs)
    seconds = time.perf_counter() - start
    print(
        f"trained in {seconds:.1f} s: train accuracy {accuracy(model, mnist1d_batches('train', 500)):.4f}, "
        f"test accuracy {accuracy(model, mnist1d_batches('test', 500)):.4f}"
    )
    state = {k: v.detach().cpu().contiguous().clone() for k, v in model.state_dict().items()}
    write_atomically(args.out, lambda tmp: save_file(state, str(tmp)))
    print(f"wrote {args.out} ({args.out.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
