"""Output folders shared by several runs: an exclusive claim on a folder (:func:`claimed`) and
interrupts held back while a set of outputs is moved into place (:func:`deferred_interrupts`)."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: no advisory locks; the claim is then the existence check alone
    fcntl = None  # type: ignore[assignment]

from surgery.core.errors import OutputBusyError
from surgery.core.interrupts import restore_handlers

LOCK = ".surgery.lock"


@contextmanager
def claimed(folder: str | Path) -> Iterator[Path]:
    """Hold an exclusive claim on ``folder`` for the block (an ``flock`` on a hidden lock file,
    removed on exit, with the folder if the claim had to create it and it is still empty).

    Raises:
        OutputBusyError: another run (process or thread) holds the folder now.

    Example:
        >>> with claimed(out_dir):
        ...     refuse_existing([out_dir / "report.json"], overwrite=False)
        ...     ...  # write and publish
    """
    folder = Path(folder)
    created = not folder.exists()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK
    descriptor = _lock(path, folder) if fcntl is not None else None
    try:
        yield folder
    finally:
        if descriptor is not None:
            path.unlink(missing_ok=True)  # before the unlock: a waiting claim then sees a new file
            os.close(descriptor)
        if created and folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()


def _lock(path: Path, folder: Path) -> int:
    while True:
        descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(descriptor)
            raise OutputBusyError(str(folder)) from None
        try:
            current = os.stat(path).st_ino == os.fstat(descriptor).st_ino
        except FileNotFoundError:
            current = False
        if current:
            return descriptor
        os.close(descriptor)  # the holder removed this file as we opened it: claim the new one


@contextmanager
def deferred_interrupts() -> Iterator[None]:
    """SIGINT and SIGTERM received in the block take effect when it ends (main thread only):
    what the block moves into place is then either all done or all undone, never cut."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[tuple[int, object]] = []
    previous = {number: signal.getsignal(number) for number in (signal.SIGINT, signal.SIGTERM)}
    for number in previous:
        signal.signal(number, lambda signum, frame: received.append((signum, frame)))
    try:
        yield
    finally:
        restore_handlers(previous)  # all of them, though a signal arriving meanwhile raises in between
        if received:
            number, frame = received[0]
            handler = previous[number]
            if callable(handler):
                handler(number, frame)
            elif handler == signal.SIG_DFL and number == signal.SIGINT:
                raise KeyboardInterrupt
            elif handler == signal.SIG_DFL:
                os.kill(os.getpid(), number)
