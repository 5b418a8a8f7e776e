"""Steps of waiting requests ordered by deadline, with prefix sums (admission, L62).

``DeadlineSums`` holds ``(deadline, sequence, steps)`` entries, one per waiting
request of one priority that has a deadline, and answers "how many steps have a
deadline at or before ``d``" without a scan: what a newcomer with deadline ``d``
waits behind at its own priority (the queue's ranking puts an equal deadline's
earlier admission first, and a newcomer is admitted after everyone).

It is a sorted list cut into blocks of at most ``2 * _LOAD`` entries (the layout
of a B-tree's leaves), each block with the sum of its steps, and a Fenwick tree
over the block sums. With n entries and B = ``_LOAD``:

- ``add`` and ``remove``: a bisection over the blocks' last keys (O(log n)), one
  within the block (O(log B)), a list insert or delete in it (O(B), a memmove),
  and a Fenwick update (O(log n)). A block that grows past 2B is split, and an
  empty one removed; both rebuild the Fenwick tree in O(n / B), at most once per
  B changes: O(n / B²) amortised, below 1 for any queue ``max_waiting`` allows
  up to B² (about 16,000 entries at one priority), and below log n far beyond.
- ``through(d)``: the same two bisections, a Fenwick prefix over the blocks before
  (O(log n)) and a sum over part of one block (O(B), at C speed).

So every call is O(log n + B), B a constant; never a scan of the queue.
"""

from __future__ import annotations

import math
from bisect import bisect_left

__all__ = ["DeadlineSums"]

#: Entries per block, half the most a block holds before it is split: a list of
#: this size inserts and sums in well under a microsecond (picked without
#: measurement beyond that).
_LOAD = 128

#: ``(deadline, sequence)``; a query's bound has ``math.inf`` for the sequence.
_Key = tuple[float, float]


class DeadlineSums:
    """Steps by ``(deadline, sequence)``, with the sum of those at or before a deadline."""

    __slots__ = ("_keys", "_maxes", "_steps", "_sums", "_tree")

    def __init__(self) -> None:
        # Blocks of sorted keys and their steps, in order; each block's last key
        # and sum of steps; the Fenwick tree (1-based) over those sums.
        self._keys: list[list[_Key]] = []
        self._steps: list[list[int]] = []
        self._maxes: list[_Key] = []
        self._sums: list[int] = []
        self._tree: list[int] = [0]

    def __bool__(self) -> bool:
        return bool(self._keys)

    def add(self, deadline: float, sequence: int, steps: int) -> None:
        """Hold the entry of a request waiting with ``deadline`` (unique ``sequence``)."""
        key = (deadline, sequence)
        if not self._keys:
            self._keys, self._steps = [[key]], [[steps]]
            self._maxes, self._sums = [key], [steps]
            self._rebuild()
            return
        index = min(bisect_left(self._maxes, key), len(self._keys) - 1)
        keys, steps_of = self._keys[index], self._steps[index]
        at = bisect_left(keys, key)
        keys.insert(at, key)
        steps_of.insert(at, steps)
        self._maxes[index] = keys[-1]
        self._sums[index] += steps
        if len(keys) > 2 * _LOAD:
            half = len(keys) // 2
            self._keys[index : index + 1] = [keys[:half], keys[half:]]
            self._steps[index : index + 1] = [steps_of[:half], steps_of[half:]]
            self._maxes[index : index + 1] = [keys[half - 1], keys[-1]]
            self._sums[index : index + 1] = [sum(steps_of[:half]), sum(steps_of[half:])]
            self._rebuild()
        else:
            self._grow(index, steps)

    def remove(self, deadline: float, sequence: int) -> None:
        """Forget the entry ``add`` held for ``(deadline, sequence)``; it must be here."""
        key = (deadline, sequence)
        index = bisect_left(self._maxes, key)
        keys = self._keys[index] if index < len(self._keys) else []
        at = bisect_left(keys, key)
        if at == len(keys) or keys[at] != key:
            raise KeyError(key)
        del keys[at]
        steps = self._steps[index].pop(at)
        if not keys:
            for table in (self._keys, self._steps, self._maxes, self._sums):
                del table[index]
            self._rebuild()
            return
        self._maxes[index] = keys[-1]
        self._sums[index] -= steps
        self._grow(index, -steps)

    def clear(self) -> None:
        """Forget every entry."""
        self._keys, self._steps, self._maxes, self._sums = [], [], [], []
        self._tree = [0]

    def through(self, deadline: float) -> int:
        """The steps of the entries whose deadline is ``deadline`` or earlier."""
        # Above every key with this deadline, whatever its sequence (an int).
        bound = (deadline, math.inf)
        index = bisect_left(self._maxes, bound)
        total = 0
        position = index  # Fenwick prefix over the blocks before ``index``
        tree = self._tree
        while position:
            total += tree[position]
            position &= position - 1
        if index < len(self._keys):
            at = bisect_left(self._keys[index], bound)
            total += sum(self._steps[index][:at])
        return total

    def _grow(self, index: int, steps: int) -> None:
        """Add ``steps`` to block ``index``'s sum in the Fenwick tree."""
        tree = self._tree
        position = index + 1
        while position < len(tree):
            tree[position] += steps
            position += position & -position

    def _rebuild(self) -> None:
        """The Fenwick tree of the block sums anew, in O(number of blocks)."""
        tree = [0, *self._sums]
        for position in range(1, len(tree)):
            parent = position + (position & -position)
            if parent < len(tree):
                tree[parent] += tree[position]
        self._tree = tree
