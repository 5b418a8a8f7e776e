"""Tenants and fair share (L57, L58): the queue's ranking against a model, the shares it
gives, and the order in which an engine starts the requests of several tenants.

Determinism: the queue tests are pure (no engine). The engine tests hold the worker
in a step with a ``RecordingRunner`` while they submit, read the order of starts
from the runner's own ``prepare`` calls, and price requests with
``assume_step_cost`` (a fixed cost per pixel-step), so the order depends on the
requests alone, never on measured step times.
"""

from __future__ import annotations

import itertools
import math
import pickle
from dataclasses import dataclass, field
from fractions import Fraction
from unittest import mock

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import omni_trio as ot
from omni_trio import _queue as queue_module
from omni_trio._fairshare import MAX_TENANT_WEIGHT, MIN_TENANT_WEIGHT, FairShare
from omni_trio._queue import WaitingQueue, take
from omni_trio.testing import assume_step_cost
from tests.support.core import BUDGET, RecordingRunner, req

# -- the queue against a model -------------------------------------------------


class Item:
    """A hashable stand-in for a request."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


@dataclass
class FairModel:
    """Start-time fair queueing, written from docs/design.md ("Scheduling"), by scans.

    Per priority level a virtual time and a tag per tenant; a tenant that starts
    waiting again takes ``max(virtual time, its tag)``; the best waiting request
    is the smallest ``(-priority, tag, deadline, admission)``; taking it moves the
    level's virtual time to its tag and the tag on by ``cost / weight``; a level
    where nothing waits forgets its tags.
    """

    weights: dict[str, float]
    virtual: dict[int, float] = field(default_factory=dict)
    tags: dict[tuple[int, str | None], float] = field(default_factory=dict)
    # (item, priority, tenant, deadline, sequence, cost)
    waiting: list[tuple[Item, int, str | None, float, int, float]] = field(default_factory=list)

    def weight(self, tenant: str | None) -> float:
        return 1.0 if tenant is None else self.weights.get(tenant, 1.0)

    def push(
        self, item: Item, priority: int, tenant: str | None, deadline: float, seq: int, cost: float
    ) -> None:
        if not any(w[1] == priority and w[2] == tenant for w in self.waiting):
            now = self.virtual.setdefault(priority, 0.0)
            self.tags[priority, tenant] = max(now, self.tags.get((priority, tenant), now))
        self.waiting.append((item, priority, tenant, deadline, seq, cost))

    def rank(self, entry: tuple[Item, int, str | None, float, int, float]) -> tuple[object, ...]:
        _, priority, tenant, deadline, seq, _ = entry
        return (-priority, self.tags[priority, tenant], deadline, seq)

    def _gone(self, entry: tuple[Item, int, str | None, float, int, float]) -> None:
        self.waiting.remove(entry)
        priority = entry[1]
        if not any(w[1] == priority for w in self.waiting):
            del self.virtual[priority]
            self.tags = {k: v for k, v in self.tags.items() if k[0] != priority}

    def remove(self, item: Item) -> bool:
        for entry in self.waiting:
            if entry[0] is item:
                self._gone(entry)
                return True
        return False

    def take(self, key_of: dict[Item, int], batch_key: int | None, free: int) -> list[Item]:
        taken: list[Item] = []
        key = batch_key
        while len(taken) < free and self.waiting:
            best = min(self.waiting, key=self.rank)
            item, priority, tenant, _, _, cost = best
            if key is None:
                key = key_of[item]
            elif key_of[item] != key:
                break
            start = self.tags[priority, tenant]
            self.virtual[priority] = max(self.virtual[priority], start)
            self.tags[priority, tenant] = start + cost / self.weight(tenant)
            self._gone(best)
            taken.append(item)
        return taken


_tenants = st.sampled_from([None, "a", "b", "c"])
fair_ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("push"),
            st.tuples(
                st.integers(0, 1),  # priority
                _tenants,
                st.sampled_from([math.inf, math.inf, 1.0, 2.0]),  # deadline
                st.sampled_from([1.0, 2.0, 5.0, 0.5]),  # cost
                st.integers(0, 1),  # batch key
                st.booleans(),  # into the second queue (a worker's parked one)
            ),
        ),
        st.tuples(st.just("remove"), st.integers(0, 300)),
        st.tuples(
            st.just("take"),
            st.tuples(st.sampled_from([None, 0, 1]), st.integers(0, 3)),
        ),
    ),
    max_size=80,
)


@settings(max_examples=300)
@given(
    fair_ops,
    st.sampled_from([{}, {"a": 3.0}, {"a": 0.5, "b": 2.0}]),
    st.sampled_from([0, queue_module._MIN_REBUILD]),
)
def test_queue_matches_the_fair_share_model(
    operations: list[tuple[str, object]], weights: dict[str, float], rebuild: int
) -> None:
    """L57: take returns the best by (-priority, tenant's tag, deadline, admission), charging
    each tenant its cost over its weight, from two queues that share one ``FairShare``.

    The model scans a list; the queues keep heaps of tenants' heads that are
    refreshed lazily. They must agree at every take, and ``drain`` must give the
    model's order. With ``rebuild`` 0 the heaps are rebuilt at every withdrawal or
    take that leaves more withdrawn entries than waiting ones.
    """
    share = FairShare(weights)
    queues: tuple[WaitingQueue[Item], WaitingQueue[Item]] = (
        WaitingQueue(share),
        WaitingQueue(share),
    )
    model = FairModel(weights)
    with mock.patch.object(queue_module, "_MIN_REBUILD", rebuild):
        _replay(operations, queues, model, share)


def _replay(
    operations: list[tuple[str, object]],
    queues: tuple[WaitingQueue[Item], WaitingQueue[Item]],
    model: FairModel,
    share: FairShare,
) -> None:
    created: list[Item] = []
    key_of: dict[Item, int] = {}
    sequence = itertools.count()
    for op, arg in operations:
        if op == "push":
            assert isinstance(arg, tuple)
            priority, tenant, deadline, cost, key, second = arg
            item = Item(f"i{len(created)}")
            created.append(item)
            key_of[item] = key
            seq = next(sequence)
            queues[second].push(
                item,
                key,
                priority=priority,
                deadline=deadline,
                sequence=seq,
                tenant=tenant,
                cost=cost,
            )
            model.push(item, priority, tenant, deadline, seq, cost)
        elif op == "remove":
            assert isinstance(arg, int)
            if created:
                item = created[arg % len(created)]
                removed = queues[0].remove(item) or queues[1].remove(item)
                assert removed == model.remove(item)
        else:
            assert isinstance(arg, tuple)
            batch_key, free = arg
            got = take(queues, batch_key=batch_key, free=free, can_join=True)
            assert got == model.take(key_of, batch_key, free)
        assert len(queues[0]) + len(queues[1]) == len(model.waiting)
    expected = [entry[0] for entry in sorted(model.waiting, key=model.rank)]
    drained = queues[0].drain() + queues[1].drain()
    assert sorted(drained, key=expected.index) == expected
    for tenant in (None, "a", "b", "c"):
        assert share.waiting(tenant) == 0


def test_a_rebuild_keeps_each_tenants_order() -> None:
    """L57, L62: once withdrawn entries outnumber the waiting ones the heaps are rebuilt
    from the waiting items, in admission order, and still give each tenant's earliest
    deadline first, and the tenants in their tags' order."""
    queue: WaitingQueue[Item] = WaitingQueue(FairShare())
    late, soon, other = Item("late"), Item("soon"), Item("other")
    gone = [Item(f"gone{i}") for i in range(4)]
    queue.push(late, 0, tenant="a", cost=1.0)
    for item in gone:
        queue.push(item, 0, tenant="a", deadline=0.5, cost=1.0)
    queue.push(soon, 0, tenant="a", deadline=1.0, cost=1.0)
    queue.push(other, 0, tenant="b", cost=1.0)
    with mock.patch.object(queue_module, "_MIN_REBUILD", 0):
        for item in gone:
            assert queue.remove(item)
        assert queue._held == len(queue)  # rebuilt: no withdrawn entry left
        assert queue.take(batch_key=None, free=3, can_join=True) == [soon, other, late]


arrivals = st.lists(st.sampled_from([0.5, 1.0, 2.0, 4.0]), min_size=1, max_size=40)


@settings(max_examples=200)
@given(arrivals, arrivals, st.sampled_from([1.0, 2.0, 3.0]))
def test_backlogged_tenants_share_step_seconds_by_weight(
    heavy: list[float], light: list[float], weight: float
) -> None:
    """L57: while two tenants both wait, the step-seconds each was served, over its
    weight, differ by at most one request's cost over its weight (the fair-queueing
    bound), whatever the number and the costs of the requests each sends.

    Tenant "a" (``weight``) and "b" (1) each queue their requests, of the
    generated costs, all at once; the worker takes one at a time.
    """
    share = FairShare({"a": weight})
    queue: WaitingQueue[Item] = WaitingQueue(share)
    for tenant, costs in (("a", heavy), ("b", light)):
        for index, cost in enumerate(costs):
            queue.push(Item(f"{tenant}{index}"), 0, tenant=tenant, cost=cost)
    cost_of = {f"{t}{i}": c for t, cs in (("a", heavy), ("b", light)) for i, c in enumerate(cs)}
    served = {"a": 0.0, "b": 0.0}
    left = {"a": len(heavy), "b": len(light)}
    bound = max(heavy) / weight + max(light)
    while all(left.values()):
        (item,) = queue.take(batch_key=None, free=1, can_join=True)
        tenant = item.name[0]
        served[tenant] += cost_of[item.name]
        left[tenant] -= 1
        assert abs(served["a"] / weight - served["b"]) <= bound


def test_a_tenant_that_returns_from_idle_saves_nothing_up() -> None:
    """L57: a tenant that waited for nothing while others were served restarts at the
    level's virtual time: it is not owed the time it spent idle."""
    share = FairShare()
    queue: WaitingQueue[Item] = WaitingQueue(share)
    first = [Item(f"a{i}") for i in range(6)]
    for item in first:
        queue.push(item, 0, tenant="a", cost=1.0)
    assert queue.take(batch_key=None, free=4, can_join=True) == first[:4]
    late = [Item(f"b{i}") for i in range(3)]
    for item in late:
        queue.push(item, 0, tenant="b", cost=1.0)
    # "b" starts at the virtual time (a3's tag, 3), "a" is at 4: b0 first, then
    # alternating, not three of "b" in a row.
    got = queue.take(batch_key=None, free=5, can_join=True)
    assert got == [late[0], first[4], late[1], first[5], late[2]]


def test_a_suspended_request_taken_again_moves_no_tag_nor_the_virtual_time() -> None:
    """L57, L61: a suspended request comes back with cost 0 (it was charged when first
    taken); taking it again moves neither its tenant's tag nor the level's virtual
    time, so a tenant that starts waiting after it starts where it would have."""
    share = FairShare()
    queue: WaitingQueue[Item] = WaitingQueue(share)
    a = [Item(f"a{i}") for i in range(3)]
    b0, c0 = Item("b0"), Item("c0")
    for item in a:
        queue.push(item, 0, tenant="a", cost=4.0)
    queue.push(b0, 0, tenant="b", cost=1.0)
    assert queue.take(batch_key=None, free=1, can_join=True) == [a[0]]  # a's tag 4
    parked: WaitingQueue[Item] = WaitingQueue(share)
    parked.push(a[0], 0, tenant="a", sequence=0)  # suspended: back with cost 0
    # b0 (tag 0) first, then a0 (tag 4, admitted first of "a"): the virtual time
    # stays at b0's start, 0.
    assert take((queue, parked), batch_key=None, free=2, can_join=True) == [b0, a[0]]
    assert share.tag(0, "a") == 4.0
    queue.push(c0, 0, tenant="c", cost=1.0)
    # "c" starts at the virtual time (0), not at a's tag (4): c0 before a1.
    assert queue.take(batch_key=None, free=2, can_join=True) == [c0, a[1]]


def test_an_idle_tenant_ahead_of_the_virtual_time_restarts_at_the_later_of_the_two() -> None:
    """L57: a tenant served a large request then idle keeps its tag while it is ahead of
    the virtual time, and restarts at the virtual time once that passed it."""
    queue: WaitingQueue[Item] = WaitingQueue(FairShare())
    big, *small = [Item("a0"), *(Item(f"b{i}") for i in range(10))]
    queue.push(big, 0, tenant="a", cost=5.0)
    for item in small:
        queue.push(item, 0, tenant="b", cost=1.0)
    # a0 (tag 0, then 5; idle), then b0..b6 at tags 0..6: the virtual time is 6.
    assert queue.take(batch_key=None, free=8, can_join=True) == [big, *small[:7]]
    newcomer, back = Item("c0"), Item("a1")
    queue.push(newcomer, 0, tenant="c", cost=1.0)  # tag 6, the virtual time
    queue.push(back, 0, tenant="a", cost=1.0)  # max(6, 5): tied with c0, admitted later
    assert queue.take(batch_key=None, free=3, can_join=True) == [newcomer, back, small[7]]


# -- validation ----------------------------------------------------------------


def test_tenant_defaults_to_none_and_is_validated() -> None:
    """L58: ``tenant`` is ``None`` (the default tenant) or a short text, refused by name."""
    assert ot.GenerationRequest().tenant is None
    assert ot.GenerationRequest(tenant="acme").tenant == "acme"
    for bad in ("", "x" * 257, "a\x00b", 7, b"acme"):
        with pytest.raises(ot.InvalidRequestError) as info:
            ot.GenerationRequest(tenant=bad)  # type: ignore[arg-type]
        assert info.value.field == "tenant"


@pytest.mark.parametrize(
    ("weights", "message"),
    [
        ({"a": 0}, "must be >= 0.001"),
        ({"a": -1.0}, "must be >= 0.001"),
        ({"a": 1e-20}, "must be >= 0.001"),
        ({"a": math.nextafter(MIN_TENANT_WEIGHT, 0.0)}, "must be >= 0.001"),
        ({"a": math.nextafter(MAX_TENANT_WEIGHT, math.inf)}, "must be <= 1000"),
        ({"a": 10**7}, "must be <= 1000"),
        ({"a": math.inf}, "finite"),
        ({"a": math.nan}, "finite"),
        ({"a": True}, "number"),
        ({1: 1.0}, "names must be str"),
        ({"": 1.0}, "1 to 256"),
        ([("a", 1.0)], "mapping"),
    ],
)
def test_bad_tenant_weights_are_refused_at_construction(weights: object, message: str) -> None:
    """L58: weights are numbers from ``MIN_TENANT_WEIGHT`` (0.001) to ``MAX_TENANT_WEIGHT``
    (1000) per tenant name; anything else is refused, naming the field."""
    with pytest.raises(ValueError, match=r"^tenant_weights") as info:
        ot.EngineConfig(tenant_weights=weights)  # type: ignore[arg-type]
    assert message in str(info.value)


def test_weights_at_the_bounds_are_kept() -> None:
    """L58: the bounds themselves are weights; an int is stored as a float."""
    weights = {"light": MIN_TENANT_WEIGHT, "heavy": 1000, "mid": 2.5}
    config = ot.EngineConfig(tenant_weights=weights)
    assert dict(config.tenant_weights) == {"light": 0.001, "heavy": 1000.0, "mid": 2.5}
    assert type(config.tenant_weights["heavy"]) is float


def _increments(weights: dict[str, float], alone: int, cost: float) -> list[Fraction]:
    """The exact increments of "heavy"'s tag, each over what it should be (1: exact).

    "light" is served ``alone`` requests of ``cost`` with no one else waiting (the
    level's virtual time follows its tag, ``alone x cost / weight``), then "heavy"
    and the default tenant start waiting at that virtual time with requests of 1,
    the queue serving all three.
    """
    share = FairShare(weights)
    queue: WaitingQueue[Item] = WaitingQueue(share)
    for index in range(alone + 1):  # one stays waiting: the level keeps its clock
        queue.push(Item(f"light{index}"), 0, tenant="light", cost=cost)
    assert len(queue.take(batch_key=None, free=alone, can_join=True)) == alone
    for index in range(20):
        queue.push(Item(f"heavy{index}"), 0, tenant="heavy", cost=1.0)
        queue.push(Item(f"none{index}"), 0, tenant=None, cost=1.0)
    ratios: list[Fraction] = []
    for _ in range(20):
        before = Fraction(share.tag(0, "heavy"))
        (item,) = queue.take(batch_key=None, free=1, can_join=True)
        if item.name.startswith("heavy"):
            got = Fraction(share.tag(0, "heavy")) - before
            ratios.append(got / (Fraction(1) / Fraction(weights["heavy"])))
    return ratios


def test_at_the_weight_bounds_no_cost_is_lost_to_rounding() -> None:
    """L57, L58: fair share adds ``cost / weight`` to tags in float64, which rounds each
    sum to about 2**-53 of the tag: a cost ``r`` times smaller than the tag keeps a
    relative error of at most ``r x 2**-53``. The bounds hold the weights' part of ``r``
    to ``MAX_TENANT_WEIGHT / MIN_TENANT_WEIGHT`` (1e6): here the lightest tenant,
    served alone, puts the clock at 1e6 x 1,000 x 1,000 times the heaviest tenant's
    costs, and each of those still counts to 1e-3. A weight of 1e-20 (refused now)
    put the clock at 1e20 by its second request, and every later cost was lost."""
    bounded = _increments({"light": MIN_TENANT_WEIGHT, "heavy": MAX_TENANT_WEIGHT}, 1000, 1000.0)
    assert bounded and all(abs(ratio - 1) <= Fraction(1, 1000) for ratio in bounded)
    unbounded = _increments({"light": 1e-20, "heavy": MAX_TENANT_WEIGHT}, 2, 1.0)
    assert unbounded and all(ratio == 0 for ratio in unbounded)


def test_tenant_tables_are_frozen_copies() -> None:
    """L58: the config keeps read-only copies: changing the caller's dict changes nothing;
    it still hashes and pickles."""
    weights = {"a": 2}
    limits = {"a": 3}
    config = ot.EngineConfig(tenant_weights=weights, tenant_max_waiting=limits)
    weights["a"] = 5
    limits["b"] = 1
    assert dict(config.tenant_weights) == {"a": 2.0}
    assert dict(config.tenant_max_waiting) == {"a": 3}
    with pytest.raises(TypeError):
        config.tenant_weights["a"] = 1.0  # type: ignore[index]
    # Hashable and picklable (a Ray replica's options travel pickled).
    assert hash(config) == hash(
        ot.EngineConfig(tenant_weights={"a": 2.0}, tenant_max_waiting={"a": 3})
    )
    assert pickle.loads(pickle.dumps(config)) == config
    with pytest.raises(ValueError, match="tenant_max_waiting"):
        ot.EngineConfig(tenant_max_waiting={"a": 0})


# -- the engine ----------------------------------------------------------------

#: One pixel-step costs this: a 16 x 16 request of 3 steps costs 3.0 exactly.
PIXEL_S = 1 / 256


async def _starts(
    submissions: list[tuple[str, ot.GenerationRequest]], config: ot.EngineConfig
) -> list[str]:
    """The order in which a one-at-a-time engine starts ``submissions``, all waiting at once."""
    runner = RecordingRunner()
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner, config) as engine:
            assume_step_cost(engine, PIXEL_S)
            busy = engine.submit(req(), request_id="busy")
            await runner.wait_arrived(1)
            handles = [busy]
            handles += [engine.submit(request, request_id=name) for name, request in submissions]
            runner.open_gate()
            for handle in handles:
                async with handle:
                    await handle.result()
    assert runner.prepared[0] == "busy"
    return runner.prepared[1:]


