"""Print the coverage table of docs/models.md (every verb and export on one tiny model of each
decoder family), or rewrite it there.

Usage::

    .venv/bin/python scripts/family_coverage.py                  # print the table (~3 min on 2 cores)
    .venv/bin/python scripts/family_coverage.py --write          # rewrite it in docs/models.md
    .venv/bin/python scripts/family_coverage.py --families llama gpt2 --details   # each refusal whole

The models, verbs and cells are in ``tests/support_families.py``; ``tests/test_family_coverage.py``
fails when the table there and the one in docs/models.md differ.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.support_families import CELLS, FAMILIES, coverage, render, rewrite_docs  # noqa: E402


def main() -> None:
    """Build the table of the families and cells asked for; print it, or write it to the docs."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", choices=FAMILIES, default=list(FAMILIES))
    parser.add_argument("--cells", nargs="+", choices=CELLS, default=list(CELLS))
    parser.add_argument("--write", action="store_true", help="rewrite the table in docs/models.md (every family)")
    parser.add_argument("--details", action="store_true", help="also print each refusal and traceback whole")
    args = parser.parse_args()
    if args.write and (args.families != list(FAMILIES) or args.cells != list(CELLS)):
        parser.error("--write builds the whole table: leave out --families and --cells")
    details: dict = {}
    table = coverage(tuple(args.families), tuple(args.cells), details)
    if args.write:
        rewrite_docs(table)
    print(render(table))
    for (family, cell), text in details.items() if args.details else ():
        print(f"\n## {family} / {cell}\n{text}")


if __name__ == "__main__":
    main()
