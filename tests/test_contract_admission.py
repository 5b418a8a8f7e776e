"""Admission: L1-L5.

Determinism: GatedRunner steps wait for ``release``; a request's status only
changes when the event loop applies the worker's messages, so right after a
synchronous ``submit`` nothing else has happened yet.
"""

from __future__ import annotations

import math
from typing import Any

import anyio
import pytest
import torch

import omni_trio as ot
from omni_trio.testing import FakeRunner, GatedRunner, assert_engine_idle
from tests.support.core import BUDGET, req, solo_images

pytestmark = pytest.mark.anyio


async def test_submit_admits_synchronously() -> None:
    """L1: when submit returns, the request waits in the queue (statistics say so).

    The worker is kept busy with a first request (batches of one), so it cannot take
    the second one while the test looks.
    """
    runner = GatedRunner()
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner, ot.EngineConfig(max_batch_size=1)) as engine:
            busy = engine.submit(req(), request_id="busy")
            await runner.wait_arrived(1)
            async with busy, engine.submit(req(), request_id="r1") as handle:
                stats = engine.statistics()
                assert (stats.admitted, stats.waiting, stats.running) == (2, 1, 1)
                assert handle.status is ot.RequestStatus.WAITING
                assert handle.request_id == "r1"
                runner.open_gate()
                await handle.result()


async def test_admission_errors_raise_at_call_site() -> None:
    """L1: an admission error is raised by submit itself, not at first iteration."""
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(FakeRunner(), ot.EngineConfig(max_steps=5)) as engine:
            with pytest.raises(ot.InvalidRequestError):
                engine.submit(req(num_steps=6))  # no await: a synchronous raise
            assert engine.statistics().admitted == 0


async def test_fresh_ids_are_unique() -> None:
    """L1: without request_id, every admission gets a fresh id."""
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(FakeRunner()) as engine:
            handles = [engine.submit(req()) for _ in range(20)]
            assert len({h.request_id for h in handles}) == 20
            for handle in handles:
                await handle.aclose()


async def test_duplicate_live_id_is_rejected() -> None:
    """L2: a waiting, running, or terminal-but-open id is rejected; the live one is untouched."""
    runner = GatedRunner()
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner, ot.EngineConfig(max_batch_size=1)) as engine:
            async with engine.submit(req(), request_id="r1") as first:
                with pytest.raises(ot.DuplicateRequestError) as info:
                    engine.submit(req(prompt="other"), request_id="r1")  # waiting
                assert info.value.request_id == "r1"
                await runner.wait_arrived(1)
                with pytest.raises(ot.DuplicateRequestError):
                    engine.submit(req(), request_id="r1")  # running
                runner.open_gate()
                output = await first.result()
                assert first.status is ot.RequestStatus.COMPLETED
                with pytest.raises(ot.DuplicateRequestError):
                    engine.submit(req(), request_id="r1")  # terminal, handle open
                torch.testing.assert_close(output.images, solo_images(req()))
            assert engine.statistics().admitted == 1


async def test_id_reuse_after_close_is_isolated_from_old_cleanup() -> None:
    """L3: a reused id is a new request; late cleanup of the old one never touches it."""
    runner = GatedRunner()
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner) as engine:
            old = engine.submit(req(num_steps=2), request_id="r1")
            runner.release(2)
            await old.result()
            await old.aclose()

            new_request = req(num_steps=4, prompt="new", seed=7)
            async with engine.submit(new_request, request_id="r1") as new:
                # Late cleanup through the old handle, while the new one waits.
                assert await old.abort() is False
                await old.aclose()
                assert not new.status.is_terminal
                runner.release(4)
                events = [event.step async for event in new]
                output = await new.result()
            assert events == [1, 2, 3, 4]
            assert output.request_id == "r1"
            torch.testing.assert_close(output.images, solo_images(new_request))
            assert engine.statistics().completed == 2
            assert_engine_idle(engine)


