"""Train :func:`surgery.tasks.tinyqwen3.train_qwen3` on the shipped corpus and save it as a Hugging Face folder.

Example (a few minutes on two cores):
    $ python scripts/train_tinyqwen3.py --out surgery/assets/tinyqwen3
"""

from __future__ import annotations

from surgery.tasks.shipping import train_and_ship
from surgery.tasks.tinyqwen3 import FOLDER, build_qwen3, train_qwen3


def main(argv: list[str] | None = None) -> None:
    """Train 2000 steps of 32 windows of 128 bytes (``--steps``) and write the folder."""
    train_and_ship(argv, train=train_qwen3, build=build_qwen3, folder=FOLDER, steps=2000, description=__doc__)


if __name__ == "__main__":
    main()
