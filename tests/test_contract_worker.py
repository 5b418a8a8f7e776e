"""Runners and the worker thread: L20-L23.

Determinism: GatedRunner steps wait for ``release``; the one test that blocks the
event loop on purpose waits on a thread condition with a generous timeout, so it
fails (rather than hangs) if the worker needed the loop.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import anyio
import pytest
import torch

import omni_trio as ot
from omni_trio.testing import (
    ENGINE_THREAD_PREFIX,
    FakeRunner,
    FakeState,
    GatedRunner,
    assert_engine_idle,
    probe_engine,
    wait_until,
)
from tests.support.core import BUDGET, WorkerKilled, req, solo_images

pytestmark = pytest.mark.anyio


async def test_runner_calls_run_only_in_engine_threads() -> None:
    """L20: every runner call is made from an engine-owned thread, never the loop's."""
    runner = FakeRunner()
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner) as engine:
            await engine.generate(req(preview_every=1))
            threads = engine.threads
        assert runner.threads
        assert threading.current_thread().name not in runner.threads
        assert all(name.startswith(ENGINE_THREAD_PREFIX) for name in runner.threads)
        assert not any(thread.daemon for thread in threads)


async def test_event_loop_stays_free_while_worker_computes() -> None:
    """L20: with the worker stuck inside a step, the loop still admits, aborts and answers."""
    runner = GatedRunner()
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner, ot.EngineConfig(max_batch_size=1)) as engine:
            async with engine.submit(req(), request_id="busy") as busy:
                await runner.wait_arrived(1)
                async with engine.submit(req(), request_id="other") as other:
                    assert engine.statistics().running == 1
                    assert await engine.abort("other") is True
                    assert other.status is ot.RequestStatus.ABORTED
                runner.open_gate()
                await busy.result()


async def test_worker_never_waits_for_the_event_loop() -> None:
    """L20: the worker runs all steps while the event loop's thread is blocked."""
    runner = FakeRunner()
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner) as engine:
            async with engine.submit(req(num_steps=40), request_id="r") as handle:
                # Block the loop's thread itself (as a careless callback would).
                finished = runner.wait_until_sync(lambda: runner.decodes == 1, timeout=BUDGET)
                assert finished, "the worker stalled while the event loop was blocked"
                assert runner.steps_run == 40
                output = await handle.result()
                assert output.metrics.steps_done == 40


@pytest.mark.parametrize("abort_after", [1, 2, 3])
async def test_cancellation_checked_at_every_step_boundary(abort_after: int) -> None:
    """L21: an abort while step k+1 runs stops the request right after it, undecoded."""
    runner = GatedRunner()
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner) as engine:
            async with engine.submit(req(num_steps=4), request_id="r") as handle:
                runner.release(abort_after)
                await runner.wait_arrived(abort_after + 1)
                engine.abort_nowait("r")
                runner.open_gate()
                with pytest.raises(ot.RequestAbortedError):
                    await handle.result()
                assert handle.metrics is not None
                assert handle.metrics.steps_done == abort_after + 1
            assert runner.decodes == 0


async def test_cancellation_checked_before_decode() -> None:
    """L21: a request whose steps are done but whose decode has not begun is never decoded."""
    runner = GatedRunner(gate_decodes=True)
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner, ot.EngineConfig(max_batch_size=1)) as engine:
            first = engine.submit(req(num_steps=1), request_id="first")
            second = engine.submit(req(num_steps=1), request_id="second")
            runner.open_gate()
            # first's decode is held; second's steps finish and it queues behind.
            await wait_until(lambda: runner.decodes_arrived == 1 and runner.steps_run == 2)
            engine.abort_nowait("second")
            runner.release_decode(2)
            async with first, second:
                await first.result()
                with pytest.raises(ot.RequestAbortedError):
                    await second.result()
                assert second.metrics is not None and second.metrics.steps_done == 1
            assert runner.decodes == 1
            assert runner.live_states == 0


async def test_runner_exception_fails_only_that_batch() -> None:
    """L22: a step that raises fails its batch with RequestFailedError; the engine serves on."""
    runner = FakeRunner(fail_at_step=2)
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner, ot.EngineConfig(max_batch_size=2)) as engine:
            handles = [engine.submit(req(num_steps=3), request_id=f"r{i}") for i in range(2)]
            for handle in handles:
                async with handle:
                    with pytest.raises(ot.RequestFailedError) as info:
                        await handle.result()
                    assert info.value.request_id == handle.request_id
                    assert isinstance(info.value.__cause__, RuntimeError)
                    assert "step 2" in str(info.value.__cause__)
            runner.fail_at_step = None
            output = await engine.generate(req(num_steps=3))
            torch.testing.assert_close(output.images, solo_images(req(num_steps=3)))
            assert engine.statistics().failed == 2
            assert runner.live_states == 0
            assert_engine_idle(engine)


