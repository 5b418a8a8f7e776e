"""The pure waiting queue and boundary policy: property tests over generated inputs.

Determinism: no threads, no event loop; Hypothesis drives plain method calls and
checks them against simple models (a sorted list; the lifecycle machine's worker
model for the boundary policy).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import omni_trio as ot
from omni_trio import _queue as queue_module
from omni_trio import _stepsums as stepsums_module
from omni_trio._fairshare import FairShare
from omni_trio._queue import WaitingQueue
from omni_trio._scheduler import (
    NO_STEPS,
    BoundaryRules,
    Member,
    Preemption,
    RecentSteps,
    RunningBatch,
    fair_victim,
    make_room,
    plan_boundary,
)
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
    # Tenant preemption (L61 amended): on or off, the weights, and the worker's
    # last full batch steps, each its members' (priority, tenant).
    tenant_preemption: bool
    weights: dict[str, float]
    recent: list[tuple[tuple[int, str | None], ...]]


_tenants = st.sampled_from([None, "a", "b"])


def _job(
    where: str,
    priority: int,
    key: int,
    deadline: float,
    admission: int,
    tenant: str | None = None,
) -> Job:
    request = ot.GenerationRequest(height=8 * (1 + key), width=8, priority=priority, tenant=tenant)
    return Job(f"j{admission}", request, (-priority, deadline, admission), where=where)  # type: ignore[arg-type]


@st.composite
def boundaries(draw: st.DrawFn, *, tenants: bool = False) -> Boundary:
    """A batch of one key (at most ``max_batch``), some of its tokens set, and queues.

    ``tenants``: what tenant preemption needs (L61 amended), most of the time: a
    full batch and queues at one priority, preempting, not stopping.
    """
    levels = st.just(0) if tenants else st.sampled_from([0, 1, 2])
    # Tenant "a" floods the batch, most of the time, and the others wait.
    seated = st.sampled_from(["a", "a", "a", None, "b"]) if tenants else _tenants
    max_batch = draw(st.integers(2, 4) if tenants else st.integers(1, 3))
    key = draw(st.integers(0, 1))
    admissions = itertools.count()
    running: list[Job] = []
    # A full batch half the time: what preemption needs for a newcomer that could join.
    full = st.just(max_batch)
    for _ in range(draw(full if tenants else full | st.integers(0, max_batch))):
        job = _job("running", draw(levels), key, draw(_deadlines), next(admissions), draw(seated))
        job.preemptions = draw(st.sampled_from([0, 1]))
        # Only a running member waits for a boundary to see its token: a waiting
        # one is withdrawn at once (L6).
        job.token = draw(st.sampled_from([None] * (7 if tenants else 3) + ["user"]))
        running.append(job)
    # Hypothesis draws the first of a ``sampled_from`` more often: waiting priorities
    # lean higher than running ones (preemption needs a better newcomer), and most
    # boundaries preempt if they should, and do not stop.
    waiting = st.tuples(
        st.just(0) if tenants else st.sampled_from([2, 1, 0]),
        st.sampled_from([key, key, 1 - key] if tenants else [0, 1]),
        _deadlines,
        _tenants,
    )
    fresh = [
        _job("fresh", *spec[:3], next(admissions), spec[3])
        for spec in draw(st.lists(waiting, min_size=1, max_size=4))
    ]
    parked = [
        _job("parked", *spec[:3], next(admissions), spec[3])
        for spec in draw(st.lists(waiting, max_size=3))
    ]
    for job in parked:
        job.preemptions = draw(st.integers(1, 2))
    # Drawn admission order is not rank order: shuffle who was admitted first.
    order = draw(st.permutations(range(len(running) + len(fresh) + len(parked))))
    for job, admission in zip([*running, *fresh, *parked], order, strict=True):
        job.rank = (*job.rank[:2], admission)
    # The worker's last full steps: its members' priorities and tenants, often this
    # batch's own.
    step = st.lists(st.tuples(levels, seated), min_size=max_batch, max_size=max_batch).map(tuple)
    if len(running) == max_batch:
        step |= st.just(tuple((job.priority, job.tenant) for job in running))
    return Boundary(
        max_batch=max_batch,
        max_preemptions=draw(st.sampled_from([1, 2] if tenants else [1, 2, 0])),
        preempting=draw(st.sampled_from([True] if tenants else [True, True, True, False])),
        stopping=draw(st.sampled_from([False] * 7 + [True])),
        running=running,
        fresh=fresh,
        parked=parked,
        tenant_preemption=draw(st.sampled_from([True, False])),
        weights=draw(_weights),
        recent=draw(st.lists(step, max_size=4)),
    )


def _queue(jobs: list[Job], share: FairShare | None = None) -> WaitingQueue[Job]:
    """The jobs waiting, charged what the worker model charges (a pixel-step costs 1)."""
    queue: WaitingQueue[Job] = WaitingQueue(share)
    for job in jobs:
        queue.push(
            job,
            job.key,
            priority=job.priority,
            deadline=job.rank[1],
            sequence=job.rank[2],
            tenant=job.tenant,
            cost=0.0 if job.where == "parked" else job.cost(1.0),
        )
    return queue


def _members(jobs: list[Job]) -> list[Member[Job]]:
    return [
        Member(
            item=job,
            key=job.key,
            rank=job.rank,
            preemptions=job.preemptions,
            stopped=job.token is not None,
            tenant=job.tenant,
        )
        for job in jobs
    ]


@settings(max_examples=500)
@given(boundaries() | boundaries(tenants=True))
def test_boundary_plan_agrees_with_the_worker_model(boundary: Boundary) -> None:
    """L7, L32, L57, L60, L61: the plan drops, suspends and admits what the worker model
    does, between tenants too (L61 amended: their places now and in the last steps)."""
    running, fresh, parked = boundary.running, boundary.fresh, boundary.parked
    jobs = [*running, *fresh, *parked]
    share = FairShare(boundary.weights)
    fresh_queue, parked_queue = _queue(fresh, share), _queue(parked, share)
    rules = BoundaryRules(
        max_batch=boundary.max_batch,
        can_join=True,
        preempting=boundary.preempting,
        max_preemptions=boundary.max_preemptions,
        tenant_preemption=boundary.tenant_preemption,
        weights=boundary.weights,
    )
    recent = RecentSteps(boundary.max_batch)
    for step in boundary.recent:
        recent.ran(step)
    plan = plan_boundary(
        _members(running),
        fresh=fresh_queue,
        parked=parked_queue,
        rules=rules,
        stopping=boundary.stopping,
        idle=0,
        recent=recent.view(),
    )
    # Without preemption the model is a worker whose members may never be suspended.
    model = WorkerModel(
        max_batch=boundary.max_batch,
        max_preemptions=boundary.max_preemptions if boundary.preempting else 0,
        fresh=list(fresh),
        parked=list(parked),
        running=list(running),
        stopping=boundary.stopping,
        weights=boundary.weights,
        tenant_preemption=boundary.tenant_preemption,
        recent=deque(boundary.recent),
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


def _tenant_rules(weights: dict[str, float], *, max_batch: int = 4) -> BoundaryRules:
    return BoundaryRules(
        max_batch=max_batch,
        can_join=True,
        preempting=True,
        max_preemptions=1,
        tenant_preemption=True,
        weights=weights,
    )


def _seated(tenants: Sequence[str | None], *, priority: int = 0) -> list[Member[str]]:
    """A batch of one key and priority, member ``i`` of ``tenants[i]``, admitted in order."""
    return [
        Member(
            item=f"{tenant}{i}",
            key=0,
            rank=(-priority, math.inf, i),
            preemptions=0,
            stopped=False,
            tenant=tenant,
        )
        for i, tenant in enumerate(tenants)
    ]


@pytest.mark.parametrize(
    ("weights", "settled"),
    [({}, (2, 2)), ({"heavy": 3.0}, (3, 1)), ({"light": 3.0}, (1, 3))],
)
def test_a_full_batch_moves_places_to_another_tenant_up_to_the_weights(
    weights: dict[str, float], settled: tuple[int, int]
) -> None:
    """L61 amended, L57: newcomers of "light" take places of a batch "heavy" fills,
    one per boundary, the lowest-ranked first, until the places match the weights;
    then they wait, and "heavy"'s newcomers never take a place back."""
    rules = _tenant_rules(weights)
    members = _seated(["heavy"] * 4)
    admitted = itertools.count(4)
    while (victim := fair_victim(members, priority=0, tenant="light", rules=rules)) is not None:
        [given_up] = [member for member in members if member.item == victim]
        assert given_up.rank == max(m.rank for m in members if m.tenant == "heavy")
        members.remove(given_up)
        members += _seated(["light"])
        members[-1] = dataclasses.replace(members[-1], rank=(0, math.inf, next(admitted)))
    held = tuple(sum(m.tenant == tenant for m in members) for tenant in ("heavy", "light"))
    assert held == settled
    assert fair_victim(members, priority=0, tenant="heavy", rules=rules) is None


