"""Chaos soak: a thousand requests of every fate on one batching engine; nothing leaks.

Determinism rules:

- a seeded ``random.Random`` gives each request its size (8..32 px, multiples of
  8), step count (1..8), seed and fate: complete, abort (three ways), leave the
  handle early, cancel the task waiting in ``result()``, a ``fail_after``-style
  deadline, a runner failure (in prepare, at a step, or in decode), or a dropped
  handle. The interleavings come from real concurrency (32 consumers at once on
  an instant ``FakeRunner`` with ``max_batch_size`` 4), so they vary from run to
  run; every check below holds for any interleaving.
- each consumer has a hang budget and the whole soak another; deadlines use real
  time (a few milliseconds) because their point is to land at arbitrary moments.
- leaks are counted exactly, never measured: after the soak, with the engine
  closed and after ``gc.collect()``, no object of any request (record, handle,
  runner state, event, output, error) is alive, no tensor made during the soak
  is alive, and no thread started during the soak is alive (but the event loop's
  own daemon helpers). Resident memory is not asserted (it depends on the
  allocator and on the rest of the suite); the leak benchmark (``benchmarks/leak.py``)
  measures it.
- it runs on trio and on asyncio, a few seconds each on a 2-core machine.
"""

from __future__ import annotations

import gc
import random
import threading
import time
import warnings
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import anyio
import anyio.lowlevel
import pytest
import torch

import omni_trio as ot
from omni_trio._channel import CoalescingChannel
from omni_trio._workitem import WorkItem
from omni_trio.testing import (
    FakeRunner,
    FakeState,
    RequestLedger,
    assert_engine_idle,
    assert_nothing_left,
    check_engine_invariants,
    live_objects,
    probe,
)
from tests.support.core import RunnerBroke, expected_images, outcome_of, req

REQUESTS = 1000
CONSUMERS = 32
MAX_BATCH = 4
#: Simulated compute per batch step (s): long enough that aborts, deadlines and
#: cancellations land while requests wait or run, not after they are done.
STEP_SECONDS = 0.0005
#: Hang budgets (seconds): one consumer, one whole soak.
CONSUMER_BUDGET = 30.0
SOAK_BUDGET = 90.0

Fate = Literal[
    "complete",
    "read",
    "abort_nowait",
    "abort_await",
    "abort_handle",
    "leave",
    "cancel",
    "deadline",
    "fail_prepare",
    "fail_step",
    "fail_decode",
    "drop",
]
#: How often each fate comes, per hundred (picked by hand, not measured).
FATES: dict[Fate, int] = {
    "complete": 22,
    "read": 14,
    "abort_nowait": 8,
    "abort_await": 8,
    "abort_handle": 6,
    "leave": 10,
    "cancel": 10,
    "deadline": 10,
    "fail_prepare": 3,
    "fail_step": 4,
    "fail_decode": 3,
    "drop": 2,
}


class SoakRunner(FakeRunner):
    """A batching FakeRunner that fails chosen requests in prepare, at a step, or in decode."""

    def __init__(self) -> None:
        super().__init__(max_batch_size=MAX_BATCH, step_seconds=STEP_SECONDS)
        # request id -> (call, step); written by the loop before submit.
        self.failures: dict[str, tuple[str, int]] = {}

    def prepare(self, request: ot.GenerationRequest, request_id: str) -> FakeState:
        if self.failures.get(request_id, ("", 0))[0] == "prepare":
            raise RunnerBroke(f"prepare of {request_id}")
        return super().prepare(request, request_id)

    def step(self, states: Sequence[FakeState]) -> None:
        for state in states:
            call, at = self.failures.get(state.request_id, ("", 0))
            if call == "step" and state.steps_done + 1 == at:
                raise RunnerBroke(f"step {at} of {state.request_id}")
        super().step(states)

    def decode(self, state: FakeState) -> torch.Tensor:
        if self.failures.get(state.request_id, ("", 0))[0] == "decode":
            raise RunnerBroke(f"decode of {state.request_id}")
        return super().decode(state)


@dataclass(frozen=True)
class Plan:
    request_id: str
    request: ot.GenerationRequest
    fate: Fate
    after_events: int  # how many events to read before acting
    deadline: float


def make_plans(rng: random.Random, count: int, prefix: str) -> list[Plan]:
    fates = [fate for fate, weight in FATES.items() for _ in range(weight)]
    plans = []
    for i in range(count):
        steps = rng.randint(1, 8)
        size = 8 * rng.randint(1, 4)
        request = req(
            num_steps=steps,
            height=size,
            width=size,
            seed=rng.randint(0, 3),
            preview_every=rng.choice([0, 0, 1, 3]),
        )
        plans.append(
            Plan(
                request_id=f"{prefix}{i}",
                request=request,
                fate=rng.choice(fates),
                after_events=rng.randint(0, steps),
                deadline=rng.uniform(0.0, 0.003),
            )
        )
    return plans