async def test_idle_worker_statistics_after_a_failed_batch() -> None:
    """L19, L22, L42: a worker idle after its batch failed counts no running member.

    The one step of "a" raises (L22): "a" fails and the worker waits for work.
    Its ``statistics().workers[0]`` must then say 0 running and 0 steps left (the
    steps left feed admission's deadline estimate), as ``statistics().running`` does.
    """
    runner = GatedRunner(fail_at_step=1)
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner) as engine:
            async with engine.submit(req(num_steps=2), request_id="a") as handle:
                runner.release(1)
                with pytest.raises(ot.RequestFailedError):
                    await handle.result()
            # Idle: the worker waits on the pool's condition; nothing changes now.
            await wait_until(lambda: probe_engine(engine).idle_workers == 1)
            stats = engine.statistics()
            assert stats.running == 0
            assert stats.workers[0].running == 0, stats.workers[0]
            assert probe_engine(engine).workers[0].steps_left == 0


class FlakyRunner(FakeRunner):
    """Raises in prepare, preview or decode for requests whose prompt names the call."""

    def prepare(self, request: ot.GenerationRequest, request_id: str) -> FakeState:
        if request.prompt == "prepare":
            raise ValueError("prepare failed")
        return super().prepare(request, request_id)

    def preview(self, state: FakeState) -> torch.Tensor:
        if state.request_id == "preview":
            raise ValueError("preview failed")
        return super().preview(state)

    def decode(self, state: FakeState) -> torch.Tensor:
        if state.request_id == "decode":
            raise ValueError("decode failed")
        return super().decode(state)


@pytest.mark.parametrize("where", ["prepare", "preview", "decode"])
async def test_runner_exception_outside_step_fails_only_that_request(where: str) -> None:
    """L22: prepare, preview and decode errors fail only their request, cause chained."""
    runner = FlakyRunner()
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner) as engine:
            bad = engine.submit(req(prompt=where, preview_every=1), request_id=where)
            good = engine.submit(req(), request_id="good")
            async with bad, good:
                if where == "preview":
                    [event async for event in bad]
                with pytest.raises(ot.RequestFailedError) as info:
                    await bad.result()
                assert isinstance(info.value.__cause__, ValueError)
                await good.result()
            assert runner.live_states == 0
            assert_engine_idle(engine)


class DyingRunner(GatedRunner):
    def step(self, states: Sequence[FakeState]) -> None:
        super().step(states)
        if self.steps_run >= 2:
            raise WorkerKilled("the device fell off the bus")


async def test_worker_death_fails_everything_and_nothing_hangs() -> None:
    """L23: when the worker dies, live requests, submit and the exit all raise EngineDeadError."""
    runner = DyingRunner()
    with anyio.fail_after(BUDGET):
        with pytest.raises(ot.EngineDeadError) as exit_info:
            async with ot.open_engine(runner, ot.EngineConfig(max_batch_size=1)) as engine:
                running = engine.submit(req(num_steps=5), request_id="running")
                waiting = engine.submit(req(num_steps=5), request_id="waiting")
                runner.open_gate()
                async with running, waiting:
                    for handle in (running, waiting):
                        with pytest.raises(ot.EngineDeadError) as info:
                            await handle.result()
                        assert isinstance(info.value.__cause__, WorkerKilled)
                        assert handle.status is ot.RequestStatus.FAILED
                with pytest.raises(ot.EngineDeadError):
                    engine.submit(req())
                with pytest.raises(ot.EngineDeadError):
                    await engine.generate(req())
                assert engine.statistics().is_dead
        assert isinstance(exit_info.value.__cause__, WorkerKilled)
        assert runner.closed


async def test_body_error_wins_over_dead_worker() -> None:
    """L23: an exception from the block propagates unchanged, not wrapped or replaced."""
    runner = DyingRunner()
    with anyio.fail_after(BUDGET), pytest.raises(KeyError):
        async with ot.open_engine(runner) as engine:
            runner.open_gate()
            with pytest.raises(ot.EngineDeadError):
                await engine.generate(req(num_steps=5))
            raise KeyError("mine")
