"""omni_trio.testing.probe: the engine-side facts of one request, read-only.

Determinism: a ``GatedRunner`` holds the worker at the gate of each step until the
test releases it, so every read meets a known state; the polls (``wait_until``)
only wait for the worker thread, under a hang budget (``anyio.fail_after``).
"""

from __future__ import annotations

import anyio
import pytest

import omni_trio as ot
from omni_trio.testing import GatedRunner, RequestProbe, probe, wait_until

from .util import BUDGET, req

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
