"""Train :func:`surgery.tasks.tinyllama.train_llama` on the shipped corpus and save it as a Hugging Face folder.

Example (a few minutes on two cores):
    $ python scripts/train_tinyllama.py --out surgery/assets/tinyllama
"""

from __future__ import annotations

from surgery.tasks.shipping import train_and_ship
from surgery.tasks.tinyllama import FOLDER, build_llama, train_llama


def main(argv: list[str] | None = None) -> None:
    """Train 2000 steps of 32 windows of 128 bytes (``--steps``) and write the folder."""
    train_and_ship(argv, train=train_llama, build=build_llama, folder=FOLDER, steps=2000, description=__doc__)


if __name__ == "__main__":
    main()
