"""Deadlines (L62): the field, earliest-deadline ranking, the timer's aborts, and refusal.

Determinism: a ``GatedRunner`` holds the worker in a step while the test submits;
the timer's aborts are tested on trio's ``autojump_clock`` (virtual time), with
deadlines far longer than the real time a thread takes to reach the gate; the
measured step time that admission reads is set by the test where it matters.
"""

from __future__ import annotations

import math

import anyio
import pytest
import trio
import trio.testing

import omni_trio as ot
from omni_trio._request import MAX_DEADLINE_S
from omni_trio.testing import (
    FakeRunner,
    GatedRunner,
    assume_step_time,
    probe,
    probe_engine,
    wait_until,
)
from tests.support.core import BUDGET, RecordingRunner, req


@pytest.mark.parametrize(
    "deadline", [True, "1", 0, 0.0, -1, math.inf, math.nan, MAX_DEADLINE_S * 2, 10**400]
)
def test_bad_deadline_is_refused_by_name(deadline: object) -> None:
    """L4, L62: a deadline that is not a finite number in (0, MAX_DEADLINE_S] is refused."""
    with pytest.raises(ot.InvalidRequestError) as info:
        ot.GenerationRequest(deadline_s=deadline)  # type: ignore[arg-type]
    assert info.value.field == "deadline_s"


def test_deadline_defaults_to_none_and_is_stored_as_float() -> None:
    """L62: no deadline by default; an int is stored as an exact float."""
    assert ot.GenerationRequest().deadline_s is None
    stored = ot.GenerationRequest(deadline_s=5).deadline_s
    assert type(stored) is float and stored == 5.0
    assert ot.GenerationRequest(deadline_s=MAX_DEADLINE_S).deadline_s == MAX_DEADLINE_S


@pytest.mark.anyio
async def test_earliest_deadline_first_among_equal_priorities() -> None:
    """L62: among equal priorities the earliest deadline starts first, then first come.

    One request runs (gated, before any step is measured, so all are admitted).
    Waiting: "none" (no deadline), "late" (900 s), "early" (300 s), "urgent"
    (priority 1, no deadline), "early2" (300 s). Order: urgent, early, early2,
    late, none.
    """
    runner = RecordingRunner()
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner, ot.EngineConfig(max_batch_size=1)) as engine:
            handles = [engine.submit(req(), request_id="busy")]
            await runner.wait_arrived(1)
            for name, fields in (
                ("none", {}),
                ("late", {"deadline_s": 900}),
                ("early", {"deadline_s": 300}),
                ("urgent", {"priority": 1}),
                ("early2", {"deadline_s": 300}),
            ):
                handles.append(engine.submit(req(**fields), request_id=name))
            runner.open_gate()
            for handle in handles:
                async with handle:
                    await handle.result()
    assert runner.prepared == ["busy", "urgent", "early", "early2", "late", "none"]