async def test_id_reuse_while_old_request_is_being_released() -> None:
    """L3: the old request's release, arriving late, never aborts or feeds the new one."""
    runner = GatedRunner()
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner) as engine:
            async with engine.submit(req(num_steps=5), request_id="r1") as old:
                await runner.wait_arrived(1)
                engine.abort_nowait("r1")
                runner.release(1)
                with pytest.raises(ot.RequestAbortedError):
                    await old.result()
            async with engine.submit(req(num_steps=2, seed=3), request_id="r1") as new:
                runner.open_gate()
                output = await new.result()
            assert new.status is ot.RequestStatus.COMPLETED
            torch.testing.assert_close(output.images, solo_images(req(num_steps=2, seed=3)))


BAD_FIELDS: list[tuple[dict[str, Any], str]] = [
    ({"num_steps": 0}, "num_steps"),
    ({"num_steps": -3}, "num_steps"),
    ({"num_steps": "3"}, "num_steps"),
    ({"num_steps": True}, "num_steps"),
    ({"num_steps": 1001}, "num_steps"),
    ({"height": 0}, "height"),
    ({"height": -16}, "height"),
    ({"height": 12}, "height"),
    ({"width": 20}, "width"),
    ({"width": 4096}, "width"),
    ({"height": 16.0}, "height"),
    ({"guidance_scale": math.nan}, "guidance_scale"),
    ({"guidance_scale": math.inf}, "guidance_scale"),
    ({"guidance_scale": "7"}, "guidance_scale"),
    ({"prompt": 3}, "prompt"),
    ({"negative_prompt": 3}, "negative_prompt"),
    ({"seed": -1}, "seed"),
    ({"seed": 2**64}, "seed"),
    ({"num_images": 0}, "num_images"),
    ({"num_images": 17}, "num_images"),
    ({"preview_every": -1}, "preview_every"),
    ({"extra": {"cfg_rescale": 0.7}}, "extra"),
    ({"extra": [1]}, "extra"),
]


@pytest.mark.parametrize(("fields", "name"), BAD_FIELDS)
async def test_invalid_fields_are_rejected_by_name(fields: dict[str, Any], name: str) -> None:
    """L4: each invalid field raises InvalidRequestError naming it; the engine keeps serving."""
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(FakeRunner()) as engine:
            with pytest.raises(ot.InvalidRequestError) as info:
                engine.submit(req(**fields), request_id="bad")
            assert info.value.field == name
            assert name in str(info.value)
            assert isinstance(info.value, ValueError)
            output = await engine.generate(req(), request_id="bad")
            assert output.images.shape == (1, 3, 16, 16)


async def test_invalid_request_objects_are_rejected() -> None:
    """L4: a wrong request type or request id is refused, naming the argument."""
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(FakeRunner()) as engine:
            with pytest.raises(ot.InvalidRequestError) as info:
                engine.submit({"prompt": "x"})  # type: ignore[arg-type]
            assert info.value.field == "request"
            for bad_id in ("", 5, "id\ud800", "id\x00", "x" * 1025):
                with pytest.raises(ot.InvalidRequestError) as info:
                    engine.submit(req(), request_id=bad_id)  # type: ignore[arg-type]
                assert info.value.field == "request_id"
            assert engine.statistics().admitted == 0


async def test_queue_full_raises_at_once() -> None:
    """L5: with max_waiting requests waiting, submit raises QueueFullError at once."""
    runner = GatedRunner()
    config = ot.EngineConfig(max_batch_size=1, max_waiting=2)
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner, config) as engine:
            running = engine.submit(req(), request_id="running")
            await runner.wait_arrived(1)
            waiting = [engine.submit(req(), request_id=f"w{i}") for i in range(2)]
            with pytest.raises(ot.QueueFullError) as info:
                engine.submit(req(), request_id="overflow")
            assert info.value.request_id == "overflow"
            assert engine.statistics().waiting == 2
            runner.open_gate()
            for handle in [running, *waiting]:
                await handle.result()
                await handle.aclose()
            # Room again: the bound is on waiting requests, not on history.
            await engine.generate(req(), request_id="overflow")
