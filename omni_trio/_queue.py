"""The waiting queue: admitted requests, best-ranked first; pure, synchronous.

No I/O, no threads, no locks: the worker and the pool call these under the pool's
lock (see ``_pool``, ``_worker``).

Ranking (L60): every waiting request has a rank, ``(-priority, deadline,
admission sequence)``, compared as a tuple; the smallest is the best-ranked.
Higher priority goes first; among equal priorities the earliest deadline (L62;
``+inf`` for a request without one), then the earlier admission. The deadline is
an absolute time on any one clock the caller picks (the engine uses its event
loop's): the queue only compares the numbers.

Batch formation: a request joins a running batch only when its batch key equals
the batch's key and it is the best-ranked waiting request, so a stream of
compatible newcomers never starves a better-ranked request with another key (the
batch drains, then that request starts the next one). An idle worker takes the
best-ranked request, then the next best-ranked ones while they have its key.
With all priorities equal this is admission order (FIFO).

Complexity, with n requests waiting: ``push`` is O(log n); ``remove`` is O(1)
amortised (the entry is forgotten at once and skipped when it reaches the top of
the heap; the heap is rebuilt, in O(n), only once it holds more withdrawn entries
than waiting ones, so it stays O(n) in size); ``take`` is O(log n) per heap entry
it pops (each request taken, and each withdrawn entry it skips, once); ``drain``
is O(n log n) (it sorts); ``len`` and membership are O(1) and exact.

Admission's estimate (L62) asks ``steps_ahead``: the steps of the items ranked
ahead of a newcomer. A running sum of steps is kept per priority, and per
priority the steps of the items with a deadline in a ``DeadlineSums`` (prefix
sums by deadline, ``_stepsums``): ``steps_ahead`` is O(k + log n), k the number of
distinct priorities waiting, never a scan of the queue. Keeping them adds
O(log n) to ``push``, to ``remove`` and to each item ``take`` pops, for items
with a deadline only.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Hashable, Sequence
from typing import Generic, TypeVar

from ._stepsums import DeadlineSums

__all__ = ["Rank", "WaitingQueue", "best_of", "take"]

T = TypeVar("T", bound=Hashable)

#: A rank as the queue compares them: ``(-priority, deadline, sequence)``.
Rank = tuple[int, float, int]

# The heap entry: (-priority, deadline, sequence, item, batch key, steps). The
# sequence is unique, so tuple comparison never reaches the item or the key (which
# need not be orderable).
_Entry = tuple[int, float, int, T, Hashable, int]

#: Below this many withdrawn entries the heap is never rebuilt, so a short queue
#: with a few aborts does not rebuild at every one (picked without measurement).
_MIN_REBUILD = 64


class WaitingQueue(Generic[T]):
    """Admitted requests waiting for the worker, best-ranked first.

    Items are compared by identity (the admission), never by request id.
    """

    __slots__ = ("_by_deadline", "_entries", "_heap", "_sequence", "_steps")

    def __init__(self) -> None:
        # The waiting items and their live heap entries: the exact count and
        # O(1) membership. The heap may also hold entries of withdrawn items.
        self._entries: dict[T, _Entry[T]] = {}
        self._heap: list[_Entry[T]] = []
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
    ) -> int:
        """Admit ``item`` with its batch ``key``, ``priority`` (higher first) and ``deadline``.

        Args:
            item: what waits.
            key: its batch key.
            priority: higher ranks first.
            deadline: an absolute time; among equal priorities the earliest ranks
                first (``math.inf``: none).
            steps: its step count, summed for ``steps_ahead``.
            sequence: the admission sequence a queue's ``push`` returned when
                ``item`` was first admitted, for an item that comes back (a
                suspended request, L61), possibly into another queue: it keeps its
                place among equals. ``None``: a new one, numbered by this queue.

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
        entry: _Entry[T] = (-priority, deadline, sequence, item, key, steps)
        self._entries[item] = entry
        heapq.heappush(self._heap, entry)
        if steps:
            self._steps[priority] = self._steps.get(priority, 0) + steps
            if deadline != math.inf:
                sums = self._by_deadline.get(priority)
                if sums is None:
                    sums = self._by_deadline[priority] = DeadlineSums()
                sums.add(deadline, sequence, steps)
        return sequence

    def best(self) -> tuple[T, Hashable, int] | None:
        """The best-ranked waiting item, its batch key and its priority; ``None`` if none.

        O(1) amortised (it pops the withdrawn entries it finds on top).
        """
        entry = self._best()
        return None if entry is None else (entry[3], entry[4], -entry[0])

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
        priority, deadline, sequence, steps = -entry[0], entry[1], entry[2], entry[5]
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
        """Withdraw ``item``; return whether it was waiting."""
        entry = self._entries.pop(item, None)
        if entry is None:
            return False
        self._forget_steps(entry)
        # Lazy deletion: the entry stays in the heap until it is popped.
        self._compact()
        return True

    def _compact(self) -> None:
        """Rebuild the heap once withdrawn entries outnumber the waiting ones.

        Called after every withdrawal and take, so the heap never holds more
        than ``max(_MIN_REBUILD, n)`` withdrawn entries (memory stays O(n)). A
        rebuild costs O(n) and follows more than n withdrawals: O(1) amortised.
        """
        withdrawn = len(self._heap) - len(self._entries)
        if withdrawn > _MIN_REBUILD and withdrawn > len(self._entries):
            self._heap = list(self._entries.values())
            heapq.heapify(self._heap)

    def _best(self) -> _Entry[T] | None:
        """The best-ranked waiting entry, after popping withdrawn ones off the top."""
        heap = self._heap
        while heap:
            entry = heap[0]
            # ``is``: an item withdrawn and pushed again has a new entry.
            if self._entries.get(entry[3]) is entry:
                return entry
            heapq.heappop(heap)
        return None

    def take(self, *, batch_key: Hashable | None, free: int, can_join: bool) -> list[T]:
        """Remove and return the requests that may enter the batch now (see ``take``)."""
        return take((self,), batch_key=batch_key, free=free, can_join=can_join)

    def _pop(self, entry: _Entry[T]) -> None:
        """Remove the best entry, which ``_best`` just returned."""
        heapq.heappop(self._heap)
        del self._entries[entry[3]]
        self._forget_steps(entry)

    def drain(self) -> list[T]:
        """Remove and return every waiting item, best-ranked first (rank order)."""
        entries = sorted(self._entries.values())
        self._entries.clear()
        self._heap.clear()
        self._steps.clear()
        self._by_deadline.clear()
        return [entry[3] for entry in entries]


