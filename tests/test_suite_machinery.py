"""The suite's own machinery: a run starting more child processes than the budget fails and names
the tests that started them (tests/subprocess_budget.py); the in-process command line survives
what earlier tests leave behind (tests/cli_runner.py)."""

from __future__ import annotations

from pathlib import Path

from cli_runner import run_cli  # tests/cli_runner.py
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


def test_a_log_handler_on_a_closed_stream_does_not_stop_the_runner(tmp_path):
    """tests/cli_runner.py: a library's console handler made while an earlier test's captured
    stream was current (now closed). Before: the runner flushed it and every later run failed."""
    import io
    import logging

    closed = io.TextIOWrapper(io.BytesIO())  # what pytest captures a test's output into
    handler = logging.StreamHandler(closed)
    logging.getLogger("a_library").addHandler(handler)
    closed.close()
    try:
        result = run_cli("prune.amount=2", f"hydra.run.dir={tmp_path}")
    finally:
        logging.getLogger("a_library").removeHandler(handler)
    assert result.returncode == 2 and handler.stream is closed
