"""The pure waiting queue and boundary policy: property tests over generated inputs.

Determinism: no threads, no event loop; Hypothesis drives plain method calls and
checks them against simple models (a sorted list; the lifecycle machine's worker
model for the boundary policy).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import omni_trio as ot
from omni_trio import _queue as queue_module
from omni_trio import _stepsums as stepsums_module
from omni_trio._queue import WaitingQueue
from omni_trio._scheduler import BoundaryRules, Member, Preemption, RunningBatch, plan_boundary
from omni_trio._stepsums import DeadlineSums
from tests.lifecycle.sched import Job, WorkerModel


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
@given(ranked_ops, st.sampled_from([0, queue_module._MIN_REBUILD]))
def test_queue_matches_ranked_model(operations: list[tuple[str, object]], rebuild: int) -> None:
    """L60, L62: take returns the best-ranked items (priority, deadline, admission), one key.

    The reference model is a list sorted by (-priority, deadline, admission sequence)
    at every take; ``steps_ahead`` (the steps ranked ahead of a newcomer with a
    deadline) is checked against it after every operation. With
    ``rebuild`` 0 the heap is rebuilt at every withdrawal that leaves more withdrawn
    entries than waiting ones, so lazy deletion and rebuilding both run.
    """
    queue: WaitingQueue[Ranked] = WaitingQueue()
    model: list[tuple[tuple[int, float, int], Ranked]] = []
    steps_of: dict[int, int] = {}
    created: list[Ranked] = []
    sequence = 0
    with mock.patch.object(queue_module, "_MIN_REBUILD", rebuild):
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
            for level, deadline in itertools.product(range(-3, 4), (0.5, 1.0, 2.5, 3.0)):
                # A newcomer ranks after every item of its priority and deadline.
                newcomer = (-level, deadline, math.inf)
                assert queue.steps_ahead(level, deadline) == sum(
                    steps_of[id(item)] for rank, item in model if rank < newcomer
                )
            assert all(item in queue for _, item in model)
            # Withdrawn entries never outnumber the waiting ones past the threshold.
            assert queue._held - len(queue) <= max(rebuild, len(queue))
            assert queue._heads - len(queue) <= max(rebuild, len(queue))
        assert queue.drain() == [item for _, item in sorted(model, key=lambda entry: entry[0])]
    assert len(queue) == 0


sums_ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.sampled_from([1.0, 2.0, 2.5, 4.0]), st.integers(1, 9)),
        st.tuples(st.just("remove"), st.integers(0, 200), st.just(0)),
    ),
    max_size=200,
)


@settings(max_examples=300)
@given(sums_ops, st.sampled_from([1, 2, 128]))
def test_deadline_sums_match_a_sorted_model(
    operations: list[tuple[str, float, int]], load: int
) -> None:
    """L62: ``DeadlineSums.through(d)`` is the steps of the entries with a deadline <= d.

    Small blocks (``load`` 1 or 2) make every add split blocks and removals empty
    them, so the Fenwick tree is rebuilt often; 128 is the module's own.
    """
    sums = DeadlineSums()
    model: dict[tuple[float, int], int] = {}
    with mock.patch.object(stepsums_module, "_LOAD", load):
        for sequence, (op, deadline, steps) in enumerate(operations):
            if op == "add":
                sums.add(deadline, sequence, steps)
                model[deadline, sequence] = steps
            elif model:
                key = sorted(model)[int(deadline) % len(model)]
                sums.remove(*key)
                del model[key]
            assert bool(sums) is bool(model)
            for bound in (0.5, 1.0, 2.0, 2.5, 3.0, 4.0, math.inf):
                expected = sum(steps for (d, _), steps in model.items() if d <= bound)
                assert sums.through(bound) == expected
    with pytest.raises(KeyError):
        sums.remove(9.0, -1)
    sums.clear()
    assert not sums and sums.through(math.inf) == 0


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
    """Many withdrawals: the count stays exact, the heaps are rebuilt, the order holds."""
    queue: WaitingQueue[Item] = WaitingQueue()
    items = [Item(0) for _ in range(1000)]
    for index, item in enumerate(items):
        queue.push(item, 0, priority=index % 3)
    for item in items[:900]:
        assert queue.remove(item)
    assert not queue.remove(items[0])
    assert len(queue) == 100
    assert queue._held <= 2 * len(queue) + queue_module._MIN_REBUILD
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
    items = [Item(0) for _ in range(4 * queue_module._MIN_REBUILD)]
    for item in items:
        queue.push(item, 0)
    half = len(items) // 2
    for item in items[half:]:
        assert queue.remove(item)  # as many withdrawn as waiting: no rebuild yet
    assert queue.take(batch_key=None, free=half // 2, can_join=True) == items[: half // 2]
    assert len(queue) == half - half // 2
    assert queue._held - len(queue) <= max(queue_module._MIN_REBUILD, len(queue))


# -- the boundary policy -------------------------------------------------------
#
# ``plan_boundary`` against the lifecycle machine's worker model (``WorkerModel``,
# written from the contract, not from the engine's code): on generated batches and
# queues, the plan and the model's boundary agree on what drops, what is suspended
# and what runs next. The model is one worker's (no idle peers) and joins; the idle
# share and runners without joins are checked on their own below.

_deadlines = st.sampled_from([math.inf, 1.0, 2.0])


@dataclass(frozen=True, kw_only=True)
class Boundary:
    """One generated boundary: the worker's rules, its batch and its queues."""

    max_batch: int
    max_preemptions: int
    preempting: bool
    stopping: bool
    running: list[Job]
    fresh: list[Job]
    parked: list[Job]


