"""The waiting queue: admitted requests, best-ranked first; pure, synchronous.

No I/O, no threads, no locks: the worker and the pool call these under the pool's
lock (see ``_pool``, ``_worker``).

Ranking (L60, L57): every waiting request has a rank, ``(-priority, tag,
deadline, admission sequence)``, compared as a tuple; the smallest is the
best-ranked. Higher priority goes first; within a priority level the tenant
whose fair-share tag is smallest (``_fairshare``: weighted fair queueing over
device step-seconds); within a tenant the earliest deadline (L62; ``+inf`` for a
request without one), then the earlier admission. With one tenant (the default)
the tag is the same for every request and the rank is ``(-priority, deadline,
sequence)``. The deadline is an absolute time on any one clock the caller picks
(the engine uses its event loop's): the queue only compares the numbers. A tag
moves when its tenant is served, so it is not stored with the request: the
queue keeps, per priority, one heap per tenant ordered by ``(deadline,
sequence)`` and a heap of the tenants' heads ordered by ``(tag, deadline,
sequence)``, refreshed lazily (a head whose tag moved, or that left, is
re-pushed when it reaches the top; tags only grow, so a stale head is never
found too late).

Batch formation: a request joins a running batch only when its batch key equals
the batch's key and it is the best-ranked waiting request, so a stream of
compatible newcomers never starves a better-ranked request with another key (the
batch drains, then that request starts the next one). An idle worker takes the
best-ranked request, then the next best-ranked ones while they have its key.
With all priorities equal and one tenant this is admission order (FIFO).

Complexity, with n requests waiting and t tenants: ``push`` is O(log n);
``remove`` is O(1) amortised plus the fair share's bookkeeping (the entry is
forgotten at once and skipped when it reaches the top of its heap; the heaps are
rebuilt, in O(n), only once they hold more withdrawn entries than waiting ones,
so they stay O(n) in size); ``take`` is O(log n) per entry it pops or
refreshes (each request taken, each withdrawn entry it skips, once, and the
tenant heads whose tag moved); ``drain`` is O(n log n) (it sorts); ``len`` and
membership are O(1) and exact.

Admission's estimate (L62) asks ``steps_ahead``: the steps of the items ranked
ahead of a newcomer. A running sum of steps is kept per priority, and per
priority the steps of the items with a deadline in a ``DeadlineSums`` (prefix
sums by deadline, ``_stepsums``): ``steps_ahead`` is O(k + log n), k the number of
distinct priorities waiting, never a scan of the queue. Keeping them adds
O(log n) to ``push``, to ``remove`` and to each item ``take`` pops, for items
with a deadline only. Across tenants it counts every tenant's items of an equal
priority with an earlier deadline: fair share may run another tenant's work
first, or this one's later, and the estimate does not model the interleaving.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Hashable, Sequence
from typing import Generic, TypeVar

from ._fairshare import FairShare, Tenant
from ._stepsums import DeadlineSums

__all__ = ["Rank", "WaitingQueue", "best_of", "take", "tenant_heads"]

T = TypeVar("T", bound=Hashable)

#: A rank as the queue compares them: ``(-priority, deadline, sequence)``.
Rank = tuple[int, float, int]

#: A rank with its fair-share tag: ``(-priority, tag, deadline, sequence)``.
_FairRank = tuple[int, float, float, int]

# A tenant's heap entry: (deadline, sequence, item, batch key, steps, priority,
# tenant, cost). The sequence is unique, so tuple comparison never reaches the
# item or the key (which need not be orderable).
_Entry = tuple[float, int, T, Hashable, int, int, Tenant, float]

# A level's heap of tenant heads: (tag, deadline, sequence, stamp, tenant). An
# entry is live when its stamp is its tenant's (older ones were superseded by a
# better head) and stale when its tag or its head moved since.
_Head = tuple[float, float, int, int, Tenant]

#: Below this many withdrawn entries the heaps are never rebuilt, so a short queue
#: with a few aborts does not rebuild at every one (picked without measurement).
_MIN_REBUILD = 64


class _Sub(Generic[T]):
    """One tenant's waiting items at one priority: a heap by (deadline, sequence)."""

    __slots__ = ("heap", "live", "stamp")

    def __init__(self) -> None:
        self.heap: list[_Entry[T]] = []
        self.live = 0
        self.stamp = 0