@pytest.mark.trio
async def test_waiting_request_is_aborted_at_its_deadline(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """L62: a waiting request whose deadline passes is aborted at once ("deadline"), never run."""
    runner = RecordingRunner()
    async with ot.open_engine(runner, ot.EngineConfig(max_batch_size=1)) as engine:
        busy = engine.submit(req(), request_id="busy")
        await runner.wait_arrived(1)
        start = trio.current_time()
        handle = engine.submit(req(deadline_s=100), request_id="late")
        async with handle:
            with pytest.raises(ot.RequestAbortedError) as info:
                await handle.result()
        assert info.value.reason == "deadline" and info.value.request_id == "late"
        assert trio.current_time() - start == pytest.approx(100)
        assert handle.status is ot.RequestStatus.ABORTED
        assert busy.status is ot.RequestStatus.RUNNING
        runner.open_gate()
        async with busy:
            await busy.result()
    assert runner.prepared == ["busy"]
    assert engine.statistics().aborted == 1


@pytest.mark.trio
async def test_running_request_stops_at_the_next_boundary_undecoded(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """L62: a running request whose deadline passes stops at the next step boundary.

    It is held in its first step past its deadline; released, it stops after that
    step, is never decoded, and its state is freed.
    """
    runner = GatedRunner()
    async with ot.open_engine(runner) as engine:
        # A deadline far longer than the virtual time the poll below can take.
        handle = engine.submit(req(num_steps=3, deadline_s=10_000), request_id="r")
        await runner.wait_arrived(1)
        await trio.sleep(20_000)
        assert handle.status is ot.RequestStatus.RUNNING
        runner.open_gate()
        async with handle:
            with pytest.raises(ot.RequestAbortedError) as info:
                await handle.result()
        assert info.value.reason == "deadline"
        assert handle.metrics is not None and handle.metrics.steps_done == 1
        assert runner.decodes == 0 and runner.live_states == 0


@pytest.mark.trio
async def test_deadline_never_fires_for_an_ended_request(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """L3, L62: the timer is keyed by the admission: a request that ended is forgotten.

    "r" completes before its deadline; a new "r" without a deadline is held past
    that time and still completes; the timer holds nothing afterwards.
    """
    runner = GatedRunner()
    async with ot.open_engine(runner) as engine:
        runner.release(3)
        # Virtual time stands still while the worker computes: an autojump clock
        # would leap to the deadline while every task waits for the thread.
        autojump_clock.autojump_threshold = math.inf
        async with engine.submit(req(deadline_s=10_000), request_id="r") as first:
            await first.result()
        autojump_clock.autojump_threshold = 0
        assert probe_engine(engine).pending_deadlines == 0
        second = engine.submit(req(), request_id="r")
        await runner.wait_arrived(4)
        await trio.sleep(20_000)
        assert second.status is ot.RequestStatus.RUNNING
        runner.open_gate()
        async with second:
            await second.result()
    assert engine.statistics().completed == 2


@pytest.mark.anyio
async def test_pending_deadlines_do_not_delay_shutdown() -> None:
    """L62: one timer serves every deadline; leaving the engine does not wait for it.

    Twenty requests with deadlines hours away: the block is left within the hang
    budget, the waiting ones are aborted by shutdown (L31), the timer holds nothing.
    """
    runner = GatedRunner()
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner, ot.EngineConfig(max_batch_size=1)) as engine:
            handles = [engine.submit(req(deadline_s=10_000), request_id=f"r{i}") for i in range(20)]
            await runner.wait_arrived(1)
            assert probe_engine(engine).pending_deadlines == 20
            runner.open_gate()
        assert all(handle.status.is_terminal for handle in handles)
        assert all(handle.status is ot.RequestStatus.ABORTED for handle in handles[1:])
        assert probe_engine(engine).pending_deadlines == 0
        for handle in handles:
            await handle.aclose()


@pytest.mark.anyio
async def test_unmeetable_deadline_is_refused_at_admission() -> None:
    """L62: with a measured step time, a deadline the estimate misses raises DeadlineError.

    The estimate is the step time times (the steps of a running batch it can
    neither join nor preempt + the steps ranked ahead of it, over full batches +
    its own). Here the batch is full and of equal priority: its member's steps left.
    Nothing is admitted on refusal.
    """
    runner = GatedRunner()
    config = ot.EngineConfig(max_batch_size=1)
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner, config) as engine:
            # No step measured yet: even a tight deadline is admitted.
            busy = engine.submit(req(num_steps=4, deadline_s=MAX_DEADLINE_S), request_id="busy")
            await runner.wait_arrived(1)
            runner.release(1)
            await runner.wait_arrived(2)
            [worker] = probe_engine(engine).workers
            assert worker.step_s is not None
            assume_step_time(engine, 1.0)  # the worker is held in a step: nothing overwrites it
            assert worker.step_s == 1.0
            assert worker.steps_left == 3
            others = [
                engine.submit(req(num_steps=5, priority=1), request_id="ahead"),
                engine.submit(req(num_steps=7, priority=-1), request_id="behind"),
            ]
            admitted = engine.statistics().admitted
            with pytest.raises(ot.DeadlineError) as info:
                engine.submit(req(num_steps=2, deadline_s=9.5), request_id="tight")
            # 3 left of the full batch + 5 ranked ahead + 2 own = 10 steps of 1 s;
            # "behind" is not counted.
            assert info.value.estimate_s == 10.0 and info.value.deadline_s == 9.5
            assert info.value.request_id == "tight"
            assert "10.000 s" in str(info.value) and "9.5 s" in str(info.value)
            assert isinstance(info.value, ot.RequestError)
            assert engine.statistics().admitted == admitted
            fits = engine.submit(req(num_steps=2, deadline_s=10_000), request_id="fits")
            runner.open_gate()
            for handle in [busy, *others, fits]:
                async with handle:
                    await handle.result()


@pytest.mark.anyio
async def test_step_time_is_measured_by_the_worker() -> None:
    """L62: the worker keeps a moving average of step durations, None before any step."""
    runner = FakeRunner()
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner) as engine:
            [worker] = probe_engine(engine).workers
            assert worker.step_s is None
            await engine.generate(req(num_steps=3))
            await wait_until(lambda: worker.steps_left == 0)
            step_s = worker.step_s
            assert step_s is not None and 0.0 < step_s < math.inf


# -- what the estimate counts (L62): only the work that would run before it -----
#
# Determinism: a GatedRunner holds the worker in the first step of a long request
# while the test submits; ``assume_step_time`` makes every estimate exact, and the
# deadlines are far longer than the real time the test takes, so none passes.

#: The step time the estimates below read (seconds; only estimates use it).
STEP_S = 100.0


@pytest.mark.anyio
async def test_a_request_that_starts_at_once_is_admitted_whatever_waits_behind() -> None:
    """L62: a request the engine starts at the next boundary is never refused.

    A 500-step request runs; 50 requests of equal priority and no deadline wait
    (another size: they cannot join it). A 5-step request of the running size
    with a deadline of 8 steps would join the batch at the next boundary, ahead of
    the 50 (earliest deadline first): it is admitted, and starts first. Before,
    the estimate counted the 499 steps left and the 50 waiting ones.
    """
    runner = RecordingRunner()
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner) as engine:
            handles = [engine.submit(req(num_steps=500), request_id="long")]
            await runner.wait_arrived(1)
            handles += [
                engine.submit(req(height=8, width=8), request_id=f"w{i}") for i in range(50)
            ]
            assume_step_time(engine, STEP_S)
            urgent = engine.submit(req(num_steps=5, deadline_s=8 * STEP_S), request_id="soon")
            runner.open_gate()
            async with urgent:
                await urgent.result()
            for handle in handles:
                async with handle:
                    await handle.result()
    assert runner.prepared[:2] == ["long", "soon"]
    assert runner.batches[1] == ("long", "soon")