def _job(where: str, priority: int, key: int, deadline: float, admission: int) -> Job:
    request = ot.GenerationRequest(height=8 * (1 + key), width=8, priority=priority)
    return Job(f"j{admission}", request, (-priority, deadline, admission), where=where)  # type: ignore[arg-type]


@st.composite
def boundaries(draw: st.DrawFn) -> Boundary:
    """A batch of one key (at most ``max_batch``), some of its tokens set, and queues."""
    max_batch = draw(st.integers(1, 3))
    key = draw(st.integers(0, 1))
    admissions = itertools.count()
    running: list[Job] = []
    # A full batch half the time: what preemption needs for a newcomer that could join.
    for _ in range(draw(st.just(max_batch) | st.integers(0, max_batch))):
        job = _job(
            "running", draw(st.sampled_from([0, 1, 2])), key, draw(_deadlines), next(admissions)
        )
        job.preemptions = draw(st.sampled_from([0, 1]))
        # Only a running member waits for a boundary to see its token: a waiting
        # one is withdrawn at once (L6).
        job.token = draw(st.sampled_from([None, None, None, "user"]))
        running.append(job)
    # Hypothesis draws the first of a ``sampled_from`` more often: waiting priorities
    # lean higher than running ones (preemption needs a better newcomer), and most
    # boundaries preempt if they should, and do not stop.
    waiting = st.tuples(st.sampled_from([2, 1, 0]), st.integers(0, 1), _deadlines)
    fresh = [
        _job("fresh", *spec, next(admissions))
        for spec in draw(st.lists(waiting, min_size=1, max_size=4))
    ]
    parked = [
        _job("parked", *spec, next(admissions)) for spec in draw(st.lists(waiting, max_size=3))
    ]
    for job in parked:
        job.preemptions = draw(st.integers(1, 2))
    # Drawn admission order is not rank order: shuffle who was admitted first.
    order = draw(st.permutations(range(len(running) + len(fresh) + len(parked))))
    for job, admission in zip([*running, *fresh, *parked], order, strict=True):
        job.rank = (*job.rank[:2], admission)
    return Boundary(
        max_batch=max_batch,
        max_preemptions=draw(st.sampled_from([1, 2, 0])),
        preempting=draw(st.sampled_from([True, True, True, False])),
        stopping=draw(st.sampled_from([False] * 7 + [True])),
        running=running,
        fresh=fresh,
        parked=parked,
    )