class _Level(Generic[T]):
    """One priority's tenants and the heap of their heads."""

    __slots__ = ("heads", "live", "subs")

    def __init__(self) -> None:
        self.subs: dict[Tenant, _Sub[T]] = {}
        self.heads: list[_Head] = []
        self.live = 0


class WaitingQueue(Generic[T]):
    """Admitted requests waiting for the worker, best-ranked first.

    Items are compared by identity (the admission), never by request id. Queues
    that are taken from together (``take``, ``best_of``) share one ``FairShare``.
    """

    __slots__ = (
        "_by_deadline",
        "_entries",
        "_heads",
        "_held",
        "_levels",
        "_order",
        "_sequence",
        "_share",
        "_stamp",
        "_steps",
    )

    def __init__(self, share: FairShare | None = None) -> None:
        # The fair share's tags, shared with the queues taken from together.
        self._share = FairShare() if share is None else share
        # The waiting items and their live entries: the exact count and O(1)
        # membership. The tenants' heaps may also hold entries of withdrawn items.
        self._entries: dict[T, _Entry[T]] = {}
        self._levels: dict[int, _Level[T]] = {}
        # The priorities waiting, as -priority (may repeat or name emptied ones).
        self._order: list[int] = []
        # Entries in the tenants' heaps, and heads in the levels' (compaction).
        self._held = 0
        self._heads = 0
        # Numbers the tenants' heads: a head is live while its sub carries its stamp.
        self._stamp = 0
        self._sequence = 0
        # The steps of the waiting items, summed per priority (for admission's
        # estimate, ``steps_ahead``); a priority whose sum reaches 0 is removed.
        self._steps: dict[int, int] = {}
        # Those with a deadline, per priority, by deadline: what a newcomer of
        # that priority waits behind (``steps_ahead``). An emptied one is removed.
        self._by_deadline: dict[int, DeadlineSums] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, item: object) -> bool:
        return item in self._entries

    def push(
        self,
        item: T,
        key: Hashable,
        *,
        priority: int = 0,
        deadline: float = math.inf,
        steps: int = 0,
        sequence: int | None = None,
        tenant: Tenant = None,
        cost: float = 0.0,
    ) -> int:
        """Admit ``item`` with its batch ``key``, ``priority`` (higher first) and ``deadline``.

        Args:
            item: what waits.
            key: its batch key.
            priority: higher ranks first.
            deadline: an absolute time; within a tenant of one priority the
                earliest ranks first (``math.inf``: none).
            steps: its step count, summed for ``steps_ahead``.
            sequence: the admission sequence a queue's ``push`` returned when
                ``item`` was first admitted, for an item that comes back (a
                suspended request, L61), possibly into another queue: it keeps its
                place among equals. ``None``: a new one, numbered by this queue.
            tenant: whose it is (``None``: the default tenant), for fair share.
            cost: what its tenant is charged when it is taken (device seconds;
                0 for one that comes back, charged already).

        Returns:
            The item's admission sequence.

        Raises:
            ValueError: ``item`` is already waiting (an item may wait only once).
        """
        if item in self._entries:
            raise ValueError("item is already waiting")
        if sequence is None:
            sequence = self._sequence
            self._sequence += 1
        # A returning item's old entry left its heap when it was taken, so its
        # sequence is unique among the heaps' entries again.
        entry: _Entry[T] = (deadline, sequence, item, key, steps, priority, tenant, cost)
        self._entries[item] = entry
        self._share.joined(priority, tenant)
        self._place(entry)
        if steps:
            self._steps[priority] = self._steps.get(priority, 0) + steps
            if deadline != math.inf:
                sums = self._by_deadline.get(priority)
                if sums is None:
                    sums = self._by_deadline[priority] = DeadlineSums()
                sums.add(deadline, sequence, steps)
        return sequence

    def _place(self, entry: _Entry[T]) -> None:
        """Put a live ``entry`` in its tenant's heap, and its head in its level's."""
        priority, tenant = entry[5], entry[6]
        level = self._levels.get(priority)
        if level is None:
            level = self._levels[priority] = _Level()
            heapq.heappush(self._order, -priority)
        sub = level.subs.get(tenant)
        if sub is None:
            sub = level.subs[tenant] = _Sub()
        heapq.heappush(sub.heap, entry)
        sub.live += 1
        level.live += 1
        self._held += 1
        if sub.heap[0] is entry:
            # A new head for the tenant: it supersedes the tenant's older ones.
            self._stamp += 1
            sub.stamp = self._stamp
            tag = self._share.tag(priority, tenant)
            heapq.heappush(level.heads, (tag, entry[0], entry[1], sub.stamp, tenant))
            self._heads += 1

    def best(self) -> tuple[T, Hashable, int] | None:
        """The best-ranked waiting item, its batch key and its priority; ``None`` if none.

        O(1) amortised (it pops the withdrawn and stale entries it finds on top).
        """
        found = self._best()
        return None if found is None else (found[1][2], found[1][3], found[1][5])

    def steps_ahead(self, priority: int, deadline: float) -> int:
        """The steps of the waiting items ranked ahead of a newcomer (L62).

        A newcomer of ``priority`` with the absolute ``deadline`` (finite) is
        admitted after every waiting item, so those ranked ahead of it are the
        items of a higher priority and those of its priority whose deadline is
        ``deadline`` or earlier. O(k + log n): a sum per priority, k the distinct
        priorities waiting, and a prefix sum by deadline at its own.
        """
        ahead = sum(steps for level, steps in self._steps.items() if level > priority)
        sums = self._by_deadline.get(priority)
        return ahead if sums is None else ahead + sums.through(deadline)

    def _forget_steps(self, entry: _Entry[T]) -> None:
        deadline, sequence, steps, priority = entry[0], entry[1], entry[4], entry[5]
        if not steps:
            return
        left = self._steps[priority] - steps
        if left:
            self._steps[priority] = left
        else:
            del self._steps[priority]
        if deadline != math.inf:
            sums = self._by_deadline[priority]
            sums.remove(deadline, sequence)
            if not sums:
                del self._by_deadline[priority]

    def remove(self, item: T) -> bool:
        """Withdraw ``item``; return whether it was waiting. Its tenant is charged nothing."""
        return self._leave(item, served=False)

    def claim(self, item: T) -> bool:
        """Take ``item`` out for a worker, as ``take`` would; return whether it was waiting.

        Its tenant is charged its cost (a preemption's newcomer, reserved, L61).
        """
        return self._leave(item, served=True)

    def _leave(self, item: T, *, served: bool) -> bool:
        entry = self._entries.pop(item, None)
        if entry is None:
            return False
        self._forget_steps(entry)
        # Lazy deletion: the entry stays in its tenant's heap until it is popped.
        self._left(entry, served=served)
        self._compact()
        return True

    def _left(self, entry: _Entry[T], *, served: bool) -> None:
        """Count ``entry`` out of its tenant and level (it left ``_entries``)."""
        priority, tenant = entry[5], entry[6]
        self._share.left(priority, tenant, cost=entry[7] if served else None)
        level = self._levels[priority]
        sub = level.subs[tenant]
        sub.live -= 1
        level.live -= 1
        if not sub.live:
            self._held -= len(sub.heap)
            del level.subs[tenant]
            if not level.live:
                self._heads -= len(level.heads)
                del self._levels[priority]

    def _compact(self) -> None:
        """Rebuild the heaps once withdrawn entries outnumber the waiting ones.

        Called after every withdrawal and take, so the heaps never hold more than
        ``max(_MIN_REBUILD, n)`` withdrawn entries or superseded heads (memory
        stays O(n)). A rebuild costs O(n) (heapify) and follows more than n
        withdrawals: O(1) amortised.
        """
        live = len(self._entries)
        bound = max(_MIN_REBUILD, live)
        if self._held - live <= bound and self._heads - live <= bound:
            return
        levels: dict[int, _Level[T]] = {}
        for entry in self._entries.values():
            level = levels.get(entry[5])
            if level is None:
                level = levels[entry[5]] = _Level()
            sub = level.subs.get(entry[6])
            if sub is None:
                sub = level.subs[entry[6]] = _Sub()
            sub.heap.append(entry)
            sub.live += 1
            level.live += 1
        share = self._share
        for priority, level in levels.items():
            for tenant, sub in level.subs.items():
                heapq.heapify(sub.heap)
                self._stamp += 1
                sub.stamp = self._stamp
                head = sub.heap[0]
                tag = share.tag(priority, tenant)
                level.heads.append((tag, head[0], head[1], sub.stamp, tenant))
            heapq.heapify(level.heads)
        self._levels = levels
        self._order = [-priority for priority in levels]
        heapq.heapify(self._order)
        self._held = live
        self._heads = sum(len(level.heads) for level in levels.values())

    def _best(self) -> tuple[_FairRank, _Entry[T]] | None:
        """The best-ranked waiting entry and its rank, after popping stale entries off the top."""
        order = self._order
        while order:
            priority = -order[0]
            level = self._levels.get(priority)
            if level is None:
                heapq.heappop(order)
                continue
            tag, entry = self._head(level, priority)
            return (-priority, tag, entry[0], entry[1]), entry
        return None

    def _head(self, level: _Level[T], priority: int) -> tuple[float, _Entry[T]]:
        """The best tenant head of a non-empty ``level`` and its tag, refreshing stale heads."""
        heads, share = level.heads, self._share
        while True:
            tag, deadline, sequence, stamp, tenant = heads[0]
            sub = level.subs.get(tenant)
            if sub is None or stamp != sub.stamp:
                heapq.heappop(heads)  # its tenant left, or a better head superseded it
                self._heads -= 1
                continue
            entry = self._first_live(sub.heap)
            current = share.tag(priority, tenant)
            if tag == current and entry[0] == deadline and entry[1] == sequence:
                return tag, entry
            heapq.heapreplace(heads, (current, entry[0], entry[1], stamp, tenant))

    def _first_live(self, heap: list[_Entry[T]]) -> _Entry[T]:
        """The top of a tenant's non-empty ``heap`` once the withdrawn entries above it
        are popped (``is``: an item withdrawn and pushed again has a new entry)."""
        while self._entries.get(heap[0][2]) is not heap[0]:
            heapq.heappop(heap)
            self._held -= 1
        return heap[0]

    def _tenant_heads(self, priority: int) -> list[tuple[_FairRank, _Entry[T]]]:
        """Each tenant's best waiting entry at ``priority`` and its rank. O(t), t tenants
        waiting there, plus the withdrawn entries it pops off their heaps' tops."""
        level = self._levels.get(priority)
        if level is None:
            return []
        found = []
        for tenant, sub in level.subs.items():
            entry = self._first_live(sub.heap)
            tag = self._share.tag(priority, tenant)
            found.append(((-priority, tag, entry[0], entry[1]), entry))
        return found

    def take(self, *, batch_key: Hashable | None, free: int, can_join: bool) -> list[T]:
        """Remove and return the requests that may enter the batch now (see ``take``)."""
        return take((self,), batch_key=batch_key, free=free, can_join=can_join)

    def _pop(self, entry: _Entry[T]) -> None:
        """Take the best entry, which ``_best`` just returned, and charge its tenant."""
        sub = self._levels[entry[5]].subs[entry[6]]
        heapq.heappop(sub.heap)
        self._held -= 1
        del self._entries[entry[2]]
        self._forget_steps(entry)
        self._left(entry, served=True)

    def drain(self) -> list[T]:
        """Remove and return every waiting item, best-ranked first (rank order)."""
        share = self._share
        entries = sorted(
            self._entries.values(),
            key=lambda e: (-e[5], share.tag(e[5], e[6]), e[0], e[1]),
        )
        for entry in entries:
            share.left(entry[5], entry[6])
        self._entries.clear()
        self._levels.clear()
        self._order.clear()
        self._held = self._heads = 0
        self._steps.clear()
        self._by_deadline.clear()
        return [entry[2] for entry in entries]


