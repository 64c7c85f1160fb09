"""Interrupts taken at safe points: a signal inside a library's ``__del__`` is not lost, a
progress bar is a safe point, a second signal raises at once, and handlers come back whole even
when a signal arrives while they are put back."""

from __future__ import annotations

import signal
from unittest import mock

import pytest

from surgery.core.folders import deferred_interrupts
from surgery.core.interrupts import Terminated, raise_pending, taken_at_safe_points
from surgery.core.progress import tqdm


class _SignalsWhenCollected:
    def __init__(self, number: int) -> None:
        self.number = number

    def __del__(self) -> None:
        signal.raise_signal(self.number)  # as Ctrl-C landing while a library's finalizer runs


@pytest.mark.parametrize("number, error", [(signal.SIGINT, KeyboardInterrupt), (signal.SIGTERM, Terminated)])
def test_a_signal_inside_a_finalizer_is_raised_at_the_next_safe_point(number, error):
    before = {n: signal.getsignal(n) for n in (signal.SIGINT, signal.SIGTERM)}
    ran_on = []
    with pytest.raises(error), taken_at_safe_points():
        _SignalsWhenCollected(number)  # collected at once: the handler runs inside __del__
        ran_on.append("after the finalizer")  # Python would print "Exception ignored" and go on
        raise_pending()
        ran_on.append("past the safe point")
    assert ran_on == ["after the finalizer"]
    assert {n: signal.getsignal(n) for n in before} == before
    raise_pending()  # nothing left flagged


def test_a_progress_bar_is_a_safe_point_and_a_second_signal_raises_at_once():
    seen = []
    with pytest.raises(KeyboardInterrupt), taken_at_safe_points():
        for item in tqdm(range(5), disable=True):
            seen.append(item)
            if item == 1:
                signal.raise_signal(signal.SIGINT)
    assert seen == [0, 1]
    with pytest.raises(KeyboardInterrupt), taken_at_safe_points():
        signal.raise_signal(signal.SIGINT)
        seen.append("flagged")
        signal.raise_signal(signal.SIGINT)  # the user insists
        seen.append("never")
    assert seen[-1] == "flagged"


def test_a_signal_arriving_while_handlers_are_put_back_leaves_none_behind(default_sigint):
    """Before: a signal run by a restored handler inside the next ``signal.signal`` call raised
    between the two, and SIGTERM kept the deferral's recording handler for good."""
    before = {n: signal.getsignal(n) for n in (signal.SIGINT, signal.SIGTERM)}
    real, calls = signal.signal, []

    def putting_back(number, handler):
        previous = real(number, handler)
        calls.append(number)
        if len(calls) == 3:  # the first one put back: Ctrl-C lands now
            signal.raise_signal(signal.SIGINT)
        return previous

    with mock.patch.object(signal, "signal", putting_back), pytest.raises(KeyboardInterrupt):
        with deferred_interrupts():
            pass
    assert {n: signal.getsignal(n) for n in before} == before
