"""Several workers in one engine (L42, L43, L44): placement, faults, shutdown.

Determinism: each worker has its own ``GatedRunner``, so the test knows which
worker holds a request from which runner's gate it reached, and every outcome is
read from exact counts (each runner's prepares, states, steps; the engine's
per-worker statistics), never from timing.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import anyio
import pytest
import torch

import omni_trio as ot
from omni_trio.testing import (
    FakeRunner,
    assert_nothing_left,
    check_engine_invariants,
    probe,
    probe_engine,
    wait_until,
)
from tests.support.core import BUDGET, WorkerKilled, expected_images, req
from tests.support.devices import KillableRunner, PrepareRecorder

pytestmark = pytest.mark.filterwarnings("error")


class Both:
    """The counters of several runners, summed: what ``check_engine_invariants`` reads."""

    def __init__(self, runners: Sequence[FakeRunner]) -> None:
        self._runners = runners

    @property
    def live_states(self) -> int:
        return sum(runner.live_states for runner in self._runners)

    @property
    def closed(self) -> bool:
        return all(runner.closed for runner in self._runners)


async def started_on_both(
    engine: ot.Engine, runners: Sequence[PrepareRecorder], **fields: Any
) -> list[ot.RequestHandle]:
    """Start one request per runner: each is submitted once the previous one is held in a
    step, so the idle worker takes it. Returns the handles in the order of the runners."""
    handles: dict[str, ot.RequestHandle] = {}
    for index in range(len(runners)):
        handle = engine.submit(req(**fields), request_id=f"r{index}")
        handles[handle.request_id] = handle
        await wait_until(lambda: sum(runner.arrived for runner in runners) == len(handles))
    return [handles[runner.prepared[0]] for runner in runners]


@pytest.mark.anyio
async def test_requests_spread_over_workers_and_equal_one_workers_images() -> None:
    """L42: two runners, two workers, one queue: both serve, every image equals solo."""
    runners = [FakeRunner(), FakeRunner()]
    requests = [req(seed=seed, num_steps=2 + seed % 3) for seed in range(40)]
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runners) as engine:
            assert len(engine.threads) == 4
            handles = [engine.submit(r) for r in requests]
            outputs = []
            for handle in handles:
                async with handle:
                    outputs.append(await handle.result())
            stats = check_engine_invariants(engine, Both(runners))
    assert stats.workers_alive == 2 and stats.completed == 40
    assert [worker.alive for worker in stats.workers] == [True, True]
    steps = [worker.steps_run for worker in stats.workers]
    assert steps == [runner.steps_run for runner in runners]
    assert sum(steps) == stats.steps_run == sum(r.num_steps for r in requests)
    for request, output in zip(requests, outputs, strict=True):
        assert torch.equal(output.images, expected_images(request))
    assert all(runner.closed and runner.live_states == 0 for runner in runners)
    assert not any(thread.is_alive() for thread in engine.threads)


@pytest.mark.anyio
async def test_a_new_request_starts_on_the_idle_worker_not_in_a_busy_batch() -> None:
    """L42: while one worker is busy and another idle, a request starts alone on the idle one.

    It could join the busy worker's batch (same key, room for four), but it starts on
    the idle worker's device instead.
    """
    runners = [PrepareRecorder(), PrepareRecorder()]
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runners, ot.EngineConfig(max_batch_size=4)) as engine:
            first = engine.submit(req(), request_id="first")
            await wait_until(lambda: runners[0].arrived + runners[1].arrived == 1)
            busy = 0 if runners[0].arrived else 1
            runners[busy].release(1)  # a boundary on the busy worker: it could take "second"
            second = engine.submit(req(), request_id="second")
            await wait_until(lambda: runners[1 - busy].arrived == 1)
            assert runners[1 - busy].prepared == ["second"]
            assert runners[busy].prepared == ["first"]
            for runner in runners:
                runner.open_gate()
            for handle in (first, second):
                async with handle:
                    await handle.result()


@pytest.mark.anyio
async def test_an_abort_on_each_worker_lands_and_releases() -> None:
    """L42, L7, L8: a request on each worker, both aborted: both end, nothing decoded."""
    runners = [PrepareRecorder(), PrepareRecorder()]
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runners) as engine:
            handles = await started_on_both(engine, runners, num_steps=10)
            for handle in handles:
                assert engine.abort_nowait(handle.request_id)
            for runner in runners:
                runner.open_gate()
            for handle in handles:
                async with handle:
                    with pytest.raises(ot.RequestAbortedError):
                        await handle.result()
                assert handle.metrics is not None and handle.metrics.steps_after_abort == 1
            assert [r.decodes for r in runners] == [0, 0]
            assert [r.live_states for r in runners] == [0, 0]
            check_engine_invariants(engine, Both(runners))


@pytest.mark.anyio
async def test_a_dead_worker_fails_only_its_requests_and_the_other_serves_on() -> None:
    """L43: a worker killed mid-batch fails what it holds; the other worker serves on.

    Two requests on the doomed worker (one running, one it suspended for it), one on
    the other. The doomed worker's requests fail with RequestFailedError, the cause
    attached; the other's completes; a new request runs on the live worker;
    statistics say one worker is alive. Only when it dies too do submits raise
    EngineDeadError, and so does leaving the block.
    """
    runners = [KillableRunner(), KillableRunner()]
    reached = False
    with anyio.fail_after(BUDGET), pytest.raises(ot.EngineDeadError):
        async with ot.open_engine(runners, ot.EngineConfig(max_batch_size=1)) as engine:
            first, second = await started_on_both(engine, runners, num_steps=4)
            high = engine.submit(req(num_steps=2, priority=1), request_id="high")
            runners[0].release(1)  # first's step ends; at the boundary high suspends it
            await wait_until(lambda: runners[0].arrived == 2)
            assert engine.statistics().suspended == 1
            runners[0].kill = True
            runners[0].release(1)
            for handle in (first, high):
                async with handle:
                    with pytest.raises(ot.RequestFailedError) as info:
                        await handle.result()
                assert isinstance(info.value.__cause__, WorkerKilled)
            stats = engine.statistics()
            assert [w.alive for w in stats.workers] == [False, True]
            assert stats.workers_alive == 1 and not stats.is_dead and stats.suspended == 0
            runners[1].open_gate()
            async with second:
                await second.result()
            later = await engine.generate(req(seed=9), request_id="later")
            assert torch.equal(later.images, expected_images(req(seed=9)))
            assert runners[1].prepared[-1] == "later"
            check_engine_invariants(engine)
            runners[1].kill = True
            with pytest.raises(ot.EngineDeadError):
                await engine.generate(req())
            with pytest.raises(ot.EngineDeadError):
                engine.submit(req())
            reached = True  # not an EngineDeadError from an earlier line
    assert reached
    assert all(runner.closed for runner in runners)
    assert not any(thread.is_alive() for thread in engine.threads)


@pytest.mark.anyio
async def test_shutdown_ends_requests_on_every_worker_with_one_grace() -> None:
    """L44, L31, L32: shutdown cuts running requests on both workers and waiting ones, and
    joins every thread; nothing is left on either runner."""
    runners = [PrepareRecorder(), PrepareRecorder()]
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runners, ot.EngineConfig(max_batch_size=1)) as engine:
            handles = await started_on_both(engine, runners, num_steps=5)
            waiting = engine.submit(req(), request_id="waiting")
            async with anyio.create_task_group() as group:
                group.start_soon(engine.aclose)
                await wait_until(lambda: waiting.status.is_terminal)
                for runner in runners:
                    runner.open_gate()
        for handle in (*handles, waiting):
            async with handle:
                with pytest.raises(ot.EngineClosedError):
                    await handle.result()
    assert_nothing_left(engine, Both(runners))


@pytest.mark.anyio
async def test_a_suspended_request_resumes_on_its_own_worker() -> None:
    """L42, L61: a request suspended on one worker resumes there, never on the other."""
    runners = [PrepareRecorder(), PrepareRecorder()]
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runners, ot.EngineConfig(max_batch_size=1)) as engine:
            handles = await started_on_both(engine, runners, num_steps=4)
            high = engine.submit(req(num_steps=2, priority=1), request_id="high")
            runners[0].release(1)
            await wait_until(lambda: engine.statistics().suspended == 1)
            assert runners[0].prepared[-1] == "high"
            for runner in runners:
                runner.open_gate()
            for handle in (*handles, high):
                async with handle:
                    await handle.result()
    assert (runners[0].suspends, runners[0].resumes) == (1, 1)
    assert (runners[1].suspends, runners[1].resumes) == (0, 0)


def test_runners_must_agree_and_exist() -> None:
    """L42: an empty list, or runners that declare different capabilities, are refused."""

    async def main(runners: Any) -> None:
        async with ot.open_engine(runners):
            pass

    with pytest.raises(ValueError, match="at least one"):
        anyio.run(main, [])
    with pytest.raises(ValueError, match="same capabilities"):
        anyio.run(main, [FakeRunner(), FakeRunner(max_batch_size=2)])


@pytest.mark.anyio
async def test_several_workers_share_the_cores_between_torch_threads() -> None:
    """L42: with several workers the process's torch thread count is the cores over the
    workers (at least 1), or the config's; one worker leaves it as it is."""
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        async with ot.open_engine(FakeRunner()):
            assert torch.get_num_threads() == 3
        cores = len(os.sched_getaffinity(0))
        async with ot.open_engine([FakeRunner(), FakeRunner()]):
            assert torch.get_num_threads() == max(1, cores // 2)
        async with ot.open_engine([FakeRunner()], ot.EngineConfig(torch_threads=2)):
            assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(saved)


@pytest.mark.anyio
async def test_a_runner_error_on_one_worker_fails_only_its_batch() -> None:
    """L42, L22: an ordinary exception from one worker's step fails that batch only; the
    other worker's request completes and both workers stay alive."""
    runners = [PrepareRecorder(), PrepareRecorder()]
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runners, ot.EngineConfig(max_batch_size=1)) as engine:
            first, second = await started_on_both(engine, runners, num_steps=3)
            runners[0].fail_at_step = 2
            for runner in runners:
                runner.open_gate()
            async with first:
                with pytest.raises(ot.RequestFailedError):
                    await first.result()
            async with second:
                output = await second.result()
            assert torch.equal(output.images, expected_images(req(num_steps=3)))
            stats = check_engine_invariants(engine, Both(runners))
            assert stats.workers_alive == 2 and (stats.failed, stats.completed) == (1, 1)