def best_of(
    queues: Sequence[WaitingQueue[T]],
) -> tuple[T, Hashable, int, WaitingQueue[T]] | None:
    """The best-ranked waiting item of several queues: item, key, priority and its queue.

    The queues' items must have ranks from one numbering (distinct sequences).
    """
    found: tuple[_Entry[T], WaitingQueue[T]] | None = None
    for queue in queues:
        entry = queue._best()
        if entry is not None and (found is None or entry[:3] < found[0][:3]):
            found = (entry, queue)
    if found is None:
        return None
    entry, queue = found
    return entry[3], entry[4], -entry[0], queue


def take(
    queues: Sequence[WaitingQueue[T]], *, batch_key: Hashable | None, free: int, can_join: bool
) -> list[T]:
    """Remove and return the requests that may enter the batch now, from several queues.

    The queues are taken from as if they were one (a worker's own suspended
    requests beside the shared queue): each item taken is the best-ranked of all.

    Args:
        queues: where to take from; their ranks share one numbering.
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
        found = best_of(queues)
        if found is None:
            break
        item, item_key, _, queue = found
        if key is None:
            key = item_key
        elif item_key != key:
            break
        entry = queue._entries[item]
        queue._pop(entry)
        taken.append(item)
    for queue in queues:
        queue._compact()
    return taken
