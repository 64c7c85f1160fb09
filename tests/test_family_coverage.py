"""docs/models.md's table of every verb and export on each decoder family is what they do now: a
cell that changes (a refusal lifted, a new bug) fails here until the table is rewritten
(``python scripts/family_coverage.py --write``)."""

from __future__ import annotations

import os

import pytest

from tests.support_families import CELLS, FAMILIES, coverage, documented

SAMPLE = ("llama", "gpt2", "qwen3_moe")  # a dense RMSNorm model, a LayerNorm/Conv1D one, a mixture of experts


REWRITE = "\n(where the change is meant: python scripts/family_coverage.py --write)"


def differing(found: dict, table: dict) -> list[str]:
    """``family/cell: documented -> found`` for each cell of ``found`` the table says otherwise."""
    return [f"{f}/{c}: {table.get((f, c))!r} -> {v!r}" for (f, c), v in found.items() if table.get((f, c)) != v]


def test_the_table_has_a_cell_for_every_family_and_verb():
    assert sorted(documented()) == sorted((family, cell) for family in FAMILIES for cell in CELLS)


@pytest.mark.parametrize("family", SAMPLE)
def test_the_sampled_family_does_what_the_table_says(family):
    found = coverage((family,))
    assert not differing(found, documented()), "\n".join(differing(found, documented())) + REWRITE


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("SURGERY_FAMILY_SWEEP") != "1", reason="the whole table takes minutes: make family-coverage"
)
@pytest.mark.parametrize("family", [f for f in FAMILIES if f not in SAMPLE])  # one a test: xdist shares them out
def test_every_family_does_what_the_table_says(family):
    found = coverage((family,))
    assert not differing(found, documented()), "\n".join(differing(found, documented())) + REWRITE
