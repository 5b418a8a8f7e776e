"""A per-request memory channel whose buffer coalesces: the newest items win.

Step events are progress, not data: a consumer that lags should see the latest
ones, and the worker must never wait for it. So the buffer is bounded and
``send_nowait`` never blocks or fails for a full buffer; it drops the oldest item.

Closing the receiving side clears the buffer at once, on every backend (anyio's
own memory streams keep their buffer until both ends are garbage), and makes the
next ``send_nowait`` raise ``anyio.BrokenResourceError``.
"""

from __future__ import annotations

from collections import deque
from typing import Generic, TypeVar

import anyio
import anyio.lowlevel

__all__ = ["CoalescingChannel"]

T = TypeVar("T")


class CoalescingChannel(Generic[T]):
    """A single-producer channel that keeps at most ``max_buffer`` items, newest last."""

    __slots__ = ("_buffer", "_receive_closed", "_send_closed", "_waiter", "dropped")

    def __init__(self, max_buffer: int) -> None:
        if max_buffer < 1:
            raise ValueError("max_buffer: must be >= 1")
        self._buffer: deque[T] = deque(maxlen=max_buffer)
        self._send_closed = False
        self._receive_closed = False
        self._waiter: anyio.Event | None = None
        #: Items dropped, unread, to make room for newer ones.
        self.dropped = 0

    @property
    def buffered(self) -> int:
        """How many items wait to be received."""
        return len(self._buffer)

    @property
    def is_receive_closed(self) -> bool:
        """Whether the receiving side was closed."""
        return self._receive_closed

    def send_nowait(self, item: T) -> None:
        """Buffer ``item``, dropping the oldest item if the buffer is full.

        Raises:
            anyio.BrokenResourceError: the receiving side is closed.
            anyio.ClosedResourceError: the sending side is closed.
        """
        if self._receive_closed:
            raise anyio.BrokenResourceError
        if self._send_closed:
            raise anyio.ClosedResourceError
        if len(self._buffer) == self._buffer.maxlen:
            self.dropped += 1
        self._buffer.append(item)
        self._wake()

    def close_send(self) -> None:
        """End the stream: the receiver gets what is buffered, then ``EndOfStream``."""
        self._send_closed = True
        self._wake()

    def close_receive(self) -> None:
        """Close the receiving side and drop everything buffered, at once."""
        self._receive_closed = True
        self._buffer.clear()
        self._wake()

    async def receive(self) -> T:
        """Return the oldest buffered item, waiting for one if needed.

        Raises:
            anyio.EndOfStream: the sender closed and the buffer is empty.
            anyio.ClosedResourceError: the receiving side is closed.

        Cancellation:
            Safe: an item is removed from the buffer only when it is returned.
        """
        await anyio.lowlevel.checkpoint()
        while True:
            if self._receive_closed:
                raise anyio.ClosedResourceError
            if self._buffer:
                return self._buffer.popleft()
            if self._send_closed:
                raise anyio.EndOfStream
            if self._waiter is None:
                self._waiter = anyio.Event()
            await self._waiter.wait()

    def _wake(self) -> None:
        if self._waiter is not None:
            self._waiter.set()
            self._waiter = None
