"""Consumers: L11-L14.

Determinism: the GatedRunner holds the worker inside a step, so a consumer
always leaves mid-request; a helper task releases that step only once the abort
was requested, so the exit demonstrably waits for the worker's release.
"""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import Awaitable, Callable
from functools import partial

import anyio
import anyio.lowlevel
import pytest

import omni_trio as ot
from omni_trio.testing import (
    FakeRunner,
    GatedRunner,
    RequestProbe,
    assert_engine_idle,
    live_objects,
    probe,
    probe_engine,
    wait_until,
)
from tests.support.core import BUDGET, Boom, read_gated, req

pytestmark = pytest.mark.anyio


def _asked_to_end(request: RequestProbe | None) -> bool:
    """Whether ``request`` is live and something asked the engine to end it."""
    return request is not None and request.cancel_reason is not None


async def release_once_aborted(runner: GatedRunner, handle: ot.RequestHandle) -> None:
    """Let the blocked step finish only after the request's abort was requested."""
    await wait_until(lambda: probe(handle).cancel_reason is not None)
    runner.open_gate()


async def leave_normally(handle: ot.RequestHandle) -> None:
    async with handle:
        pass


async def leave_by_exception(handle: ot.RequestHandle) -> None:
    with pytest.raises(Boom):
        async with handle:
            raise Boom


async def leave_by_cancel_scope(handle: ot.RequestHandle) -> None:
    with anyio.CancelScope() as scope:
        async with handle:
            scope.cancel()
            await anyio.sleep_forever()
    assert scope.cancelled_caught


async def leave_by_deadline(handle: ot.RequestHandle) -> None:
    with anyio.move_on_after(0.01):
        async with handle:
            await anyio.sleep_forever()


async def cancel_result(handle: ot.RequestHandle) -> None:
    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as tg:
            tg.start_soon(handle.result)
            await anyio.lowlevel.checkpoint()
            scope.cancel()
    await handle.aclose()


WAYS: dict[str, tuple[Callable[[ot.RequestHandle], Awaitable[None]], str]] = {
    "normal_exit": (leave_normally, "consumer_gone"),
    "exception": (leave_by_exception, "consumer_gone"),
    "cancel_scope": (leave_by_cancel_scope, "cancelled"),
    "deadline": (leave_by_deadline, "cancelled"),
    "cancelled_result": (cancel_result, "cancelled"),
}


@pytest.mark.parametrize("way", list(WAYS))
async def test_leaving_scope_aborts_and_waits_for_release(way: str) -> None:
    """L11: every way of leaving aborts the request and returns only after its release."""
    leave, reason = WAYS[way]
    runner = GatedRunner()
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner) as engine:
            handle = engine.submit(req(num_steps=50), request_id="r")
            await runner.wait_arrived(1)
            async with anyio.create_task_group() as tg:
                tg.start_soon(release_once_aborted, runner, handle)
                await leave(handle)
                assert runner.live_states == 0  # released before the exit returned
            assert handle.status is ot.RequestStatus.ABORTED
            assert handle.abort_reason == reason
            assert handle.is_closed
            assert_engine_idle(engine)


async def test_cancelled_generate_aborts_and_waits() -> None:
    """L11: cancelling the task awaiting generate() aborts with 'cancelled' after release."""
    runner = GatedRunner()
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner) as engine, anyio.create_task_group() as outer:

            async def release_once_aborted() -> None:
                await wait_until(lambda: _asked_to_end(probe_engine(engine).request("g")))
                runner.open_gate()

            outer.start_soon(release_once_aborted)
            with anyio.CancelScope() as scope:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(partial(engine.generate, req(num_steps=50), request_id="g"))
                    await runner.wait_arrived(1)
                    scope.cancel()
            assert runner.live_states == 0
            stats = engine.statistics()
            assert (stats.aborted, stats.running) == (1, 0)
            assert_engine_idle(engine)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("target", ["generate", "async_with"])
