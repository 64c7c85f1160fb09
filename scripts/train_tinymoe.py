"""Train :func:`surgery.tasks.tinymoe.train_moe` (a Qwen3-MoE, 8 experts a layer) on the shipped corpus
and save it as a Hugging Face folder."""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

from surgery.analysis.metrics import perplexity
from surgery.tasks.tinylm import token_batches
from surgery.tasks.tinymoe import FOLDER, build_moe, train_moe


def main(argv: list[str] | None = None) -> None:
    """Train (a few minutes on two cores), print held-out perplexity against the untrained
    model's, and replace the folder only once the new one is complete.

    Example:
        $ python scripts/train_tinymoe.py --out surgery/assets/tinymoe
    """
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=FOLDER, help="Hugging Face folder to write")
    parser.add_argument("--seed", type=int, default=0, help="seed of initialisation and sampling")
    parser.add_argument("--steps", type=int, default=400, help="optimizer steps of 16 windows of 128 bytes")
    args = parser.parse_args(argv)

    held_out = token_batches("test", 16)
    start = time.perf_counter()
    model = train_moe(seed=args.seed, steps=args.steps)
    print(
        f"trained in {time.perf_counter() - start:.1f} s: held-out perplexity {perplexity(model, held_out):.3f} "
        f"(untrained: {perplexity(build_moe(args.seed), held_out):.3f}; bytes)"
    )
    staging = Path(tempfile.mkdtemp(dir=args.out.parent))
    model.save_pretrained(staging, safe_serialization=True)
    staging.chmod(0o755)  # mkdtemp's folder is private; the shipped one is read by everyone
    for file in staging.iterdir():
        file.chmod(0o644)
    if args.out.exists():
        shutil.rmtree(args.out)
    staging.rename(args.out)
    print(f"wrote {args.out} ({sum(p.stat().st_size for p in args.out.iterdir())} bytes)")


if __name__ == "__main__":
    main()
