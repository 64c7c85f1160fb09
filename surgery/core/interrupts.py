"""Interrupts taken at safe points.

Python runs a signal handler between two bytecodes of whatever code is running, a library's
``__del__`` included; an exception raised there is printed as "Exception ignored" and lost, and
the run goes on to publish and exit 0. Inside :func:`taken_at_safe_points` (the command line's
run), SIGINT and SIGTERM only set a flag; :func:`raise_pending` raises the interrupt at safe
points: between steps and blocks, at each progress-bar item or update, and before and after the
outputs are published. A second signal of the same kind before a safe point is reached raises
at once (the user insists).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

NUMBERS = (signal.SIGINT, signal.SIGTERM)
_pending: list[int] = []  # signals received, not yet raised


class Terminated(KeyboardInterrupt):
    """SIGTERM (``timeout``, Slurm, ``kill``): unwinds like Ctrl-C, so nothing is left half-written."""


def interrupt_for(number: int) -> KeyboardInterrupt:
    """The exception a signal unwinds with: :class:`Terminated` for SIGTERM, else ``KeyboardInterrupt``."""
    return Terminated() if number == signal.SIGTERM else KeyboardInterrupt()


def _flag(number: int, frame: object) -> None:
    """The handler: note the signal; raise only if it is the second of its kind."""
    if number in _pending:
        raise interrupt_for(number)
    _pending.append(number)


def _on_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextmanager
def taken_at_safe_points() -> Iterator[None]:
    """Within the block (main thread only), SIGINT and SIGTERM are flagged and raised by
    :func:`raise_pending` (module docstring); the earlier handlers come back after it."""
    if not _on_main_thread():
        yield
        return
    previous = {number: signal.getsignal(number) for number in NUMBERS}
    for number in NUMBERS:
        signal.signal(number, _flag)
    try:
        yield
    finally:
        _pending.clear()
        restore_handlers(previous)


def raise_pending() -> None:
    """A safe point: raise the interrupt flagged since the last one, if any (main thread only)."""
    if _pending and _on_main_thread():
        number = _pending[0]
        _pending.clear()
        raise interrupt_for(number)


def restore_handlers(previous: dict[int, object]) -> None:
    """Put every handler of ``previous`` back, even when a signal that arrived meanwhile makes
    one of the calls raise (``signal.signal`` runs pending handlers first): the first such
    exception is raised once all are back."""
    raised: BaseException | None = None
    for number, handler in previous.items():
        while True:
            try:
                signal.signal(number, handler)  # type: ignore[arg-type]
                break
            except BaseException as err:  # noqa: BLE001 - a pending handler raised; retried, then re-raised
                raised = raised or err
    if raised is not None:
        raise raised
