"""Request deadlines (L62): one timer task for all of an engine's requests.

The timer runs in the event loop, in the engine's task group, and keeps a heap of
``(deadline, sequence, record)``: it sleeps until the earliest deadline (or until
an earlier one is added), then hands every record whose deadline has passed to
``expire``, which aborts it through the engine's one abort path. Records are keyed
by identity, never by request id (L3): a record that ended is forgotten (``ended``)
and never expired, even if a new request reuses its id. The task holds nothing the
engine waits for, so cancelling it is all shutdown needs.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from typing import Generic, TypeVar

import anyio
import anyio.abc

__all__ = ["DeadlineTimer"]

R = TypeVar("R")

#: Below this many ended entries the heap is never rebuilt (as in ``_queue``).
_MIN_REBUILD = 64


class DeadlineTimer(Generic[R]):
    """Expire records at their absolute deadlines on the loop's clock.

    Create it, call ``add`` and ``ended``, and run ``run``, all in the loop's thread.
    """

    __slots__ = ("_closed", "_expire", "_heap", "_pending", "_sequence", "_wake")

    def __init__(self, expire: Callable[[R], None]) -> None:
        self._expire = expire
        self._heap: list[tuple[float, int, R]] = []
        # The records whose deadline is still to come: the heap may also hold
        # entries of records that ended, skipped when they reach the top.
        self._pending: set[R] = set()
        self._sequence = 0
        self._wake = anyio.Event()
        self._closed = False

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, record: R, deadline: float) -> None:
        """Expire ``record`` at ``deadline`` (``anyio.current_time()`` scale)."""
        earliest = self._heap[0][0] if self._heap else math.inf
        heapq.heappush(self._heap, (deadline, self._sequence, record))
        self._sequence += 1
        self._pending.add(record)
        if deadline < earliest:
            self._wake.set()

    def ended(self, record: R) -> None:
        """Forget ``record``: it ended, its deadline must not fire (O(1) amortised)."""
        self._pending.discard(record)
        stale = len(self._heap) - len(self._pending)
        if stale > _MIN_REBUILD and stale > len(self._pending):
            self._heap = [entry for entry in self._heap if entry[2] in self._pending]
            heapq.heapify(self._heap)

    def close(self) -> None:
        """Make ``run`` return at once; no deadline fires afterwards.

        A return, not a cancellation: on asyncio a cancelled task's
        ``CancelledError`` outlived the engine (kept by the task at C level).
        """
        self._closed = True
        self._wake.set()

    def _fire(self, now: float) -> None:
        # ``self._heap`` each time: ``expire`` ends records, which may rebuild it.
        while self._heap and (self._heap[0][2] not in self._pending or self._heap[0][0] <= now):
            _, _, record = heapq.heappop(self._heap)
            if record in self._pending:
                self._pending.discard(record)
                self._expire(record)

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Expire records as their deadlines pass, until ``close``.

        Cancellation:
            Ends at once too; it holds nothing.
        """
        task_status.started()
        while not self._closed:
            self._fire(anyio.current_time())
            wake = self._wake = anyio.Event()
            if self._closed:
                return
            earliest = self._heap[0][0] if self._heap else math.inf
            with anyio.CancelScope(deadline=earliest):
                await wake.wait()
