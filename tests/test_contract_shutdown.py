"""Shutdown: L30-L36.

Determinism: GatedRunner steps wait for ``release``; the grace-period tests are
trio-only and run on pytest-trio's ``autojump_clock``, so the grace period passes
in virtual time exactly when every task waits. The worker thread does not count
as a task: while it computes, a test that must not let virtual time leap stops the
autojump (``autojump_threshold = inf``) and waits on the request itself.
"""

from __future__ import annotations

import math

import anyio
import pytest
import trio
import trio.testing

import omni_trio as ot
from omni_trio.testing import FakeRunner, GatedRunner, probe, wait_until
from tests.support.core import BUDGET, req


async def _close_in_background(engine: ot.Engine, tg: anyio.abc.TaskGroup) -> None:
    tg.start_soon(engine.aclose)
    await wait_until(lambda: engine.statistics().is_closing)


@pytest.mark.anyio
async def test_shutdown_stops_admission_first() -> None:
    """L30: once aclose() began, submit raises EngineClosedError at once."""
    runner = GatedRunner()
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner, ot.EngineConfig(shutdown_grace=60)) as engine:
            running = engine.submit(req(num_steps=2), request_id="running")
            await runner.wait_arrived(1)
            async with anyio.create_task_group() as tg:
                await _close_in_background(engine, tg)
                with pytest.raises(ot.EngineClosedError):
                    engine.submit(req())
                with pytest.raises(ot.EngineClosedError):
                    await engine.generate(req())
                runner.open_gate()
            async with running:
                await running.result()  # the grace period let it finish


@pytest.mark.anyio
async def test_shutdown_ends_waiting_requests_at_once() -> None:
    """L31: waiting requests get EngineClosedError as soon as shutdown begins."""
    runner = GatedRunner()
    config = ot.EngineConfig(max_batch_size=1, shutdown_grace=60)
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner, config) as engine:
            running = engine.submit(req(num_steps=2), request_id="running")
            await runner.wait_arrived(1)
            waiting = [engine.submit(req(), request_id=f"w{i}") for i in range(3)]
            async with anyio.create_task_group() as tg:
                await _close_in_background(engine, tg)
                for handle in waiting:
                    assert handle.status is ot.RequestStatus.ABORTED
                    assert handle.abort_reason == "shutdown"
                assert running.status is ot.RequestStatus.RUNNING
                for handle in waiting:
                    with pytest.raises(ot.EngineClosedError):
                        await handle.result()
                runner.open_gate()
            assert runner.prepares == 1
            for handle in [running, *waiting]:
                await handle.aclose()


@pytest.mark.anyio
async def test_shutdown_without_grace_stops_running_at_next_boundary() -> None:
    """L32: with shutdown_grace 0, running requests stop at the next boundary, EngineClosedError."""
    runner = GatedRunner()
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner) as engine:
            handle = engine.submit(req(num_steps=10), request_id="r")
            runner.release(1)
            await runner.wait_arrived(2)
            async with anyio.create_task_group() as tg:
                await _close_in_background(engine, tg)
                runner.open_gate()
            async with handle:
                with pytest.raises(ot.EngineClosedError):
                    await handle.result()
            assert handle.metrics is not None and handle.metrics.steps_done == 2
            assert runner.live_states == 0


@pytest.mark.trio
async def test_grace_period_lets_running_requests_finish(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """L32: a running request that finishes within shutdown_grace completes normally."""
    runner = GatedRunner()
    async with ot.open_engine(runner, ot.EngineConfig(shutdown_grace=100)) as engine:
        handle = engine.submit(req(num_steps=3), request_id="r")
        await runner.wait_arrived(1)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(engine.aclose)
            await trio.sleep(50)  # virtual: well inside the grace period
            assert handle.status is ot.RequestStatus.RUNNING
            # Virtual time stands still while the worker computes: an autojump
            # clock would leap to the grace deadline while every task waits for
            # the thread (the pytest-timeout limit is the hang budget here).
            autojump_clock.autojump_threshold = math.inf
            runner.open_gate()
            async with handle:
                output = await handle.result()
            autojump_clock.autojump_threshold = 0
        assert output.metrics.steps_done == 3
        assert trio.current_time() < 100


@pytest.mark.trio
async def test_grace_period_expiry_cuts_running_requests(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """L32: after shutdown_grace, running requests stop at the next boundary."""
    runner = GatedRunner()
    async with ot.open_engine(runner, ot.EngineConfig(shutdown_grace=10)) as engine:
        handle = engine.submit(req(num_steps=3), request_id="r")
        await runner.wait_arrived(1)
        start = trio.current_time()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(engine.aclose)
            await trio.sleep(11)  # virtual: the grace period is over
            assert probe(handle).cancel_reason == "shutdown"
            runner.open_gate()
        async with handle:
            with pytest.raises(ot.EngineClosedError):
                await handle.result()
        assert handle.metrics is not None and handle.metrics.steps_done == 1
        assert trio.current_time() - start >= 10


@pytest.mark.anyio
async def test_finished_results_survive_shutdown() -> None:
    """L33: a result complete before shutdown stays readable by its open handle after it."""
    runner = FakeRunner()
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner) as engine:
            handle = engine.submit(req(num_steps=2), request_id="r")
            await wait_until(lambda: handle.status is ot.RequestStatus.COMPLETED)
        assert [event.step async for event in handle] == [1, 2]
        output = await handle.result()
        assert output.metrics.steps_done == 2
        await handle.aclose()


@pytest.mark.anyio
async def test_decoding_result_is_delivered_through_shutdown() -> None:
    """L33: a request whose steps finished before shutdown is decoded and delivered."""
    runner = GatedRunner(gate_decodes=True)
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner) as engine:
            handle = engine.submit(req(num_steps=1), request_id="r")
            runner.open_gate()
            await wait_until(lambda: runner.decodes_arrived == 1)
            async with anyio.create_task_group() as tg:
                await _close_in_background(engine, tg)
                runner.release_decode(1)
        async with handle:
            output = await handle.result()
        assert output.request_id == "r"


