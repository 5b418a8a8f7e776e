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

__all__ = ["LoopInbox"]

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
        """Queue ``message`` for the loop; never blocks. Callable from any thread."""
        self._messages.append(message)
        # The deque holds the only reference now: once the loop has dispatched
        # the message, nothing in this thread keeps its payload alive.
        del message
        # A drain that is pending but has not cleared the flag yet will see this
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
