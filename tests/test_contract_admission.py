"""Admission: L1-L5.

Determinism: GatedRunner steps wait for ``release``; a request's status only
changes when the event loop applies the worker's messages, so right after a
synchronous ``submit`` nothing else has happened yet.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import anyio
import pytest
import torch

import omni_trio as ot
from omni_trio.abc import RunnerCapabilities
from omni_trio.testing import (
    FakeRunner,
    GatedRunner,
    assert_engine_idle,
    assume_step_time,
    probe_engine,
)
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


class StepBoundRunner(FakeRunner):
    """A ``FakeRunner`` that runs 4 to 20 steps, takes input images, and makes videos of 4k+1."""

    def __init__(self, *, frames: tuple[int, int] | None = None) -> None:
        super().__init__(frames=frames)
        self._capabilities = dataclasses.replace(
            self._capabilities, min_steps=4, max_steps=20, image_input=True
        )


@pytest.mark.parametrize(
    ("fields", "name", "says"),
    [
        ({"num_steps": 3}, "num_steps", "at least 4 steps, got 3"),
        ({"num_steps": 21}, "num_steps", "at most 20 steps, got 21"),
        # 10 steps at strength 0.3 run 3: the edit, not its num_steps, falls short.
        ({"num_steps": 10, "strength": 0.3}, "strength", "0.3 x num_steps 10 runs 3"),
    ],
)
async def test_steps_the_runner_cannot_run_are_refused_at_admission(
    fields: dict[str, Any], name: str, says: str
) -> None:
    """L4 (amended): a runner's min and max steps are checked at admission, naming the field.

    Nothing is prepared for the refused request; the bounds themselves are admitted.
    """
    runner = StepBoundRunner()
    if "strength" in fields:
        fields = {**fields, "image": torch.rand(3, 16, 16)}
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner) as engine:
            with pytest.raises(ot.InvalidRequestError) as info:
                engine.submit(req(**fields), request_id="bad")
            assert info.value.field == name and says in str(info.value)
            assert engine.statistics().admitted == 0
            for steps in (4, 20):
                await engine.generate(req(num_steps=steps))
    assert runner.prepares == 2


def test_runner_step_bounds_are_validated() -> None:
    """L4: ``min_steps`` is at least 1 and ``max_steps``, when set, at least ``min_steps``."""
    with pytest.raises(ValueError, match="min_steps"):
        RunnerCapabilities(min_steps=0)
    with pytest.raises(ValueError, match="max_steps"):
        RunnerCapabilities(min_steps=3, max_steps=2)
    assert RunnerCapabilities().min_steps == 1


async def test_a_video_over_max_frame_pixels_is_refused_naming_the_bound() -> None:
    """L4 (amended): num_images x num_frames x height x width is bounded by max_frame_pixels.

    The message names the field, the product and the bound; at the bound a video
    runs. An image request is not bounded by it.
    """
    runner = FakeRunner(frames=(4, 1))
    bound = 2 * 9 * 16 * 16
    config = ot.EngineConfig(max_frame_pixels=bound)
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner, config) as engine:
            with pytest.raises(ot.InvalidRequestError) as info:
                engine.submit(req(num_frames=9, num_images=2, height=24), request_id="big")
            assert info.value.field == "num_frames"
            assert "2 x 9 x 24 x 16 = 6,912" in str(info.value)
            assert "max_frame_pixels of 4,608" in str(info.value)
            assert engine.statistics().admitted == 0
            output = await engine.generate(req(num_frames=9, num_images=2))
            assert output.video is not None and output.video.shape[:2] == (2, 9)
    images = ot.EngineConfig(max_frame_pixels=1)
    images.check_request(req())  # no num_frames: an image, not bounded by it
    assert ot.EngineConfig().max_frame_pixels == 2**27


async def test_a_request_whose_one_step_would_outlast_max_step_s_is_refused() -> None:
    """L4 (amended): a request is refused at ``submit`` when a shape of its pixels or fewer
    was measured warm over ``max_step_s`` (a lower bound: never an extrapolation), naming
    its size field, the bound and what was measured; a request smaller than every shape
    measured, and any request before one is measured, is admitted.

    With 16 x 16 (256 pixels) measured at 40 s and a bound of 30 s: 16 x 16 is refused
    naming ``height``, 2 images of 16 x 16 naming ``num_images``, 1024 x 1024 as well;
    8 x 8 is admitted. With 16 x 16 at 20 s and 64 x 64 at 40 s: 32 x 32 is admitted.
    """
    runner = GatedRunner()
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner, ot.EngineConfig(max_step_s=30)) as engine:
            # Before any step is measured, what is refused below is admitted.
            first = engine.submit(req(height=1024, width=1024), request_id="first")
            await runner.wait_arrived(1)
            assume_step_time(engine, 1.0, step_times={256: 40.0})
            for fields, name, measured in (
                ({"height": 16, "width": 16}, "height", "a step of that size took 40 s"),
                ({"num_images": 2}, "num_images", "a smaller step (256 pixels) took 40 s"),
                ({"height": 1024, "width": 1024}, "height", "a smaller step (256 pixels)"),
            ):
                with pytest.raises(ot.InvalidRequestError) as info:
                    engine.submit(req(**{"height": 16, "width": 16, **fields}), request_id="big")
                assert info.value.field == name and info.value.request_id == "big"
                message = str(info.value)
                assert "at least 40.0 s" in message and measured in message, message
                assert "max_step_s of 30 s" in message and "8 warm steps" in message
            small = engine.submit(req(height=8, width=8), request_id="small")
            assume_step_time(engine, 1.0, step_times={256: 20.0, 4096: 40.0})
            middle = engine.submit(req(height=32, width=32), request_id="middle")
            with pytest.raises(ot.InvalidRequestError):
                engine.submit(req(height=64, width=64), request_id="big")
            assert engine.statistics().admitted == 3
            runner.open_gate()
            for handle in (first, small, middle):
                async with handle:
                    await handle.result()
        async with ot.open_engine(FakeRunner(), ot.EngineConfig(max_step_s=None)) as engine:
            await engine.generate(req())
            assume_step_time(engine, 1.0, step_times={1: 1e6})  # idle: nothing overwrites it
            await engine.generate(req(height=64, width=64))  # no bound


async def test_a_worker_measures_each_shape_warm_before_it_bounds_anything() -> None:
    """L4 (amended): a shape's first step on a worker is cold and not counted; after two
    warm steps the worker holds that shape's fastest step (``_steptimes`` has the rest)."""
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(FakeRunner()) as engine:
            [worker] = probe_engine(engine).workers
            await engine.generate(req(num_steps=2, height=16, width=16))
            assert worker.step_times == {}
            await engine.generate(req(num_steps=1, height=16, width=16))
            assert list(worker.step_times) == [256]
            assert 0.0 < worker.step_times[256] < math.inf
