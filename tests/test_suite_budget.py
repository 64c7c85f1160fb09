"""The suite's own rules hold: a run starting more child processes than the budget fails and names
the tests that started them (tests/subprocess_budget.py)."""

from __future__ import annotations

from pathlib import Path

from support import in_a_child  # tests/support.py

pytest_plugins = ["pytester"]

MANY = """
import subprocess

def test_starts_many():
    for _ in range({count}):
        subprocess.run(["true"], check=True)
"""


def test_a_run_over_the_subprocess_budget_fails_and_names_the_test(pytester):
    """In a forked copy: the inner session's counting and exit status are its own."""
    from subprocess_budget import LIMIT

    pytester.makeconftest((Path(__file__).parent / "conftest.py").read_text())
    pytester.syspathinsert(Path(__file__).parent)

    def run() -> None:
        pytester.makepyfile(test_many=MANY.format(count=LIMIT))
        within = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-p", "no:xdist")
        assert within.ret == 0
        within.stdout.fnmatch_lines([f"{LIMIT} started by the tests"])
        pytester.makepyfile(test_many=MANY.format(count=LIMIT + 1))
        over = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-p", "no:xdist")
        assert over.ret == 1  # the test itself passed
        over.stdout.fnmatch_lines(
            [
                f"{LIMIT + 1} started by the tests: over the budget of {LIMIT}*",
                f"*{LIMIT + 1}  test_many.py::test_starts_many",
            ]
        )

    in_a_child(run)
