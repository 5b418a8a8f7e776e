"""Hand messages from engine threads to the event loop without ever blocking them.

A thread appends to a deque and, if no drain is pending, schedules one on the loop
(trio's ``TrioToken.run_sync_soon`` or asyncio's ``call_soon_threadsafe``): about
10 µs, fire and forget. The loop drains everything queued in one callback, so a
burst of step events costs one wake-up.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

import sniffio

__all__ = ["QUIET_LIMIT", "LoopInbox"]

#: Most messages left waiting without a wake-up (bounds the inbox for a long
#: request nobody reads). Picked without measurement: any value from tens to
#: thousands gave the same per-step cost in a quick look.
QUIET_LIMIT = 64

M = TypeVar("M")


def _current_call_soon() -> Callable[[Callable[[], object]], object]:
    library = sniffio.current_async_library()
    if library == "trio":
        import trio

        return trio.lowlevel.current_trio_token().run_sync_soon
    if library == "asyncio":
        import asyncio

        return asyncio.get_running_loop().call_soon_threadsafe
    raise RuntimeError(f"omni_trio supports trio and asyncio, not {library}")


class LoopInbox(Generic[M]):
    """Deliver messages posted from any thread to ``dispatch`` on the current loop.

    Must be created in the loop's thread, inside the loop. ``dispatch`` runs in the
    loop's thread, once per message, in posting order; it must not raise.
    """

    __slots__ = ("_call_soon", "_dispatch", "_messages", "_scheduled")

    def __init__(self, dispatch: Callable[[M], None]) -> None:
        self._dispatch = dispatch
        self._call_soon = _current_call_soon()
        self._messages: deque[M] = deque()
        self._scheduled = False

    def post(self, message: M) -> None:
        """Queue ``message`` for the loop and wake it; never blocks. Any thread."""
        self._messages.append(message)
        # The deque holds the only reference now: once the loop has dispatched
        # the message, nothing in this thread keeps its payload alive.
        del message
        self._wake()

    def post_quietly(self, message: M) -> None:
        """Queue ``message`` without waking the loop; never blocks. Any thread.

        It is delivered, in order, with the next message that wakes the loop, or
        once ``QUIET_LIMIT`` messages wait. For news nobody is waiting for (step
        events of a request whose consumer does not read them): waking the loop
        and handing it the GIL is most of the engine's cost per step.
        """
        self._messages.append(message)
        del message
        if len(self._messages) >= QUIET_LIMIT:
            self._wake()

    def _wake(self) -> None:
        # A drain that is pending but has not cleared the flag yet will see the
        # message; two threads may both schedule one, which is harmless.
        if not self._scheduled:
            self._scheduled = True
            try:
                self._call_soon(self._drain)
            except RuntimeError:
                # The loop is gone (trio.RunFinishedError, or a closed asyncio
                # loop): nobody is left to read the message.
                self._messages.clear()

    def _drain(self) -> None:
        self._scheduled = False
        messages = self._messages
        while messages:
            self._dispatch(messages.popleft())