def _queue(jobs: list[Job]) -> WaitingQueue[Job]:
    queue: WaitingQueue[Job] = WaitingQueue()
    for job in jobs:
        queue.push(job, job.key, priority=job.priority, deadline=job.rank[1], sequence=job.rank[2])
    return queue


def _members(jobs: list[Job]) -> list[Member[Job]]:
    return [
        Member(
            item=job,
            key=job.key,
            rank=job.rank,
            preemptions=job.preemptions,
            stopped=job.token is not None,
        )
        for job in jobs
    ]


@settings(max_examples=500)
@given(boundaries())
def test_boundary_plan_agrees_with_the_worker_model(boundary: Boundary) -> None:
    """L7, L32, L60, L61: the plan drops, suspends and admits what the worker model does."""
    running, fresh, parked = boundary.running, boundary.fresh, boundary.parked
    jobs = [*running, *fresh, *parked]
    fresh_queue, parked_queue = _queue(fresh), _queue(parked)
    rules = BoundaryRules(
        max_batch=boundary.max_batch,
        can_join=True,
        preempting=boundary.preempting,
        max_preemptions=boundary.max_preemptions,
    )
    plan = plan_boundary(
        _members(running),
        fresh=fresh_queue,
        parked=parked_queue,
        rules=rules,
        stopping=boundary.stopping,
        idle=0,
    )
    # Without preemption the model is a worker whose members may never be suspended.
    model = WorkerModel(
        max_batch=boundary.max_batch,
        max_preemptions=boundary.max_preemptions if boundary.preempting else 0,
        fresh=list(fresh),
        parked=list(parked),
        running=list(running),
        stopping=boundary.stopping,
    )
    model.boundary()

    assert plan.stop == model.exited
    assert set(plan.drop) == {job for job in jobs if job.where == "ended"}
    victims = plan.preempt.victims if plan.preempt is not None else ()
    assert set(victims) == {job for job in running if job.where == "parked"}
    if plan.preempt is not None:
        assert not plan.admit
        # The worker takes the newcomer out of its queue once the victims are parked.
        starting = [plan.preempt.newcomer]
        assert fresh_queue.remove(plan.preempt.newcomer) or parked_queue.remove(
            plan.preempt.newcomer
        )
    else:
        starting = list(plan.admit)
    assert model.running == [job for job in plan.keep if job not in victims] + starting
    # What the plan left waiting is what the model did.
    assert set(fresh_queue.drain()) == set(model.fresh)
    assert set(parked_queue.drain()) == {job for job in model.parked if job not in victims}
    assert plan.wait == (not running and not model.running and not boundary.stopping)


def _waiting_jobs(count: int, *, key: int = 0, priority: int = 0) -> list[Job]:
    """``count`` jobs of one batch key and priority, admitted in order after any others."""
    request = ot.GenerationRequest(height=8 * (1 + key), width=8, priority=priority)
    return [
        Job(f"j{key}.{priority}.{n}", request, (-priority, math.inf, next(_admissions)))
        for n in range(count)
    ]


_admissions = itertools.count()


