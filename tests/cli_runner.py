"""``python -m surgery ARGS`` run in the test's own process.

:func:`run_cli` calls the app's own entry (:func:`surgery.cli.app.main`, the function behind
``python -m surgery`` and the ``surgery`` script) with ``sys.argv`` set as the interpreter sets it,
so Hydra parses and composes exactly as it does for a user; it returns what a subprocess would:
the exit code, stdout and stderr apart. What a process's end would have thrown away is put back
afterwards: environment, working folder, ``sys.path`` and the modules imported from the extra
paths, logging (Hydra configures the root logger), warning filters, signal handlers, torch's
random state, thread count and grad mode, Hydra's singletons, and every table surgery keeps at
module level (registries a plugin filled, the sweep record). Warnings print to stderr as a fresh
interpreter prints them, not into pytest's record, so a test of "one line on stderr" sees them.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import io
import logging
import os
import shutil
import signal
import sys
import tempfile
import traceback
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
MAIN = REPO / "surgery" / "__main__.py"  # sys.argv[0] under ``python -m surgery``


@dataclass
class CliResult:
    """What ``subprocess.run(..., capture_output=True, text=True)`` returns, for one in-process run."""

    args: list[str]
    returncode: int
    stdout: str
    stderr: str


def run_cli(
    *args: str, cwd: Path | None = None, pythonpath: Sequence[Path] | Path = (), env: dict[str, str] | None = None
) -> CliResult:
    """Run ``python -m surgery *args`` in this process from ``cwd`` (unless given, a temporary
    folder of this process's own, so nothing relative lands in the checkout), with ``pythonpath``
    importable first and ``env`` set on top of this process's environment."""
    paths = [pythonpath] if isinstance(pythonpath, Path) else list(pythonpath)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.ExitStack() as stack:
        stack.enter_context(_process_state(cwd or _own_folder(), [str(p) for p in paths], env or {}))
        stack.enter_context(contextlib.redirect_stdout(out))
        stack.enter_context(contextlib.redirect_stderr(err))
        stack.enter_context(_log_streams_followed())
        stack.enter_context(_fresh_interpreter_warnings())
        code = _main(list(args))
    return CliResult([sys.executable, "-m", "surgery", *args], code, out.getvalue(), err.getvalue())


@functools.cache
def _own_folder() -> Path:
    """One folder for the process's runs: it outlives each run, as the processes a launcher
    starts there (joblib keeps its workers) need their working folder to."""
    folder = Path(tempfile.mkdtemp(prefix="surgery-cli-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


def app_main(arguments: Sequence[str]) -> None:
    """``python -m surgery ARGUMENTS`` in this process as it stands, ending in SystemExit: for a
    forked copy (support.under_terminal), whose end puts everything back."""
    from surgery.cli.app import main

    sys.argv = [str(MAIN), *arguments]
    main()


def _main(arguments: list[str]) -> int:
    """The exit code ``python -m surgery`` would end with; an uncaught exception prints its
    traceback to stderr and gives 1, as the interpreter does."""
    try:
        app_main(arguments)
    except SystemExit as end:
        if end.code is None or isinstance(end.code, int):
            return end.code or 0
        print(end.code, file=sys.stderr)
        return 1
    except BaseException:  # noqa: BLE001 - the interpreter's answer to anything uncaught
        traceback.print_exc()
        return 1
    return 0


@contextlib.contextmanager
def _fresh_interpreter_warnings() -> Iterator[None]:
    """Python's default warning filters and printer, as in a new ``python`` process."""
    with warnings.catch_warnings():
        warnings.resetwarnings()
        for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
            warnings.simplefilter("ignore", category)
        warnings.filterwarnings("default", category=DeprecationWarning, module="__main__")
        warnings.showwarning = warnings._showwarning_orig  # type: ignore[attr-defined]
        yield


@contextlib.contextmanager
def _process_state(cwd: Path, paths: list[str], env: dict[str, str]) -> Iterator[None]:
    environ, argv, sys_path, modules = dict(os.environ), sys.argv, list(sys.path), set(sys.modules)
    here = os.getcwd()
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    threads, grad = torch.get_num_threads(), torch.is_grad_enabled()
    import surgery.cli.app  # noqa: F401 - the app's modules, so that their tables are in the snapshot

    tables = _module_tables()
    logs = _logging_state()
    os.environ.update(env)
    sys.path[:0] = paths
    os.chdir(cwd)
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        os.chdir(here)
        os.environ.clear()
        os.environ.update(environ)
        sys.argv, sys.path[:] = argv, sys_path
        for name in set(sys.modules) - modules:
            if paths and any(str(getattr(sys.modules[name], "__file__", "") or "").startswith(p) for p in paths):
                del sys.modules[name]
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        torch.set_num_threads(threads)
        torch.set_grad_enabled(grad)
        _restore_logging(logs)
        _restore_tables(tables)
        _reset_hydra()
        _close_figures()
        _end_launcher_workers()


class _Live(io.TextIOBase):
    """A stream that writes to whatever ``sys.<name>`` is when it writes: a logging handler made
    before or during one run then prints into each later run's stderr, as it would in a process."""

    def __init__(self, name: str) -> None:
        self.name = name

    def write(self, text: str) -> int:
        return getattr(sys, self.name).write(text)

    def flush(self) -> None:
        getattr(sys, self.name).flush()


_STDOUT, _STDERR = _Live("stdout"), _Live("stderr")


@contextlib.contextmanager
def _log_streams_followed() -> Iterator[None]:
    """Console log handlers (a library's own, made at its import) write into this run's streams;
    those the run makes follow the streams afterwards too."""

    def consoles() -> list[logging.StreamHandler]:
        loggers = [logging.root, *logging.Logger.manager.loggerDict.values()]
        return [
            h
            for lg in loggers
            for h in getattr(lg, "handlers", [])
            if type(h) is logging.StreamHandler and h.stream not in (_STDOUT, _STDERR)
        ]

    before = {h: h.stream for h in consoles()}
    for handler, stream in before.items():
        _point(handler, _STDOUT if stream in (sys.__stdout__, sys.stdout) else _STDERR)
    try:
        yield
    finally:
        for handler in consoles():  # made during the run, on this run's buffers
            _point(handler, _STDOUT if handler.stream is sys.stdout else _STDERR)
        for handler, stream in before.items():
            _point(handler, stream)


def _point(handler: logging.StreamHandler, stream: object) -> None:
    """``handler.setStream`` without its flush of the stream it leaves, which may be closed (a
    stream of a test that has ended)."""
    with handler.lock:
        handler.stream = stream


def _module_tables() -> dict[tuple[str, str], tuple[object, object]]:
    """Every registry, dict, list and set surgery holds at module level, with a copy of its contents."""
    from surgery.core.registry import Registry

    tables = {}
    for module_name, module in list(sys.modules.items()):
        if not module_name.startswith("surgery") or module is None:
            continue
        for name, value in list(vars(module).items()):
            if isinstance(value, Registry):
                tables[module_name, name] = (value, dict(value._entries))
            elif type(value) in (dict, list, set):
                tables[module_name, name] = (value, value.copy())
    return tables


def _restore_tables(tables: dict[tuple[str, str], tuple[object, object]]) -> None:
    from surgery.core.registry import Registry

    for value, saved in tables.values():
        live = value._entries if isinstance(value, Registry) else value
        if live != saved:
            live.clear()
            live.update(saved) if isinstance(live, (dict, set)) else live.extend(saved)


def _logging_state() -> dict[str, tuple]:
    loggers = [
        logging.root,
        *(lg for lg in logging.Logger.manager.loggerDict.values() if isinstance(lg, logging.Logger)),
    ]
    return {lg.name: (lg, lg.level, list(lg.handlers), lg.propagate, lg.disabled) for lg in loggers}


def _restore_logging(saved: dict[str, tuple]) -> None:
    """Hydra's dictConfig replaces handlers (its job log is a file in the run folder): close what
    the run added and put every logger back as it was."""
    now = [logging.root, *(lg for lg in logging.Logger.manager.loggerDict.values() if isinstance(lg, logging.Logger))]
    for logger in now:
        before = saved.get(logger.name)
        kept = before[2] if before else []
        for handler in logger.handlers:
            if handler not in kept:
                handler.close()
        if before is None:
            logger.handlers.clear()
            continue
        _, level, handlers, propagate, disabled = before
        logger.setLevel(level)
        logger.handlers[:] = handlers
        logger.propagate, logger.disabled = propagate, disabled


def _reset_hydra() -> None:
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig

    GlobalHydra.instance().clear()
    HydraConfig.instance().cfg = None


def _end_launcher_workers() -> None:
    """The workers joblib's launcher keeps for the next sweep end with the run, as with its process."""
    loky = sys.modules.get("joblib.externals.loky.reusable_executor")
    executor = getattr(loky, "_executor", None) if loky else None
    if executor is not None:
        executor.shutdown(wait=True, kill_workers=True)


def _close_figures() -> None:
    if "matplotlib.pyplot" in sys.modules:
        sys.modules["matplotlib.pyplot"].close("all")