def test_the_window_counts_the_last_full_steps_only() -> None:
    """L61 amended: ``RecentSteps`` keeps the last ``size`` full batch steps, each
    member's priority and tenant once per step, and at each priority the steps that
    ran it; a step of fewer members is not one."""
    recent = RecentSteps(2, size=2)
    assert recent.view() is NO_STEPS
    recent.ran([(0, "a")])
    assert recent.view() is NO_STEPS
    for step in ([(0, "a"), (0, "a")], [(0, "a"), (1, "b")], [(0, None), (1, "b")]):
        recent.ran(step)
    view = recent.view()
    assert (view.steps(0), view.steps(1), view.steps(2)) == (2, 2, 0)
    assert dict(view.held) == {(0, "a"): 1, (1, "b"): 2, (0, None): 1}
    assert (view.places(0, "a"), view.places(0, "b"), view.places(1, "b")) == (1, 0, 2)


def test_a_tenant_that_ran_little_lately_takes_more_than_its_share_for_a_while() -> None:
    """L61 amended: places are counted over the window too. After ten full steps of
    "heavy" alone, "light"'s newcomers take every place of the batch (its share of
    the window is still far below its weight's), and "heavy"'s never take one
    back; after ten full steps of "light" alone, "light" takes none from a batch
    "heavy" fills."""
    rules = _tenant_rules({})
    recent = RecentSteps(4)
    for _ in range(10):
        recent.ran([(0, "heavy")] * 4)
    members = _seated(["heavy"] * 4)
    admitted = itertools.count(4)
    while (
        victim := fair_victim(
            members, priority=0, tenant="light", rules=rules, recent=recent.view()
        )
    ) is not None:
        members = [m for m in members if m.item != victim]
        members.append(
            dataclasses.replace(_seated(["light"])[0], rank=(0, math.inf, next(admitted)))
        )
    assert [m.tenant for m in members] == ["light"] * 4
    assert (
        fair_victim(members, priority=0, tenant="heavy", rules=rules, recent=recent.view()) is None
    )
    # Without the window the same batch settles at the weights' share, 2:2.
    assert (
        fair_victim(_seated(["heavy"] * 2 + ["light"] * 2), priority=0, tenant="light", rules=rules)
        is None
    )
    busy = RecentSteps(4)
    for _ in range(10):
        busy.ran([(0, "light")] * 4)
    full = _seated(["heavy"] * 4)
    assert fair_victim(full, priority=0, tenant="light", rules=rules, recent=busy.view()) is None
    # Another priority's steps do not count: after them the batch's places decide.
    other = RecentSteps(4)
    for _ in range(10):
        other.ran([(1, "light")] * 4)
    assert (
        fair_victim(full, priority=0, tenant="light", rules=rules, recent=other.view()) == "heavy3"
    )