def best_of(
    queues: Sequence[WaitingQueue[T]],
) -> tuple[T, Hashable, int, Tenant, WaitingQueue[T]] | None:
    """The best-ranked waiting item of several queues: item, key, priority, tenant and
    its queue.

    The queues' items must have ranks from one numbering (distinct sequences) and
    one ``FairShare``.
    """
    found = _best_entry(queues)
    if found is None:
        return None
    entry, queue = found
    return entry[2], entry[3], entry[5], entry[6], queue


def tenant_heads(
    queues: Sequence[WaitingQueue[T]], priority: int
) -> list[tuple[T, Hashable, Tenant]]:
    """Each tenant's best-ranked waiting item at ``priority`` over several queues
    (item, key, tenant), best-ranked first; O(t log t) for t tenants waiting there."""
    best: dict[Tenant, tuple[_FairRank, _Entry[T]]] = {}
    for queue in queues:
        for rank, entry in queue._tenant_heads(priority):
            tenant = entry[6]
            if tenant not in best or rank < best[tenant][0]:
                best[tenant] = (rank, entry)
    return [(e[2], e[3], e[6]) for _, e in sorted(best.values(), key=lambda found: found[0])]


def _best_entry(queues: Sequence[WaitingQueue[T]]) -> tuple[_Entry[T], WaitingQueue[T]] | None:
    """The best-ranked waiting entry of several queues, and its queue."""
    found: tuple[_FairRank, _Entry[T], WaitingQueue[T]] | None = None
    for queue in queues:
        best = queue._best()
        if best is not None and (found is None or best[0] < found[0]):
            found = (best[0], best[1], queue)
    return None if found is None else (found[1], found[2])


def take(
    queues: Sequence[WaitingQueue[T]], *, batch_key: Hashable | None, free: int, can_join: bool
) -> list[T]:
    """Remove and return the requests that may enter the batch now, from several queues.

    The queues are taken from as if they were one (a worker's own suspended
    requests beside the shared queue): each item taken is the best-ranked of all,
    and its tenant is charged its cost as it is taken, which may change the rank
    of the next.

    Args:
        queues: where to take from; their ranks share one numbering and one
            ``FairShare``.
        batch_key: the key of the running batch, ``None`` when none runs.
        free: places left in the batch.
        can_join: whether requests may join a batch that is already running.

    Returns:
        Up to ``free`` items, best-ranked first, all with one key: each was
        the best-ranked waiting item when taken.
    """
    if free <= 0 or (batch_key is not None and not can_join):
        return []
    taken: list[T] = []
    key = batch_key
    while len(taken) < free:
        found = _best_entry(queues)
        if found is None:
            break
        entry, queue = found
        if key is None:
            key = entry[3]
        elif entry[3] != key:
            break
        queue._pop(entry)
        taken.append(entry[2])
    for queue in queues:
        queue._compact()
    return taken
