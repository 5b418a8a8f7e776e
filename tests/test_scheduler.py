"""The pure waiting queue: property tests over generated operation lists.

Determinism: no threads, no event loop; Hypothesis drives plain method calls and
checks them against a simple list-based model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omni_trio import _scheduler
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


@dataclass(eq=False)
class Ranked:
    key: int


ranked_ops = st.lists(
    st.one_of(
        # (priority, batch key, an earlier item to push again or None for a new one,
        # deadline, steps)
        st.tuples(
            st.just("push"),
            st.tuples(
                st.integers(-2, 2),
                st.integers(0, 2),
                st.none() | st.integers(0, 30),
                st.sampled_from([math.inf, 1.0, 2.0, 3.0]),
                st.integers(1, 5),
            ),
        ),
        st.tuples(st.just("remove"), st.integers(0, 30)),
        st.tuples(
            st.just("take"),
            st.tuples(st.one_of(st.none(), st.integers(0, 2)), st.integers(0, 4), st.booleans()),
        ),
    ),
    max_size=80,
)


def expected_take(
    model: list[tuple[tuple[int, float, int], Ranked]],
    batch_key: int | None,
    free: int,
    can_join: bool,
) -> list[Ranked]:
    """The reference rule: walk the waiting items in rank order while each has the key."""
    expected: list[Ranked] = []
    if free <= 0 or (batch_key is not None and not can_join):
        return expected
    key = batch_key
    for _, item in sorted(model, key=lambda entry: entry[0]):
        if len(expected) == free:
            break
        if key is None:
            key = item.key
        if item.key != key:
            break
        expected.append(item)
    return expected


@settings(max_examples=500)
@given(ranked_ops, st.sampled_from([0, _scheduler._MIN_REBUILD]))
def test_queue_matches_ranked_model(operations: list[tuple[str, object]], rebuild: int) -> None:
    """L60, L62: take returns the best-ranked items (priority, deadline, admission), one key.

    The reference model is a list sorted by (-priority, deadline, admission sequence)
    at every take; ``steps_ahead`` is checked against it after every operation. With
    ``rebuild`` 0 the heap is rebuilt at every withdrawal that leaves more withdrawn
    entries than waiting ones, so lazy deletion and rebuilding both run.
    """
    queue: WaitingQueue[Ranked] = WaitingQueue()
    model: list[tuple[tuple[int, float, int], Ranked]] = []
    steps_of: dict[int, int] = {}
    created: list[Ranked] = []
    sequence = 0
    with mock.patch.object(_scheduler, "_MIN_REBUILD", rebuild):
        for op, arg in operations:
            waiting = [item for _, item in model]
            if op == "push":
                assert isinstance(arg, tuple)
                priority, key, reuse, deadline, steps = arg
                if reuse is not None and created:
                    item = created[reuse % len(created)]
                    if item in waiting:
                        with pytest.raises(ValueError, match="already waiting"):
                            queue.push(item, item.key, priority=priority)
                        continue
                else:
                    item = Ranked(key)
                    created.append(item)
                queue.push(item, item.key, priority=priority, deadline=deadline, steps=steps)
                model.append(((-priority, deadline, sequence), item))
                steps_of[id(item)] = steps
                sequence += 1
            elif op == "remove":
                assert isinstance(arg, int)
                if created:
                    item = created[arg % len(created)]
                    assert queue.remove(item) == (item in waiting)
                    model = [entry for entry in model if entry[1] is not item]
            else:
                assert isinstance(arg, tuple)
                batch_key, free, can_join = arg
                got = queue.take(batch_key=batch_key, free=free, can_join=can_join)
                assert got == expected_take(model, batch_key, free, can_join)
                model = [entry for entry in model if entry[1] not in got]
            assert len(queue) == len(model)
            for level in range(-3, 4):
                assert queue.steps_ahead(level) == sum(
                    steps_of[id(item)] for rank, item in model if -rank[0] >= level
                )
            assert all(item in queue for _, item in model)
            # Withdrawn entries never outnumber the waiting ones past the threshold.
            assert len(queue._heap) - len(queue) <= max(rebuild, len(queue))
        assert queue.drain() == [item for _, item in sorted(model, key=lambda entry: entry[0])]
    assert len(queue) == 0


def test_better_ranked_request_with_other_key_is_not_starved() -> None:
    """L60: a compatible newcomer of lower priority does not join past a better-ranked one."""
    queue: WaitingQueue[Item] = WaitingQueue()
    urgent, compatible, joiner = Item(1), Item(0), Item(0)
    queue.push(compatible, 0, priority=0)
    queue.push(urgent, 1, priority=5)
    assert queue.take(batch_key=0, free=4, can_join=True) == []
    queue.push(joiner, 0, priority=9)
    # The joiner outranks everything and matches the batch: it joins; the rest wait.
    assert queue.take(batch_key=0, free=4, can_join=True) == [joiner]
    assert queue.take(batch_key=None, free=4, can_join=True) == [urgent]
    assert queue.take(batch_key=None, free=4, can_join=True) == [compatible]


def test_withdrawn_entries_are_skipped_and_memory_stays_bounded() -> None:
    """Many withdrawals: the count stays exact, the heap is rebuilt, the order holds."""
    queue: WaitingQueue[Item] = WaitingQueue()
    items = [Item(0) for _ in range(1000)]
    for index, item in enumerate(items):
        queue.push(item, 0, priority=index % 3)
    for item in items[:900]:
        assert queue.remove(item)
    assert not queue.remove(items[0])
    assert len(queue) == 100
    assert len(queue._heap) <= 2 * len(queue) + _scheduler._MIN_REBUILD
    # Priority index % 3, highest first; then admission order.
    best_first = [item for _, _, item in sorted((-(i % 3), i, items[i]) for i in range(900, 1000))]
    assert queue.take(batch_key=None, free=1000, can_join=True) == best_first
    assert len(queue) == 0


def test_an_item_pushed_again_ranks_by_its_new_admission() -> None:
    """A withdrawn item pushed again is ranked anew; its old heap entry is skipped."""
    queue: WaitingQueue[Item] = WaitingQueue()
    first, second = Item(0), Item(0)
    queue.push(first, 0, priority=5)
    queue.push(second, 0, priority=1)
    assert queue.remove(first)
    queue.push(first, 0, priority=0)
    assert len(queue) == 2
    assert queue.take(batch_key=None, free=4, can_join=True) == [second, first]
    assert len(queue) == 0


def test_a_take_that_leaves_withdrawn_entries_behind_compacts_the_heap() -> None:
    """Takes, not only withdrawals, keep withdrawn entries from outnumbering waiting ones."""
    queue: WaitingQueue[Item] = WaitingQueue()
    items = [Item(0) for _ in range(4 * _scheduler._MIN_REBUILD)]
    for item in items:
        queue.push(item, 0)
    half = len(items) // 2
    for item in items[half:]:
        assert queue.remove(item)  # as many withdrawn as waiting: no rebuild yet
    assert queue.take(batch_key=None, free=half // 2, can_join=True) == items[: half // 2]
    assert len(queue) == half - half // 2
    assert len(queue._heap) - len(queue) <= max(_scheduler._MIN_REBUILD, len(queue))
