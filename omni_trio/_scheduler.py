"""The waiting queue and batch formation: pure, synchronous, no I/O, no threads.

Batches are formed in admission order. A request joins a batch only when its
batch key equals the batch's key, and only while it is the oldest waiting
request: a stream of compatible newcomers never starves an older request with
another key (the batch drains, then the older request starts the next one).
Every operation is O(1) per request moved, whatever the queue length.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import Generic, TypeVar

__all__ = ["WaitingQueue"]

T = TypeVar("T", bound=Hashable)


class WaitingQueue(Generic[T]):
    """Admitted requests waiting for the worker, oldest first.

    Items are compared by identity (the admission), never by request id.
    """

    __slots__ = ("_items",)

    def __init__(self) -> None:
        # OrderedDict keeps O(1) access to the oldest item even after many
        # removals from the front (a plain dict rescans its deleted slots).
        self._items: OrderedDict[T, Hashable] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, item: object) -> bool:
        return item in self._items

    def push(self, item: T, key: Hashable) -> None:
        """Append ``item`` with its batch ``key``; an item may wait only once."""
        if item in self._items:
            raise ValueError("item is already waiting")
        self._items[item] = key

    def remove(self, item: T) -> bool:
        """Remove ``item``; return whether it was waiting."""
        return self._items.pop(item, _MISSING) is not _MISSING

    def take(self, *, batch_key: Hashable | None, free: int, can_join: bool) -> list[T]:
        """Remove and return the requests that may enter the batch now.

        Args:
            batch_key: the key of the running batch, ``None`` when none runs.
            free: places left in the batch.
            can_join: whether requests may join a batch that is already running.

        Returns:
            Up to ``free`` items, oldest first, all with one key.
        """
        if free <= 0 or not self._items or (batch_key is not None and not can_join):
            return []
        taken: list[T] = []
        key = batch_key
        while self._items and len(taken) < free:
            item, item_key = next(iter(self._items.items()))
            if key is None:
                key = item_key
            elif item_key != key:
                break
            del self._items[item]
            taken.append(item)
        return taken

    def drain(self) -> list[T]:
        """Remove and return every waiting item, oldest first."""
        items = list(self._items)
        self._items.clear()
        return items


_MISSING = object()
