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
from omni_trio.testing import FakeRunner, GatedRunner, assume_step_time, probe_engine, wait_until
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
        handle = engine.submit(req(num_steps=3, deadline_s=100), request_id="r")
        await runner.wait_arrived(1)
        await trio.sleep(200)
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

    The estimate is the step time times (steps left of the running batch + steps
    of the waiting requests of equal or higher priority, over full batches + the
    request's own). Nothing is admitted on refusal.
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
            # 3 left + 5 ahead + 2 own = 10 steps of 1 s; "behind" is not counted.
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