@pytest.mark.anyio
@pytest.mark.parametrize("way", ["cancel", "close"])
async def test_a_consumer_leaving_on_each_worker_aborts_and_waits_for_release(way: str) -> None:
    """L42, L11, L12: with a request on each worker, a cancelled ``result()`` or a closed
    handle aborts it and returns only once that worker released it; idle workers hold
    nothing afterwards (L14)."""
    runners = [PrepareRecorder(), PrepareRecorder()]
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runners, ot.EngineConfig(max_batch_size=1)) as engine:
            handles = await started_on_both(engine, runners, num_steps=10)
            for runner in runners:
                runner.release(1)  # each ends a step; the next waits at its gate
            for handle, runner in zip(handles, runners, strict=True):
                await wait_until(lambda runner=runner: runner.arrived == 2)  # type: ignore[misc]
                async with anyio.create_task_group() as group:
                    if way == "cancel":

                        async def cancel_result(handle: ot.RequestHandle = handle) -> None:
                            with anyio.move_on_after(0):
                                await handle.result()

                        group.start_soon(cancel_result)
                    else:
                        group.start_soon(handle.aclose)
                    view = probe(handle)
                    await wait_until(lambda view=view: view.cancel_reason is not None)  # type: ignore[misc]
                    assert handle.status is ot.RequestStatus.RUNNING  # held in its step
                    runner.open_gate()
                # The task returned only after the release.
                assert handle.status is ot.RequestStatus.ABORTED
                assert runner.live_states == 0 and runner.decodes == 0
            for handle in handles:
                await handle.aclose()
            await wait_until(lambda: all(w.running == 0 for w in engine.statistics().workers))
            assert not probe_engine(engine).live_ids
            check_engine_invariants(engine, Both(runners))