@pytest.mark.parametrize("preemption", [True, False])
@pytest.mark.anyio
async def test_a_request_that_would_preempt_the_batch_is_admitted(preemption: bool) -> None:
    """L61, L62: a request that would suspend the running batch is admitted; without
    preemption the same request waits behind the batch's steps, and is refused.

    The batch holds one place, filled by a 500-step request of priority 0; the
    newcomer has priority 1, 5 steps and a deadline of 8 steps.
    """
    runner = GatedRunner()
    config = ot.EngineConfig(max_batch_size=1, preemption=preemption)
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner, config) as engine:
            long = engine.submit(req(num_steps=500), request_id="long")
            await runner.wait_arrived(1)
            assume_step_time(engine, STEP_S)
            urgent = req(num_steps=5, priority=1, deadline_s=8 * STEP_S)
            if not preemption:
                with pytest.raises(ot.DeadlineError) as info:
                    engine.submit(urgent, request_id="urgent")
                # 500 steps of the batch it cannot enter, 5 of its own.
                assert info.value.estimate_s == 505 * STEP_S
                runner.open_gate()
            else:
                handle = engine.submit(urgent, request_id="urgent")
                runner.open_gate()
                async with handle:
                    await handle.result()
                assert probe(long).preemptions == 1
            async with long:
                await long.result()


@pytest.mark.anyio
async def test_a_request_ranked_behind_much_work_is_refused() -> None:
    """L62: the work ranked ahead counts: higher priorities, and earlier deadlines at its own.

    Waiting, each of 3 steps: 10 of priority 0 with a deadline of 15 steps, 10 of
    priority 1, and behind the newcomer 10 of priority 0 without a deadline and 10
    with a deadline of 1,000 steps. The newcomer (priority 0, 5 steps, a deadline
    of 19 steps) could join the running batch, but 60 steps are ranked ahead of
    it: 15 batch steps over full batches of 4, plus its own 5, is 20 > 19.
    """
    runner = GatedRunner()
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner) as engine:
            handles = [engine.submit(req(num_steps=500), request_id="long")]
            await runner.wait_arrived(1)
            assume_step_time(engine, STEP_S)
            for name, fields in (
                ("soon", {"deadline_s": 15 * STEP_S}),
                ("high", {"priority": 1}),
                ("plain", {}),
                ("late", {"deadline_s": 1000 * STEP_S}),
            ):
                handles += [
                    engine.submit(req(**fields), request_id=f"{name}{i}") for i in range(10)
                ]
            admitted = engine.statistics().admitted
            with pytest.raises(ot.DeadlineError) as info:
                engine.submit(req(num_steps=5, deadline_s=19 * STEP_S), request_id="tight")
            assert info.value.estimate_s == 20 * STEP_S
            assert "60 steps ranked ahead" in str(info.value)
            assert engine.statistics().admitted == admitted
            # With a deadline of 20 steps it fits, exactly.
            handles.append(engine.submit(req(num_steps=5, deadline_s=20 * STEP_S)))
            runner.open_gate()
            for handle in handles:
                await handle.aclose()


@pytest.mark.anyio
async def test_after_an_abort_returns_the_estimate_no_longer_counts_its_steps() -> None:
    """L8, L62: once ``await engine.abort()`` returns, the worker's published batch is
    without the aborted request: a deadline that fits only without its steps is met.

    Ten times over: a 207-step request runs (the only place), is aborted after a
    step, and at once a 10-step request with a deadline of 50 steps is submitted;
    with the aborted request's 206 steps left counted it would be refused.
    """
    runner = GatedRunner()
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner, ot.EngineConfig(max_batch_size=1)) as engine:
            for attempt in range(10):
                await _abort_then_submit(engine, runner, f"tight{attempt}")


async def _abort_then_submit(engine: ot.Engine, runner: GatedRunner, tight_id: str) -> None:
    """Abort a long request held in its first step, then submit ``tight_id`` at once."""
    arrived = runner.arrived
    long = engine.submit(req(num_steps=207), request_id="long")
    await runner.wait_arrived(arrived + 1)
    assume_step_time(engine, STEP_S)
    view = probe(long)
    async with anyio.create_task_group() as tg:
        tg.start_soon(engine.abort, "long")
        await wait_until(lambda: view.cancel_reason is not None)
        runner.release(1)
    assert long.status is ot.RequestStatus.ABORTED
    tight = engine.submit(req(num_steps=10, deadline_s=50 * STEP_S), request_id=tight_id)
    runner.release(10)
    async with tight:
        await tight.result()
    await long.aclose()