def test_tenant_preemption_needs_another_tenant_its_priority_and_a_suspendable_member() -> None:
    """L61 amended: never for the newcomer's own tenant, another priority, a member
    suspended ``max_preemptions`` times, or with ``tenant_preemption`` off."""
    rules = _tenant_rules({})
    full = _seated(["heavy"] * 4)
    assert fair_victim(full, priority=0, tenant="light", rules=rules) == "heavy3"
    assert fair_victim(full, priority=0, tenant=None, rules=rules) == "heavy3"
    assert fair_victim(full, priority=0, tenant="heavy", rules=rules) is None
    assert fair_victim(_seated([None] * 4), priority=0, tenant=None, rules=rules) is None
    assert fair_victim(full, priority=1, tenant="light", rules=rules) is None
    assert (
        fair_victim(_seated(["heavy"] * 4, priority=1), priority=0, tenant="x", rules=rules) is None
    )
    worn = [dataclasses.replace(member, preemptions=1) for member in full]
    assert fair_victim(worn, priority=0, tenant="light", rules=rules) is None
    worn[0] = full[0]
    assert fair_victim(worn, priority=0, tenant="light", rules=rules) == "heavy0"
    off = dataclasses.replace(rules, tenant_preemption=False)
    assert fair_victim(full, priority=0, tenant="light", rules=off) is None
    # One place each is every tenant's share: nobody gives one up.
    assert fair_victim(_seated(["a", "b", "c", "d"]), priority=0, tenant="e", rules=rules) is None
    # Of two tenants equally over, the one whose member ranks lowest.
    pair = _seated(["a", "a", "b", "b"])
    assert fair_victim(pair, priority=0, tenant="e", rules=_tenant_rules({})) == "b3"
    pair = _seated(["a", "a", "b", "b", "a", "b"])
    assert fair_victim(pair, priority=0, tenant="e", rules=_tenant_rules({}, max_batch=6)) == "b5"