async def consume(
    engine: ot.Engine, runner: SoakRunner, ledger: RequestLedger, plan: Plan, tally: Counter[str]
) -> None:
    """Play one request's fate; record what its consumer saw."""
    match plan.fate:
        case "fail_prepare" | "fail_decode":
            runner.failures[plan.request_id] = (plan.fate.removeprefix("fail_"), 0)
        case "fail_step":
            runner.failures[plan.request_id] = ("step", max(1, plan.after_events))
    handle = engine.submit(plan.request, request_id=plan.request_id)
    ledger.track(handle)
    if plan.fate == "drop":
        with warnings.catch_warnings():
            # L14: a consumer that vanishes without closing its handle.
            warnings.simplefilter("ignore", ResourceWarning)
            del handle
        tally["dropped"] += 1
        return
    if plan.fate != "deadline":
        await play(engine, ledger, plan, handle, tally)
        return
    try:
        with anyio.fail_after(plan.deadline):
            await play(engine, ledger, plan, handle, tally)
    except TimeoutError:
        # L11: the deadline left the handle's scope: the request was aborted
        # (or had ended) and released before the exit returned.
        assert handle.is_closed and handle.status.is_terminal
        assert not probe(handle).holds_state
        tally["deadline"] += 1


async def play(
    engine: ot.Engine,
    ledger: RequestLedger,
    plan: Plan,
    handle: ot.RequestHandle,
    tally: Counter[str],
) -> None:
    """Consume one admitted request as its fate says; count what the consumer saw."""
    outcome: ot.GenerationOutput | Exception | None = None
    async with handle:
        if plan.fate in ("read", "abort_nowait", "abort_await", "abort_handle", "leave"):
            read = 0
            async for event in handle:
                ledger.event(handle, event)
                read += 1
                if read >= plan.after_events:
                    break
        match plan.fate:
            case "abort_nowait":
                engine.abort_nowait(plan.request_id)
            case "abort_await":
                await engine.abort(plan.request_id)
            case "abort_handle":
                await handle.abort()
            case "leave":
                tally["left early"] += 1
                return
            case "cancel":
                with anyio.CancelScope() as scope:
                    async with anyio.create_task_group() as tg:

                        async def cancel_soon() -> None:
                            for _ in range(plan.after_events):
                                await anyio.lowlevel.checkpoint()
                            scope.cancel()

                        tg.start_soon(cancel_soon)
                        outcome = await outcome_of(handle)
                if outcome is None:
                    # L11: cancelled while waiting: aborted, released before this.
                    assert handle.status.is_terminal
                    tally["cancelled caller"] += 1
                    return
        if outcome is None:
            outcome = await outcome_of(handle)
        ledger.outcome(handle, outcome)
        if isinstance(outcome, ot.GenerationOutput):
            assert torch.equal(outcome.images, expected_images(plan.request))
            tally["output"] += 1
        elif isinstance(outcome, ot.RequestFailedError):
            assert isinstance(outcome.__cause__, RunnerBroke), outcome.__cause__
            tally["failed"] += 1
        else:
            assert isinstance(outcome, ot.RequestAbortedError), outcome
            assert plan.fate.startswith("abort"), (plan, outcome)
            tally["aborted"] += 1


#: What a request is made of: the soak counts the live objects of these classes,
#: so that a leak of any one request fails it (errors: stored outcomes, causes).
REQUEST_PARTS: tuple[type, ...] = (
    WorkItem,  # the engine's record of a request
    CoalescingChannel,
    ot.RequestHandle,
    FakeState,  # the runner's state
    ot.StepEvent,
    ot.GenerationOutput,
    ot.RequestMetrics,
    BaseException,
    torch.Tensor,  # latents, previews, images
)


def live_parts() -> list[object]:
    """Return the live objects of ``REQUEST_PARTS``, after a full collection."""
    gc.collect()
    # type(), not isinstance(): some objects warn when their __class__ is read.
    return [obj for obj in gc.get_objects() if issubclass(type(obj), REQUEST_PARTS)]


