"""A worker's suspended requests (L61): their queue, what each parks, and their way out.

Preemption suspends a running request into its worker's own queue (its state is on
that worker's device), at the rank it had; the worker takes it again from there
when the boundary policy says so, and the event loop may withdraw it (abort,
deadline, shutdown) at any moment, which hands it to the materializer to be
released. A worker that dies leaves its suspended requests to its exiting thread,
which discards their states.

Everything here runs under the pool's lock (``Pool.cond``), in the worker's thread
or the event loop's; it never calls the runner.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ._queue import WaitingQueue
from ._workitem import WorkItem

if TYPE_CHECKING:
    from ._materialize import Materializer

__all__ = ["Parking"]


class Parking:
    """One worker's suspended requests and the bytes they park, under the pool's lock.

    Args:
        queue: the worker's own waiting queue, ranked as the pool's.
        materializer: the worker's, which releases what the loop withdraws.
    """

    def __init__(self, queue: WaitingQueue[WorkItem], materializer: Materializer) -> None:
        self.queue = queue
        self._materializer = materializer
        self._sizes: dict[WorkItem, int] = {}
        #: Bytes of suspended state held now, and suspensions made in all (statistics).
        self.bytes = 0
        self.preemptions = 0
        # Suspended requests the engine ended because the worker died (L43); the
        # exiting thread discards their state.
        self._orphans: list[WorkItem] = []
        # The worker's thread has exited and discarded them: nothing parks any more.
        self._closed = False

    def park(self, item: WorkItem, size: int) -> None:
        """Put a suspended ``item`` in the queue, at its rank, parking ``size`` bytes."""
        self.queue.push(
            item,
            item.batch_key,
            priority=item.request.priority,
            deadline=item.rank_deadline,
            steps=item.steps_total - item.steps_done,
            sequence=item.sequence,
            tenant=item.request.tenant,
        )
        self._sizes[item] = size
        self.bytes += size
        self.preemptions += 1
        item.preemptions += 1
        item.t_suspended = now = time.perf_counter()
        item.end_run(now)
        item.taken = False

    def hold(self, item: WorkItem) -> None:
        """Mark ``item`` as held by the worker's threads, out of every queue (it may have
        been parked here)."""
        item.taken = True
        if item in self._sizes:
            self._forget(item)

    def let_go(self, item: WorkItem) -> bool:
        """Withdraw ``item`` if it is suspended here: its release follows."""
        if not self.queue.remove(item):
            return False
        self._hand_over(item)
        return True

    def let_go_all(self) -> list[WorkItem]:
        """Withdraw every suspended item here: their releases follow."""
        items = self.queue.drain()
        for item in items:
            self._hand_over(item)
        return items

    def orphan_all(self) -> None:
        """The worker died: take its suspended requests out, for its thread to discard."""
        for item in self.queue.drain():
            self._withdraw(item)
            self._orphans.append(item)

    def close(self) -> list[WorkItem]:
        """The worker's thread exits: everything still parked or orphaned, for it to
        discard; from now on nothing is handed to the materializer."""
        self._closed = True
        left = self.queue.drain()
        for item in left:
            self._withdraw(item)
        left += self._orphans
        self._orphans.clear()
        return left

    def _hand_over(self, item: WorkItem) -> None:
        # Never once closed: the exiting thread took every parked item out first.
        assert not self._closed
        self._withdraw(item)
        self._materializer.release(item)

    def _withdraw(self, item: WorkItem) -> None:
        """Take a suspended ``item`` out for good: from now on the worker's threads hold it
        until they release it, so it reads RUNNING, as ``statistics()`` counts it (in no
        queue, so not waiting), never WAITING in no queue."""
        self._forget(item)
        item.taken = True

    def _forget(self, item: WorkItem) -> None:
        """Forget ``item``'s parked bytes (it left the queue)."""
        self.bytes -= self._sizes.pop(item)
