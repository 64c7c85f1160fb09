"""Train :class:`surgery.tasks.digits.DigitsCNN` and write its weights as a safetensors checkpoint."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from safetensors.torch import save_file

from surgery.analysis.metrics import accuracy
from surgery.core.checkpoints import write_atomically
from surgery.tasks.digits import CHECKPOINT, digits_batches, train


def main(argv: list[str] | None = None) -> None:
    """Train, print train/test accuracy, and save the checkpoint atomically.

    Example:
        $ python scripts/train_digits_cnn.py --out surgery/assets/digits_cnn.safetensors
    """
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=CHECKPOINT, help="checkpoint to write")
    parser.add_argument("--seed", type=int, default=0, help="seed of initialisation and shuffling")
    parser.add_argument("--epochs", type=int, default=8, help="passes over the train split")
    args = parser.parse_args(argv)

    start = time.perf_counter()
    model = train(seed=args.seed, epochs=args.epochs)
    seconds = time.perf_counter() - start
    train_acc = accuracy(model, digits_batches("train", 256))
    test_acc = accuracy(model, digits_batches("test", 256))
    print(f"trained in {seconds:.1f} s: train accuracy {train_acc:.4f}, test accuracy {test_acc:.4f}")

    state = {k: v.detach().cpu().contiguous().clone() for k, v in model.state_dict().items()}
    write_atomically(args.out, lambda tmp: save_file(state, str(tmp)))
    print(f"wrote {args.out} ({args.out.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
