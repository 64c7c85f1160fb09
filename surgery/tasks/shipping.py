"""Train a model shipped with surgery on the tiny-LM corpus and write its Hugging Face folder
whole or not at all: what ``scripts/train_tinyllama.py`` and ``scripts/train_tinymoe.py`` run."""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from torch import nn

from surgery.analysis.metrics import perplexity
from surgery.tasks.tinylm import token_batches


def train_and_ship(
    argv: list[str] | None,
    *,
    train: Callable[..., nn.Module],
    build: Callable[[int], nn.Module],
    folder: Path,
    steps: int,
    description: str,
) -> None:
    """Train (``--seed``, ``--steps``), print held-out perplexity against the untrained model's,
    and replace ``--out`` (default ``folder``) only once the new folder is complete."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", type=Path, default=folder, help="Hugging Face folder to write")
    parser.add_argument("--seed", type=int, default=0, help="seed of initialisation and sampling")
    parser.add_argument("--steps", type=int, default=steps, help="optimizer steps")
    args = parser.parse_args(argv)

    held_out = token_batches("test", 16)
    start = time.perf_counter()
    model = train(seed=args.seed, steps=args.steps)
    print(
        f"trained in {time.perf_counter() - start:.1f} s: held-out perplexity {perplexity(model, held_out):.3f} "
        f"(untrained: {perplexity(build(args.seed), held_out):.3f}; bytes)"
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