async def test_native_asyncio_task_cancel_waits_for_release(target: str) -> None:
    """L11: a native asyncio Task.cancel() (Ray Serve, Starlette) still waits for the release."""
    runner = GatedRunner()
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner) as engine:

            async def consumer() -> None:
                if target == "generate":
                    await engine.generate(req(num_steps=50), request_id="t")
                else:
                    async with engine.submit(req(num_steps=50), request_id="t") as handle:
                        async for _ in handle:
                            pass

            task = asyncio.ensure_future(consumer())
            await runner.wait_arrived(1)
            task.cancel()
            for _ in range(20):
                await asyncio.sleep(0)
            # The worker is blocked inside step 1: the task must still be waiting.
            assert not task.done()
            task.cancel()  # a second native cancel must not cut the wait short either
            for _ in range(20):
                await asyncio.sleep(0)
            assert not task.done()
            assert runner.live_states == 1
            runner.open_gate()
            await asyncio.wait([task])
            assert task.cancelled()
            assert runner.live_states == 0
            assert engine.statistics().aborted == 1


async def test_closing_receiver_drops_buffered_events_and_output() -> None:
    """L12: closing the handle frees its buffered events, previews and output at once."""
    runner = GatedRunner()
    config = ot.EngineConfig(event_buffer=8)
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner, config) as engine:
            handle = engine.submit(req(num_steps=6, preview_every=1), request_id="r")
            (first,) = await read_gated(handle, runner, count=1)
            assert first.preview is not None
            del first
            # The consumer reads no more: steps 2-6 stay buffered, each with a preview.
            runner.open_gate()
            await wait_until(lambda: handle.status is ot.RequestStatus.COMPLETED)
            buffered = live_objects(ot.StepEvent, request_id="r")
            assert sorted(event.step for event in buffered) == [2, 3, 4, 5, 6]
            preview_refs = [weakref.ref(e.preview) for e in buffered if e.preview is not None]
            assert len(preview_refs) == 5
            del buffered
            assert len(live_objects(ot.GenerationOutput, request_id="r")) == 1
            await handle.aclose()
            gc.collect()
            assert live_objects(ot.StepEvent, request_id="r") == []
            assert live_objects(ot.GenerationOutput, request_id="r") == []
            assert [ref() for ref in preview_refs] == [None] * 5
            assert_engine_idle(engine)


async def test_output_taken_then_released_is_freed() -> None:
    """L12: an output the consumer took and dropped is referenced by nothing in the engine."""
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(FakeRunner()) as engine:
            async with engine.submit(req(), request_id="r") as handle:
                output = await handle.result()
                ref = weakref.ref(output)
                images_ref = weakref.ref(output.images)
                del output
                assert ref() is None and images_ref() is None


async def test_unread_events_never_slow_the_worker() -> None:
    """L13: unread events coalesce to the newest event_buffer; the terminal outcome stays."""
    runner = FakeRunner()
    config = ot.EngineConfig(event_buffer=2)
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner, config) as engine:
            async with engine.submit(req(num_steps=10), request_id="r") as handle:
                output = await handle.result()  # never read an event
                steps = [event.step async for event in handle]
            assert steps == [9, 10]
            assert output.metrics.steps_done == 10
            assert runner.steps_run == 10


async def test_gone_consumer_request_still_ends_and_frees_everything() -> None:
    """L14: a handle dropped without closing: the request still ends; tables are empty."""
    runner = GatedRunner()
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner) as engine:
            handle = engine.submit(req(num_steps=3), request_id="r")
            with pytest.warns(ResourceWarning, match="unclosed"):
                del handle
            runner.open_gate()
            await wait_until(lambda: engine.statistics().completed == 1)
            assert runner.live_states == 0
            assert_engine_idle(engine)
            assert live_objects(ot.GenerationOutput, request_id="r") == []
            # Its id is free again.
            await engine.generate(req(), request_id="r")


async def test_many_consumers_leaving_leave_tables_empty() -> None:
    """L14: after many requests whose consumers leave early, the engine holds nothing."""
    runner = FakeRunner()
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner, ot.EngineConfig(max_batch_size=3)) as engine:
            async with anyio.create_task_group() as tg:
                for i in range(30):

                    async def consume(i: int = i) -> None:
                        async with engine.submit(req(num_steps=1 + i % 4), request_id=f"r{i}") as h:
                            if i % 3 == 0:
                                return  # leave at once
                            async for event in h:
                                if i % 3 == 1 and event.step == 1:
                                    return  # leave mid-way
                            await h.result()

                    tg.start_soon(consume)
            assert runner.live_states == 0
            assert_engine_idle(engine)