_places = st.lists(st.sampled_from(["a", "b", "c", None]), min_size=1, max_size=6)
_weights = st.fixed_dictionaries(
    {}, optional={name: st.sampled_from([0.5, 1.0, 2.0, 3.0]) for name in ("a", "b", "c")}
)


@given(_places, _weights, st.lists(st.sampled_from(["a", "b", "c", None]), max_size=30))
def test_places_moved_between_tenants_never_go_back_and_forth(
    seated: list[str | None], weights: dict[str, float], arrivals: list[str | None]
) -> None:
    """L61 amended: every move lowers the sum over tenants of places² over weight
    (the newcomer's tenant ends at most as far over as the giver), so no sequence of
    newcomers moves places in a cycle, and no tenant gives to itself."""
    rules = _tenant_rules(weights, max_batch=len(seated))
    members = _seated(seated)

    def spread() -> float:
        tenants = {member.tenant for member in members}
        held = {t: sum(m.tenant == t for m in members) for t in tenants}
        return sum(count**2 / rules.weight(t) for t, count in held.items())

    for n, tenant in enumerate(arrivals):
        victim = fair_victim(members, priority=0, tenant=tenant, rules=rules)
        if victim is None:
            continue
        [given_up] = [member for member in members if member.item == victim]
        assert given_up.tenant != tenant
        before = spread()
        members.remove(given_up)
        members.append(
            Member(
                item=f"new{n}",
                key=0,
                rank=(0, math.inf, 100 + n),
                preemptions=0,
                stopped=False,
                tenant=tenant,
            )
        )
        assert spread() < before


@given(
    st.lists(
        st.tuples(st.sampled_from(["a", "b", None]), st.sampled_from([0, 1]), st.integers(0, 1)),
        min_size=1,
        max_size=4,
    ),
    st.sampled_from(["a", "b", None]),
    st.sampled_from([0, 1]),
    _weights,
    st.booleans(),
)
def test_tenant_preemption_agrees_with_the_worker_model(
    seated: list[tuple[str | None, int, int]],
    tenant: str | None,
    priority: int,
    weights: dict[str, float],
    on: bool,
) -> None:
    """L61 amended, L57: in a full batch, ``make_room`` suspends whom the worker model does."""
    running = []
    for admission, (owner, level, preemptions) in enumerate(seated):
        request = ot.GenerationRequest(height=8, width=8, priority=level, tenant=owner)
        job = Job(f"j{admission}", request, (-level, math.inf, admission), where="running")
        job.preemptions = preemptions
        running.append(job)
    request = ot.GenerationRequest(height=8, width=8, priority=priority, tenant=tenant)
    newcomer = Job("new", request, (-priority, math.inf, len(seated)))
    rules = dataclasses.replace(
        _tenant_rules(weights, max_batch=len(seated)), max_preemptions=1, tenant_preemption=on
    )
    members = [
        dataclasses.replace(member, tenant=job.tenant)
        for member, job in zip(_members(running), running, strict=True)
    ]
    room = make_room(members, key=newcomer.key, priority=priority, tenant=tenant, rules=rules)
    model = WorkerModel(
        max_batch=len(seated),
        max_preemptions=1,
        running=list(running),
        weights=weights,
        tenant_preemption=on,
    )
    model.admit(newcomer)
    started = model._preempt(newcomer)
    assert started == bool(room)
    assert set(room or ()) == {job for job in running if job.where == "parked"}


def test_a_published_batch_lets_another_tenant_start_at_the_next_boundary() -> None:
    """L61 amended, L62: admission's estimate reads tenant preemption by the same rule."""
    batch = RunningBatch(
        members=tuple(_seated(["heavy", "heavy"])), steps=((2, 10), (4, 10)), step_s=1.0
    )
    rules = _tenant_rules({}, max_batch=2)
    assert batch.steps_before(key=0, priority=0, tenant="light", rules=rules) == 0
    assert batch.steps_before(key=0, priority=0, tenant="heavy", rules=rules) == 8
    off = dataclasses.replace(rules, tenant_preemption=False)
    assert batch.steps_before(key=0, priority=0, tenant="light", rules=off) == 8
