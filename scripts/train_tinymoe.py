"""Train :func:`surgery.tasks.tinymoe.train_moe` (a Qwen3-MoE, 8 experts a layer) on the shipped corpus
and save it as a Hugging Face folder.

Example (a few minutes on two cores):
    $ python scripts/train_tinymoe.py --out surgery/assets/tinymoe
"""

from __future__ import annotations

from surgery.tasks.shipping import train_and_ship
from surgery.tasks.tinymoe import FOLDER, build_moe, train_moe


def main(argv: list[str] | None = None) -> None:
    """Train 400 steps of 16 windows of 128 bytes (``--steps``) and write the folder."""
    train_and_ship(argv, train=train_moe, build=build_moe, folder=FOLDER, steps=400, description=__doc__)


if __name__ == "__main__":
    main()
