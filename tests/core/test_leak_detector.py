"""The autouse leak detector in conftest.py fails a test that leaves global state behind."""

from __future__ import annotations

from pathlib import Path

from support import in_a_child  # tests/support.py

pytest_plugins = ["pytester"]

LEAKY_TESTS = """
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch import nn
import surgery


def test_leaks_a_global_forward_hook():
    nn.modules.module.register_module_forward_hook(lambda module, args, output: None)


OPEN = []


def test_leaves_an_intercept_block_open():
    OPEN.append(surgery.intercept(surgery.rules.swap(nn.ReLU, lambda old: nn.SiLU())))
    OPEN[-1].__enter__()  # kept referenced: never exits


def test_leaks_a_global_optimizer_hook():
    register_optimizer_step_post_hook(lambda *args: None)


def test_clean():
    with surgery.prune(nn.Linear(4, 4), 0.5):
        pass
"""


def test_each_kind_of_leak_fails_the_test_that_caused_it(pytester):
    """The leaky tests run in a forked copy of this process, whose registries they leak into."""
    pytester.makeconftest((Path(__file__).parents[1] / "conftest.py").read_text())
    pytester.makepyfile(test_leaky=LEAKY_TESTS)
    pytester.syspathinsert(Path(__file__).parents[1])  # the conftest's plugins: tests/*.py

    def run() -> None:
        result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-p", "no:xdist")
        result.assert_outcomes(passed=4, errors=3)
        result.stdout.fnmatch_lines(["*_global_forward_hooks*", "*intercept blocks*", "*optimizer post hooks*"])

    in_a_child(run)