ONE_AT_A_TIME = ot.EngineConfig(max_batch_size=1, preemption=False)


@pytest.mark.anyio
async def test_a_flooding_tenant_delays_another_by_its_share_only() -> None:
    """L57: ten requests of "heavy" then three of "light", equal weights and costs: they
    start alternately, not light's after all of heavy's (FIFO)."""
    heavy = [(f"h{i}", req(tenant="heavy")) for i in range(10)]
    light = [(f"l{i}", req(tenant="light")) for i in range(3)]
    order = await _starts(heavy + light, ONE_AT_A_TIME)
    assert order == ["h0", "l0", "h1", "l1", "h2", "l2", *(f"h{i}" for i in range(3, 10))]


@pytest.mark.anyio
async def test_weights_share_device_time_three_to_one() -> None:
    """L57, L58: with weights 3:1 (``EngineConfig.tenant_weights``), "a" starts three
    requests for each of "b"'s while both wait."""
    config = ot.EngineConfig(max_batch_size=1, preemption=False, tenant_weights={"a": 3})
    first = [(f"a{i}", req(tenant="a")) for i in range(9)]
    second = [(f"b{i}", req(tenant="b")) for i in range(3)]
    order = await _starts(first + second, config)
    assert [name[0] for name in order[:8]] == list("abaaabaa")
    assert order.index("b2") < order.index("a8")