async def soak(plans: list[Plan]) -> tuple[Counter[str], ot.EngineStatistics, float]:
    """Run every plan on one engine, 32 consumers at once; check the invariants as they go.

    Then check that the soak left nothing behind: no engine thread or other
    thread, no object of ``REQUEST_PARTS`` made during the soak.

    Cancellation:
        Propagates; the engine shuts down first.
    """
    runner = SoakRunner()
    ledger = RequestLedger()
    tally: Counter[str] = Counter()
    config = ot.EngineConfig(max_batch_size=MAX_BATCH)
    for plan in plans:
        expected_images(plan.request)  # cached now, so the soak adds no tensor to keep
    # Held (so no id of theirs is reused) only to tell them from objects made later.
    before = live_parts()
    known = {id(obj) for obj in before}
    threads = set(threading.enumerate())
    started = time.perf_counter()
    with anyio.fail_after(SOAK_BUDGET):
        async with ot.open_engine(runner, config) as engine:
            queue = iter(plans)

            async def consumer() -> None:
                for plan in queue:
                    with anyio.fail_after(CONSUMER_BUDGET):
                        await consume(engine, runner, ledger, plan, tally)
                    check_engine_invariants(engine, runner)
                    ledger.check(engine)

            async with anyio.create_task_group() as tg:
                for _ in range(CONSUMERS):
                    tg.start_soon(consumer)
            # L14: dropped handles' requests end too; then the engine is idle.
            await wait_idle(engine)
            ledger.check(engine)
            assert ledger.tracked == 0, f"{ledger.tracked} requests never finished"
            assert_engine_idle(engine)
            stats = engine.statistics()
        elapsed = time.perf_counter() - started
        assert_nothing_left(engine, runner)
        # L12, L14, L35: the closed engine (still referenced here) holds nothing of
        # any request: no record, no event or output, no error, no tensor (an idle
        # worker holds none either: see test_idle_engine_holds_no_request_record).
        left = Counter(type(obj).__name__ for obj in live_parts() if id(obj) not in known)
        assert left == Counter(), f"objects of finished requests still alive: {dict(left)}"
        assert ledger.alive() == []
        # Daemon threads of the test's event loop (trio's guest-mode I/O thread)
        # come and go; the engine's own threads are never daemons.
        new = [t.name for t in set(threading.enumerate()) - threads if not t.daemon]
        assert new == [], f"threads left behind: {new}"
    del before
    return tally, stats, elapsed


async def wait_idle(engine: ot.Engine) -> None:
    while engine.statistics().waiting or engine.statistics().running:
        await anyio.sleep(0.001)


@pytest.mark.slow
@pytest.mark.anyio
async def test_chaos_soak_leaks_nothing() -> None:
    """L8, L11-L15, L19, L22, L35: 1,000 requests of random fates; everything accounted for.

    Every outcome is counted once (statistics, the ledger and the consumers
    agree); afterwards the runner holds no state, no thread is left, and no
    object a request is made of (record, handle, runner state, event, output,
    metrics, error, tensor) outlives the soak.
    """
    rng = random.Random(20241129)
    tally, stats, elapsed = await soak(make_plans(rng, REQUESTS, "soak-q"))
    # L19: every admitted request ended exactly once, and the consumers agree.
    assert stats.admitted == REQUESTS
    assert stats.completed + stats.aborted + stats.failed == REQUESTS
    assert sum(tally.values()) == REQUESTS, tally
    # Consumers that stopped watching (left, cancelled, timed out, dropped) do
    # not know how their request ended; everyone else does.
    unseen = tally["left early"] + tally["cancelled caller"] + tally["deadline"]
    unseen += tally["dropped"]
    assert tally["output"] <= stats.completed <= tally["output"] + unseen
    assert tally["failed"] <= stats.failed <= tally["failed"] + unseen
    assert tally["aborted"] <= stats.aborted <= tally["aborted"] + unseen
    print(  # noqa: T201 (the soak's summary, shown with -s)
        f"\nsoak: {REQUESTS} requests in {elapsed:.1f} s; consumers saw {dict(tally)}; "
        f"completed {stats.completed}, aborted {stats.aborted}, failed {stats.failed}"
    )


@pytest.mark.anyio
async def test_idle_engine_holds_no_request_record() -> None:
    """L14: once a request ended and its handle closed, no engine thread references it."""
    with anyio.fail_after(CONSUMER_BUDGET):
        async with ot.open_engine(FakeRunner()) as engine:
            async with engine.submit(
                ot.GenerationRequest(num_steps=2, height=8, width=8), request_id="soak-idle"
            ) as handle:
                await handle.result()
            del handle
            assert_engine_idle(engine)
            held = live_objects(WorkItem, request_id="soak-idle")
            count = len(held)
            del held
            assert count == 0, f"{count} record(s) of a finished request still alive"
