"""omni_trio.testing's probes: the engine-side facts of a request and of the engine, read-only.

Determinism: a ``GatedRunner`` holds the worker at the gate of each step until the
test releases it, so every read meets a known state; the polls (``wait_until``)
only wait for the worker thread, under a hang budget (``anyio.fail_after``).
"""

from __future__ import annotations

import anyio
import pytest

import omni_trio as ot
from omni_trio.testing import (
    GatedRunner,
    RequestProbe,
    assume_step_time,
    probe,
    probe_engine,
    wait_until,
)
from tests.support.core import BUDGET, req

pytestmark = pytest.mark.anyio


async def test_probe_follows_one_request_from_queue_to_release() -> None:
    """L6-L8, L11: the probe shows the abort asked before the end, and the state's release."""
    runner = GatedRunner()
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner, ot.EngineConfig(max_batch_size=1)) as engine:
            first = engine.submit(req(num_steps=4), request_id="first")
            second = engine.submit(req(num_steps=4), request_id="second")
            view = probe(first)
            assert isinstance(view, RequestProbe)
            assert view.request_id == "first"
            await runner.wait_arrived(1)  # "first" waits at the gate of step 1
            waiting = probe(second)
            assert (waiting.status, waiting.holds_state) == (ot.RequestStatus.WAITING, False)
            assert (waiting.steps_done, waiting.cancel_reason) == (0, None)
            assert view.status is ot.RequestStatus.RUNNING
            assert view.holds_state and not view.reading
            runner.release(1)
            await runner.wait_arrived(2)  # step 1 done, step 2 waits at the gate
            assert view.steps_done == 1
            # Asked, not yet seen by the worker: the handle does not say it yet.
            assert first.abort_nowait(reason="user") is True
            assert view.cancel_reason == "user"
            assert view.status is ot.RequestStatus.RUNNING
            assert first.abort_reason is None
            runner.release(1)  # step 2 ends; the boundary drops "first"
            await first.aclose()
            del first
            # The view outlives the handle: the request ended aborted, released.
            # (One tuple: a type checker would keep the narrowed status across awaits.)
            assert (view.status, view.steps_done, view.holds_state) == (
                ot.RequestStatus.ABORTED,
                2,
                False,
            )
            assert repr(view) == "<RequestProbe 'first' aborted>"
            await wait_until(lambda: waiting.status is ot.RequestStatus.RUNNING)
            async with anyio.create_task_group() as tg:

                async def read() -> None:
                    [event.step async for event in second]

                tg.start_soon(read)
                await wait_until(lambda: waiting.reading)
                runner.open_gate()
            async with second:
                await second.result()
            assert waiting.status is ot.RequestStatus.COMPLETED
            assert waiting.cancel_reason is None and not waiting.holds_state


async def test_engine_probe_reads_the_tables_and_the_workers() -> None:
    """L2, L42, L61, L62: the engine's probe shows its live requests, the ids open handles
    hold, the pending deadlines, the idle workers and each worker's measurements."""
    runner = GatedRunner()
    options = ot.EngineConfig(max_batch_size=1)
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner, options) as engine:
            view = probe_engine(engine)
            [worker] = view.workers
            await wait_until(lambda: view.idle_workers == 1)
            assert (worker.is_alive, worker.step_s, worker.steps_left) == (True, None, 0)
            low = engine.submit(req(num_steps=3, deadline_s=10_000), request_id="low")
            await runner.wait_arrived(1)
            assert view.idle_workers == 0 and view.pending_deadlines == 1
            assert view.live_ids == {"low"} and view.open_ids == frozenset()
            urgent = req(num_steps=1, priority=1)
            high = engine.submit(urgent, request_id="high")
            assert [r.request_id for r in view.requests] == ["low", "high"]
            found = view.request("high")
            assert found is not None and found.request is urgent
            assert (found.worker, probe(low).worker) == (None, 0)
            assert view.request("absent") is None
            runner.release(1)  # "low" is suspended for "high" at this boundary
            await runner.wait_arrived(2)
            suspended = probe(low)
            assert suspended.is_suspended and suspended.preemptions == 1
            assert worker.parked_bytes > 0 and worker.step_s is not None
            assume_step_time(engine, 2.0)  # held in "high"'s step: nothing overwrites it
            assert worker.step_s == 2.0
            runner.open_gate()
            async with high:
                await high.result()
            await low.result()
            assert view.live_ids == frozenset() and view.open_ids == {"low"}
            assert view.pending_deadlines == 0 and worker.parked_bytes == 0
            assert not suspended.is_suspended and suspended.preemptions == 1
            await low.aclose()
            assert view.open_ids == frozenset()
        assert repr(worker).startswith("<WorkerProbe 'omni-trio-")
