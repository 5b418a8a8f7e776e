"""The workers' shared side: one lock, one queue of new requests, the idle count.

Every worker (one per device, see ``_worker``) takes its requests from the one
``fresh`` queue; a request it suspended (L61) waits in that worker's own queue of
parked requests, because its state lives on that worker's device: a request lives
its whole life on one worker (L42). One ``threading.Condition`` guards both kinds
of queue, the idle count and the stop flag; it is held for microseconds, never
across a runner call. The event loop admits, withdraws and counts here.

Placement (L42): a request starts on the worker that can start it first. An idle
worker waits on the condition and is woken by an admission; while any worker is
idle, a busy one takes nothing new into its batch (the idle one starts it alone,
on its own device) and preempts nothing for a new request; and an idle worker
that wakes to several waiting requests takes its share of them (the waiting ones
divided among the idle workers), not a whole batch that leaves the others idle.

Fair share (L57): the queues share one ``FairShare`` (the tenants' tags), and
``costs`` holds what the workers measured a step to cost per batch key, which
prices each request at admission: its steps times its step's estimated seconds.

Holds (L102, L103): while the engine updates its weights or sleeps, ``hold`` says what
the workers may take (``queues_for``): no new request (the running and suspended ones
finish), or nothing, or nothing and the running ones suspended. ``weights`` is the
version a request taken now runs on.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from ._fairshare import FairShare, StepCosts
from ._queue import WaitingQueue
from ._weights import WeightVersion

if TYPE_CHECKING:
    from ._scheduler import RunningBatch
    from ._worker import Worker
    from ._workitem import WorkItem

__all__ = ["Hold", "Pool", "Withdrawal"]


class Hold(enum.Enum):
    """What the workers may take while the weights change or sleep (L102, L103)."""

    #: No new request: the running and suspended ones run to their ends.
    FRESH = "fresh"
    #: Nothing: no request is taken, none resumed.
    ALL = "all"
    #: Nothing, and each worker suspends its running requests at their next boundary
    #: (L61) and says so (``Held``).
    SUSPEND = "suspend"


class Withdrawal(enum.Enum):
    """What ``Pool.withdraw`` did with an item."""

    #: It was not waiting: a worker holds it and drops it at its next boundary.
    HELD = "held"
    #: Taken out of a queue; it holds nothing: the caller ends it now.
    WITHDRAWN = "withdrawn"
    #: Taken out of its worker's queue of suspended requests: that worker's
    #: materializer releases it, and its ``Released`` message follows.
    RELEASING = "releasing"


class Pool:
    """The shared lock, the queue of new requests and the workers that take from it."""

    def __init__(self, *, weights: Mapping[str, float] | None = None) -> None:
        self.cond = threading.Condition()
        # The tenants' tags, shared by the queue of new requests and every
        # worker's queue of suspended ones (``new_queue``).
        self.share = FairShare(weights)
        self.costs = StepCosts()
        self.fresh: WaitingQueue[WorkItem] = self.new_queue()
        self.workers: list[Worker] = []
        # Workers waiting for work in ``cond.wait`` (woken or not yet running).
        self.idle = 0
        self.stopping = False
        # L102, L103: what the workers may take now (``None``: anything), the hold's
        # round (each ``set_hold`` starts one), and the weights a request taken runs on.
        self.hold: Hold | None = None
        self.hold_round = 0
        self.weights = WeightVersion(number=0)
        self._nothing: WaitingQueue[WorkItem] = self.new_queue()  # always empty

    def new_queue(self) -> WaitingQueue[WorkItem]:
        """A queue that ranks with this pool's fair share (a worker's parked one)."""
        return WaitingQueue(self.share)

    def enqueue(
        self,
        item: WorkItem,
        *,
        limit: int | None,
        tenant_limit: int | None,
        deadline: float,
        queue: bool = True,
    ) -> str | None:
        """Queue ``item`` unless a limit is reached; return ``None``, or why not.

        ``limit`` (``None``: none) bounds the items waiting, ``tenant_limit`` those
        of its tenant; ``deadline`` is its absolute deadline, for ranking
        (``math.inf``: none). Its cost for fair share is its steps times the
        step's estimated seconds (``StepCosts``), fixed now. With ``queue`` false,
        only the limits are checked (a result-cache hit, L96: refused where a miss
        would be, though it never waits).
        """
        tenant = item.request.tenant
        with self.cond:
            if limit is not None and self._waiting() >= limit:
                return f"{limit} requests are waiting already"
            if tenant_limit is not None and self.share.waiting(tenant) >= tenant_limit:
                return f"{tenant_limit} requests of tenant {tenant!r} are waiting already"
            if not queue:
                return None
            item.rank_deadline = deadline
            item.sequence = self.fresh.push(
                item,
                item.batch_key,
                priority=item.request.priority,
                deadline=deadline,
                steps=item.steps_total,
                tenant=tenant,
                cost=item.steps_total * self.costs.step_s(item.batch_key, item.step_pixels),
            )
            self.cond.notify()
        return None

    def _waiting(self) -> int:
        return len(self.fresh) + sum(len(worker.parked) for worker in self.workers)

    def counts(self) -> tuple[int, int]:
        """How many items wait (suspended ones included), and how many are suspended."""
        with self.cond:
            suspended = sum(len(worker.parked) for worker in self.workers)
            return len(self.fresh) + suspended, suspended

    def admission_view(
        self, priority: int, deadline: float, workers: Sequence[Worker]
    ) -> tuple[int, list[RunningBatch]]:
        """What admission's estimate reads, at one moment (L62): the steps ranked ahead
        of a newcomer on every queue, and the batches ``workers`` last published.

        The newcomer has ``priority`` and the absolute ``deadline`` (see
        ``WaitingQueue.steps_ahead``); the queues are the new requests and every
        worker's suspended ones. Under the lock, where the workers publish the batch
        whenever a request moves between a queue and a batch.
        """
        with self.cond:
            steps = self.fresh.steps_ahead(priority, deadline)
            for worker in self.workers:
                steps += worker.parked.steps_ahead(priority, deadline)
            return steps, [worker.batch for worker in workers]

    def withdraw(self, item: WorkItem) -> Withdrawal:
        """Remove ``item`` if it still waits; say what became of it.

        Exact, under the lock: an item is in a queue, or a worker holds it.
        """
        with self.cond:
            if self.fresh.remove(item):
                return Withdrawal.WITHDRAWN
            worker = item.worker
            if worker is not None and self.workers[worker].let_go(item):
                return Withdrawal.RELEASING
            return Withdrawal.HELD

    def withdraw_all(self) -> tuple[list[WorkItem], list[WorkItem]]:
        """Remove every waiting item: those holding nothing, and those being released."""
        with self.cond:
            fresh = self.fresh.drain()
            releasing = [item for worker in self.workers for item in worker.let_go_all()]
            return fresh, releasing

    def set_hold(self, hold: Hold | None, weights: WeightVersion | None = None) -> int:
        """Hold the workers as ``hold`` says (``None``: serve), and name the weights a
        request taken from now on runs on; return the hold's round. Wakes every worker."""
        with self.cond:
            self.hold = hold
            self.hold_round += 1
            if weights is not None:
                self.weights = weights
            self.cond.notify_all()
            return self.hold_round

    def queues_for(self, parked: WaitingQueue[WorkItem]) -> tuple[WaitingQueue[WorkItem], ...]:
        """The new requests' queue and a worker's ``parked`` one, as the hold lets it take
        from them (an empty queue for one it may not); both once the pool stops. Under
        the lock."""
        hold = None if self.stopping else self.hold
        if hold is None:
            return self.fresh, parked
        if hold is Hold.FRESH:
            return self._nothing, parked
        return self._nothing, self._nothing

    def stop(self) -> None:
        """Make every worker drop its members at its next boundary and exit."""
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