@given(st.integers(0, 12), st.integers(0, 4), st.integers(1, 8))
def test_an_idle_worker_takes_its_share_beside_idle_ones(
    waiting: int, idle: int, max_batch: int
) -> None:
    """L42: a worker that wakes beside ``idle`` idle ones takes its share, not a whole batch."""
    fresh = _queue(_waiting_jobs(waiting))
    rules = BoundaryRules(max_batch=max_batch, can_join=True, preempting=True, max_preemptions=1)
    plan = plan_boundary(
        [], fresh=fresh, parked=WaitingQueue(), rules=rules, stopping=False, idle=idle
    )
    share = -(-waiting // (idle + 1))
    assert len(plan.admit) == min(max_batch, share)
    assert plan.wait == (waiting == 0)


@given(st.integers(1, 3), st.integers(0, 3), st.integers(1, 3), st.booleans())
def test_a_busy_worker_beside_an_idle_one_takes_only_its_suspended(
    running: int, fresh_count: int, parked_count: int, urgent: bool
) -> None:
    """L42, L61: while another worker idles, a busy one takes and preempts for no new request."""
    batch = _waiting_jobs(running)
    fresh = _waiting_jobs(fresh_count, key=1 if urgent else 0, priority=2 if urgent else 0)
    parked = _waiting_jobs(parked_count, key=2)
    fresh_queue, parked_queue = _queue(fresh), _queue(parked)
    rules = BoundaryRules(max_batch=8, can_join=True, preempting=True, max_preemptions=1)
    plan = plan_boundary(
        _members(batch), fresh=fresh_queue, parked=parked_queue, rules=rules, stopping=False, idle=1
    )
    assert plan.preempt is None
    assert plan.admit == ()  # the suspended ones have another key than the batch
    assert len(fresh_queue) == fresh_count


def test_a_runner_without_joins_takes_only_into_an_empty_batch() -> None:
    """L60: without joins nothing enters a running batch; a priority empties it (L61)."""
    batch = _waiting_jobs(1)
    [newcomer] = _waiting_jobs(1, priority=1)
    rules = BoundaryRules(max_batch=4, can_join=False, preempting=False, max_preemptions=1)
    plan = plan_boundary(
        _members(batch),
        fresh=_queue([newcomer]),
        parked=WaitingQueue(),
        rules=rules,
        stopping=False,
        idle=0,
    )
    assert plan.keep == tuple(batch) and plan.admit == () and plan.preempt is None
    rules = dataclasses.replace(rules, preempting=True)
    plan = plan_boundary(
        _members(batch),
        fresh=_queue([newcomer]),
        parked=WaitingQueue(),
        rules=rules,
        stopping=False,
        idle=0,
    )
    assert plan.preempt == Preemption(victims=tuple(batch), newcomer=newcomer)


def _batch(*members: tuple[int, int, int, int]) -> RunningBatch:
    """A published batch of members ``(key, priority, preemptions, steps left of 10)``."""
    return RunningBatch(
        members=tuple(
            Member(
                item=f"m{i}", key=key, rank=(-priority, math.inf, i), preemptions=n, stopped=False
            )
            for i, (key, priority, n, _) in enumerate(members)
        ),
        steps=tuple((10 - left, 10) for *_, left in members),
        step_s=1.0,
    )


def test_a_published_batch_says_how_long_a_newcomer_waits() -> None:
    """L61, L62: admission reads a batch by the boundary policy's own rule (``make_room``).

    0 steps when the newcomer would start at the next boundary (an empty batch, a
    free place of its key, members it may preempt); else the batch's steps left
    (its longest member's).
    """
    rules = BoundaryRules(max_batch=2, can_join=True, preempting=True, max_preemptions=1)
    assert _batch().steps_before(key=0, priority=0, rules=rules) == 0
    one = _batch((0, 0, 0, 8))
    assert one.steps_before(key=0, priority=0, rules=rules) == 0  # joins
    assert one.steps_before(key=1, priority=0, rules=rules) == 8  # waits for the batch
    assert one.steps_before(key=1, priority=1, rules=rules) == 0  # suspends the batch
    full = _batch((0, 0, 0, 8), (0, 0, 1, 3))
    assert full.steps_before(key=0, priority=0, rules=rules) == 8  # full: waits
    assert full.steps_before(key=0, priority=1, rules=rules) == 0  # suspends one member
    assert full.steps_before(key=1, priority=1, rules=rules) == 8  # not every member may go
    assert full.steps_left == 8
    off = dataclasses.replace(rules, preempting=False)
    assert full.steps_before(key=0, priority=1, rules=off) == 8
    alone = BoundaryRules(max_batch=1, can_join=False, preempting=False, max_preemptions=0)
    assert _batch((0, 0, 0, 5)).steps_before(key=0, priority=9, rules=alone) == 5
