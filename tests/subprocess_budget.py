"""The suite's budget of child processes: each costs a Python start-up (``import torch``, Hydra:
4-9 s on two cores), so the command line is tested in-process (tests/cli_runner.py) and only a
few true end-to-end runs start a process. Every ``subprocess.Popen`` a test starts is counted
(xdist workers report theirs to the controller); the summary names them, and a run over
:data:`LIMIT` fails. Counted are the processes the tests start. Listed apart: those surgery starts
as the behaviour under test (its llama.cpp worker, which the tests replace with failing, hanging
or lying stand-ins) and those a library starts on its own (torch.compile's C++ compiler, a Hydra
launcher's jobs); the peers' tests (``-m peers``, their own environments) are not counted."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

LIMIT = 20
REPO = Path(__file__).resolve().parents[1]
SURGERY = str(REPO / "surgery")
LIBRARIES = tuple({sys.prefix, sys.base_prefix})  # the environment's packages and the standard library
_started: Counter[str] = Counter()
_by_others: Counter[str] = Counter()  # "surgery" or a library's folder name
_current = {"test": "(outside a test)", "counted": True}
_original_init = subprocess.Popen.__init__


def _counting_init(self, *args, **kwargs) -> None:
    caller = _caller()
    _original_init(self, *args, **kwargs)  # raises where no process starts (not a program): not counted
    if not _current["counted"]:
        return
    if caller.startswith(SURGERY):
        _by_others["surgery"] += 1
    elif caller.startswith(LIBRARIES):
        _by_others[Path(caller).parent.name] += 1
    else:  # a test, or a helper of the tests
        _started[_current["test"]] += 1


def _caller() -> str:
    """The file that asked for the process: the first frame outside subprocess.py and this file."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename in (subprocess.__file__, __file__):
        frame = frame.f_back
    return frame.f_code.co_filename if frame is not None else ""


def pytest_configure(config: pytest.Config) -> None:
    _started.clear()  # a session's own count (a pytester session inside another starts from nothing)
    _by_others.clear()
    subprocess.Popen.__init__ = _counting_init


def pytest_unconfigure(config: pytest.Config) -> None:
    subprocess.Popen.__init__ = _original_init


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    _current.update(test=item.nodeid, counted=item.get_closest_marker("peers") is None)
    try:
        return (yield)
    finally:
        _current.update(test="(outside a test)", counted=True)


def pytest_sessionfinish(session: pytest.Session) -> None:
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker: the controller adds them up
        workeroutput["subprocesses"] = dict(_started)
        workeroutput["subprocesses by others"] = dict(_by_others)
        return
    if sum(_started.values()) > LIMIT and session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    _started.update(getattr(node, "workeroutput", {}).get("subprocesses", {}))
    _by_others.update(getattr(node, "workeroutput", {}).get("subprocesses by others", {}))


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    if getattr(config, "workeroutput", None) is not None or not (_started or _by_others):
        return
    total = sum(_started.values())
    verdict = "" if total <= LIMIT else f": over the budget of {LIMIT} (tests/subprocess_budget.py)"
    terminalreporter.section("subprocesses", sep="-")
    terminalreporter.write_line(f"{total} started by the tests{verdict}")
    for test, count in _started.most_common():
        terminalreporter.write_line(f"  {count:3d}  {test}")
    if _by_others:
        started = ", ".join(f"{name} {count}" for name, count in _by_others.most_common())
        terminalreporter.write_line(f"and, as the code under test or a library's own work (not counted): {started}")
