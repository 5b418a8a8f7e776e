"""The pure waiting queue: property tests over generated operation lists.

Determinism: no threads, no event loop; Hypothesis drives plain method calls and
checks them against a simple list-based model.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from omni_trio._scheduler import WaitingQueue


@dataclass(eq=False)
class Item:
    key: int


ops = st.lists(
    st.one_of(
        st.tuples(st.just("push"), st.integers(0, 2)),
        st.tuples(st.just("remove"), st.integers(0, 30)),
        st.tuples(
            st.just("take"),
            st.tuples(st.one_of(st.none(), st.integers(0, 2)), st.integers(0, 4), st.booleans()),
        ),
    ),
    max_size=60,
)


@given(ops)
def test_queue_matches_fifo_model(operations: list[tuple[str, object]]) -> None:
    """Take returns the oldest items, one key, within capacity; nothing is lost or duplicated."""
    queue: WaitingQueue[Item] = WaitingQueue()
    model: list[Item] = []
    created: list[Item] = []
    taken: list[Item] = []
    for op, arg in operations:
        if op == "push":
            assert isinstance(arg, int)
            item = Item(arg)
            created.append(item)
            queue.push(item, item.key)
            model.append(item)
        elif op == "remove":
            assert isinstance(arg, int)
            if created:
                item = created[arg % len(created)]
                assert queue.remove(item) == (item in model)
                if item in model:
                    model.remove(item)
        else:
            assert isinstance(arg, tuple)
            batch_key, free, can_join = arg
            got = queue.take(batch_key=batch_key, free=free, can_join=can_join)
            expected: list[Item] = []
            if free > 0 and (batch_key is None or can_join):
                key = batch_key
                for item in model:
                    if len(expected) == free:
                        break
                    if key is None:
                        key = item.key
                    if item.key != key:
                        break
                    expected.append(item)
            assert got == expected
            for item in got:
                model.remove(item)
            taken += got
        assert len(queue) == len(model)
        assert all(item in queue for item in model)
    assert len(set(map(id, taken))) == len(taken)
    assert queue.drain() == model


def test_push_twice_is_refused() -> None:
    """An admission waits once; pushing it again is a bug."""
    queue: WaitingQueue[Item] = WaitingQueue()
    item = Item(0)
    queue.push(item, 0)
    with pytest.raises(ValueError, match="already waiting"):
        queue.push(item, 0)


def test_older_request_with_other_key_is_not_starved() -> None:
    """Newcomers compatible with the batch do not overtake an older incompatible request."""
    queue: WaitingQueue[Item] = WaitingQueue()
    old, new = Item(1), Item(0)
    queue.push(old, 1)
    queue.push(new, 0)
    assert queue.take(batch_key=0, free=4, can_join=True) == []
    assert queue.take(batch_key=None, free=4, can_join=True) == [old]