@pytest.mark.anyio
@pytest.mark.usefixtures("one_torch_thread")
async def test_two_tiny_sd_workers_make_one_workers_images() -> None:
    """L42: two tiny SD runners (the same pipeline loaded twice, as on two devices) serve
    one queue; every image equals, bitwise, the one a single worker makes (batches of one:
    the same composition), whichever worker ran it."""
    from omni_trio.runners import DiffusersRunner, for_devices, tiny_pipeline

    requests = [
        ot.GenerationRequest(prompt=f"a boat {i}", num_steps=3, height=64, width=64, seed=i)
        for i in range(6)
    ]
    config = ot.EngineConfig(max_batch_size=1, torch_threads=1)
    with anyio.fail_after(BUDGET * 2):
        async with ot.open_engine(DiffusersRunner(tiny_pipeline("sd")), config) as engine:
            alone = [await engine.generate(r) for r in requests]
        runners = for_devices(
            lambda device: DiffusersRunner(tiny_pipeline("sd").to(device)), "cpu,cpu"
        )
        async with ot.open_engine(runners, config) as engine:
            handles = [engine.submit(r) for r in requests]
            outputs = []
            for handle in handles:
                async with handle:
                    outputs.append(await handle.result())
            stats = engine.statistics()
    assert sum(worker.steps_run for worker in stats.workers) == 3 * len(requests)
    for one, two in zip(alone, outputs, strict=True):
        assert torch.equal(one.images, two.images)