@pytest.mark.anyio
async def test_shares_count_step_seconds_not_requests() -> None:
    """L57: a request four times the pixels costs four times the step-seconds: "big"
    (32 x 32) starts one request for every four of "small" (16 x 16)."""
    big = [(f"B{i}", req(tenant="big", height=32, width=32)) for i in range(3)]
    small = [(f"s{i}", req(tenant="small")) for i in range(9)]
    order = await _starts(big + small, ONE_AT_A_TIME)
    assert order[:7] == ["B0", "s0", "s1", "s2", "s3", "B1", "s4"]


@pytest.mark.anyio
async def test_priorities_rank_above_fair_share() -> None:
    """L57, L60: the flooding tenant's urgent request still goes first: fair share
    orders tenants only within a priority level."""
    heavy = [(f"h{i}", req(tenant="heavy")) for i in range(3)]
    urgent = [("u", req(tenant="heavy", priority=1))]
    light = [("l", req(tenant="light"))]
    order = await _starts(heavy + light + urgent, ONE_AT_A_TIME)
    assert order == ["u", "h0", "l", "h1", "h2"]


@pytest.mark.anyio
async def test_within_a_tenant_the_earliest_deadline_goes_first() -> None:
    """L57, L62: inside a tenant, EDF then FIFO; fair share decides between tenants."""
    requests = [
        ("a-late", req(tenant="a", deadline_s=900.0)),
        ("a-none", req(tenant="a")),
        ("a-soon", req(tenant="a", deadline_s=600.0)),
        ("b", req(tenant="b")),
    ]
    order = await _starts(requests, ONE_AT_A_TIME)
    assert order == ["a-soon", "b", "a-late", "a-none"]


@pytest.mark.anyio
async def test_a_tenant_over_its_waiting_limit_is_refused_others_are_not() -> None:
    """L56, L58: ``tenant_max_waiting`` bounds one tenant's waiting requests
    (``QueueFullError``, naming the tenant); other tenants still get in."""
    runner = RecordingRunner()
    config = ot.EngineConfig(max_batch_size=1, tenant_max_waiting={"a": 2})
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner, config) as engine:
            handles = [engine.submit(req(tenant="a"), request_id="run")]
            await runner.wait_arrived(1)  # running, not waiting: not counted
            handles += [engine.submit(req(tenant="a")) for _ in range(2)]
            with pytest.raises(ot.QueueFullError, match="tenant 'a'"):
                engine.submit(req(tenant="a"))
            handles += [engine.submit(req(tenant="b")) for _ in range(3)]
            handles.append(engine.submit(req()))
            runner.open_gate()
            for handle in handles:
                async with handle:
                    await handle.result()
