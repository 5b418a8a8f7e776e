"""Cancel points (L71, L72): where a runner's step or decode may be left mid-way.

A runner that declares ``cancel_points`` calls ``cancel_point()`` at every point
inside its ``step`` (between transformer blocks) and ``decode`` (between chunks)
where the call may be left. The engine arms the calling thread, for the duration
of that one call only, with a check of its own (``armed``): the check raises
``StopRun`` when the work is no longer wanted, and the runner lets it through.
Anywhere else (another thread, a direct call outside an engine, a runner that does
not declare the flag) ``cancel_point()`` only reads a thread-local and returns.

A thread-local rather than an argument: a runner's subclass that overrides
``step(states)`` and calls ``super().step(states)`` keeps its cancel points.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from ._runner import StopRun

__all__ = ["Leave", "active_checks", "armed", "cancel_point", "current_check"]

_local = threading.local()
_lock = threading.Lock()
_active = 0


def cancel_point() -> None:
    """Let the engine leave the current runner call here, if it wants to (L71, L72).

    Raises:
        StopRun: the engine wants the call left; let it through, with the model
            as clean as a fresh one.
    """
    check: Callable[[], None] | None = getattr(_local, "check", None)
    if check is not None:
        check()


class Leave:
    """An engine's check for ``armed``: ``StopRun`` once ``stop()`` is true, noted.

    ``left`` tells the engine's ``StopRun`` (the call is no longer wanted) from one
    the runner raised on its own (a failure, as any other exception).
    """

    __slots__ = ("_stop", "left")

    def __init__(self, stop: Callable[[], bool]) -> None:
        self._stop = stop
        self.left = False

    def __call__(self) -> None:
        if self._stop():
            self.left = True
            raise StopRun


@contextmanager
def armed(check: Callable[[], None]) -> Iterator[None]:
    """Make ``check`` what ``cancel_point()`` calls in this thread, inside the block only."""
    global _active
    previous = getattr(_local, "check", None)
    _local.check = check
    with _lock:
        _active += 1
    try:
        yield
    finally:
        _local.check = previous
        with _lock:
            _active -= 1


def current_check() -> Callable[[], None] | None:
    """The check ``cancel_point()`` calls in this thread now, if any.

    For a runner that must agree on leaving with other processes before it
    leaves (``omni_trio.parallel``): it arms its own check around the call, which
    consults this one.
    """
    check: Callable[[], None] | None = getattr(_local, "check", None)
    return check


def active_checks() -> int:
    """How many ``armed`` blocks are open now, in every thread (0 when none runs)."""
    with _lock:
        return _active