@pytest.mark.anyio
async def test_waits_after_shutdown_return_at_once() -> None:
    """L34: result() of a cut-off request, abort and generate answer at once after shutdown."""
    runner = GatedRunner()
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner, ot.EngineConfig(max_batch_size=1)) as engine:
            running = engine.submit(req(num_steps=5), request_id="running")
            waiting = engine.submit(req(num_steps=5), request_id="waiting")
            await runner.wait_arrived(1)
            async with anyio.create_task_group() as tg:
                await _close_in_background(engine, tg)
                runner.open_gate()
        # The threads are gone: nothing below may wait for them.
        with anyio.fail_after(1):
            for handle in (running, waiting):
                with pytest.raises(ot.EngineClosedError):
                    await handle.result()
                assert await handle.abort() is False
                await handle.aclose()
            assert await engine.abort("running") is False
            assert engine.abort_nowait("waiting") is False
            with pytest.raises(ot.EngineClosedError):
                await engine.generate(req())
            await engine.aclose()


@pytest.mark.anyio
async def test_aclose_joins_threads_and_closes_runner() -> None:
    """L35: when aclose() returns, the threads have exited and the runner is closed."""
    runner = GatedRunner()
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner) as engine:
            handle = engine.submit(req(num_steps=5))
            await runner.wait_arrived(1)
            threads = engine.threads
            assert all(thread.is_alive() for thread in threads)
            runner.open_gate()
            await engine.aclose()
            assert not any(thread.is_alive() for thread in threads)
            assert runner.closed
            await handle.aclose()


@pytest.mark.anyio
async def test_aclose_is_idempotent_and_concurrent() -> None:
    """L36: aclose() may be called again and from several tasks at once."""
    runner = GatedRunner()
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner, ot.EngineConfig(shutdown_grace=60)) as engine:
            handle = engine.submit(req(num_steps=3), request_id="r")
            await runner.wait_arrived(1)
            async with anyio.create_task_group() as tg:
                for _ in range(3):
                    tg.start_soon(engine.aclose)
                await wait_until(lambda: engine.statistics().is_closing)
                runner.open_gate()
            await engine.aclose()
            assert not any(thread.is_alive() for thread in engine.threads)
            async with handle:
                await handle.result()
        await engine.aclose()


@pytest.mark.trio
async def test_a_worker_stuck_in_a_step_is_logged_after_stop_timeout(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """L37: a worker that has not exited ``stop_timeout_s`` after the cut is logged at
    ERROR, naming its thread and the requests it holds; ``aclose`` waits on (L35).

    The step is held at the gate past the cut (a step that does not return); the
    clock jumps the stop timeout while every task waits. Released after the log,
    the worker exits and ``aclose`` returns with every thread joined.
    """
    runner = GatedRunner(gate_timeout=BUDGET)
    config = ot.EngineConfig(stop_timeout_s=10)
    engine_log = "omni_trio.engine"
    async with ot.open_engine(runner, config) as engine:
        handle = engine.submit(req(num_steps=5), request_id="held")
        await runner.wait_arrived(1)
        name = engine.statistics().workers[0].name
        start = trio.current_time()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(engine.aclose)
            while not any(r.levelname == "ERROR" for r in caplog.records if r.name == engine_log):
                await trio.sleep(1)  # virtual
            assert trio.current_time() - start >= 10
            assert any(thread.is_alive() for thread in engine.threads)  # still waiting
            runner.open_gate()
        assert not any(thread.is_alive() for thread in engine.threads)
        await handle.aclose()
    [record] = [r for r in caplog.records if r.name == engine_log and r.levelname == "ERROR"]
    message = record.getMessage()
    assert f"worker {name} has not exited 10 s after shutdown" in message
    assert f"{name}-worker" in message and "held (step 1 of 5" in message
    assert record.request_ids == ("held",)  # type: ignore[attr-defined]


@pytest.mark.anyio
async def test_statistics_name_what_each_worker_holds() -> None:
    """L19, L37: ``WorkerStatistics.holding`` and ``in_step_s`` say what a worker holds now.

    Held in a step, the worker holds its request and has been in the step some
    time; once the request ended it holds nothing and is in no step.
    """
    runner = GatedRunner()
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner) as engine:
            idle = engine.statistics().workers[0]
            assert (idle.holding, idle.in_step_s) == ((), None)
            handle = engine.submit(req(num_steps=2), request_id="r")
            await runner.wait_arrived(1)
            held = engine.statistics().workers[0]
            assert held.holding == ("r",)
            assert held.in_step_s is not None and held.in_step_s >= 0.0
            runner.open_gate()
            async with handle:
                await handle.result()
            await wait_until(lambda: engine.statistics().workers[0].holding == ())
            assert engine.statistics().workers[0].in_step_s is None
