"""Cancel points (L71, L72), engine side: a step or a decode left mid-way when its
work is not wanted.

Fake runners whose steps run virtual blocks and whose decodes run chunks
(``FakeRunner(blocks=...)``), gated per block or chunk, so where the worker leaves is
exact: the test holds it inside block k, stops the request, and lets one block more
run. If the worker did not leave there, the next block would wait at the gate for a
release that never comes (the gate's timeout fails the test). The real models' side
(every family's hooks, a tiny Wan decode left mid-way) is tests/runners/test_cancel_points.py.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import anyio
import pytest
import trio
import trio.testing

import omni_trio as ot
from omni_trio.runners import RunnerCapabilities
from omni_trio.testing import GatedRunner, probe, wait_until
from tests.support.core import BUDGET, expected_images, req

BLOCKS = 4


async def _stop_inside_block(
    runner: GatedRunner, handle: ot.RequestHandle, stop: Callable[[], Awaitable[object]]
) -> None:
    """Run ``stop()`` while the worker is inside block 2 of step 1; let that block end.

    One release after the stop: block 2 ends, and the checkpoint before block 3 must leave.
    """
    runner.release(1)  # block 1
    await runner.wait_arrived(2)

    async def release_once_cut() -> None:
        await wait_until(lambda: probe(handle).cancel_reason is not None)
        runner.release(1)

    async with anyio.create_task_group() as tg:
        tg.start_soon(release_once_cut)
        await stop()


def _left_in_block_2(runner: GatedRunner, engine: ot.Engine, handle: ot.RequestHandle) -> None:
    """The step was left after block 2: nothing counted, nothing decoded, nothing held."""
    assert runner.blocks_run == 2
    assert (runner.batch_steps, runner.steps_run, runner.decodes) == (0, 0, 0)
    assert runner.live_states == 0
    stats = engine.statistics()
    assert (stats.steps_run, stats.batch_steps) == (0, 0)
    assert handle.metrics is not None and handle.metrics.steps_done == 0


@pytest.mark.anyio
@pytest.mark.parametrize("how", ["abort", "consumer_gone", "cancelled"])
async def test_a_step_whose_every_member_stopped_is_left_at_the_next_block(how: str) -> None:
    """L71: aborted (abort() returns), its consumer gone, or its awaiting task cancelled,
    inside block 2 of a step: the worker leaves the step before block 3, counts no step
    (so posts no step event), decodes nothing and holds no state; the request ends with
    its own reason, and the next request runs as on a fresh engine.
    """
    runner = GatedRunner(blocks=BLOCKS, gate_blocks=True)
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner) as engine:
            handle = engine.submit(req(num_steps=5), request_id="r")

            async def stop() -> None:
                if how == "abort":
                    assert await engine.abort("r") is True
                    assert runner.live_states == 0  # abort() returned after the release
                elif how == "consumer_gone":
                    async with handle:
                        pass
                else:
                    with anyio.CancelScope() as scope:
                        async with anyio.create_task_group() as tg:
                            tg.start_soon(handle.result)
                            await anyio.lowlevel.checkpoint()
                            scope.cancel()

            await _stop_inside_block(runner, handle, stop)
            await handle.aclose()
            _left_in_block_2(runner, engine, handle)
            reason = {"abort": "user", "consumer_gone": "consumer_gone", "cancelled": "cancelled"}
            assert handle.abort_reason == reason[how]
            # The engine serves on: the next request runs every block of every step.
            runner.open_gate()
            output = await engine.generate(req(num_steps=2, seed=5))
    assert runner.blocks_run == 2 + 2 * BLOCKS
    assert output.images.equal(expected_images(req(num_steps=2, seed=5)))


@pytest.mark.trio
async def test_a_step_past_its_deadline_is_left_at_the_next_block(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """L62, L71: a request whose deadline passes while the worker is inside block 2 of
    its step leaves the step before block 3, undecoded, with reason "deadline".
    """
    runner = GatedRunner(blocks=BLOCKS, gate_blocks=True)
    async with ot.open_engine(runner) as engine:
        # A deadline far longer than the virtual time the poll of wait_arrived can take
        # (each poll sleeps a virtual millisecond while the worker thread computes);
        # past that, no poll: the next timer autojump meets is the deadline's own.
        handle = engine.submit(req(num_steps=5, deadline_s=10_000), request_id="r")
        submitted = trio.current_time()
        runner.release(1)  # block 1
        await runner.wait_arrived(2)
        await trio.sleep_until(submitted + 10_001)
        assert probe(handle).cancel_reason == "deadline"
        runner.release(1)  # block 2 ends; the check before block 3 leaves
        async with handle:
            with pytest.raises(ot.RequestAbortedError) as info:
                await handle.result()
        assert info.value.reason == "deadline"
        _left_in_block_2(runner, engine, handle)


@pytest.mark.anyio
async def test_shutdown_past_its_grace_leaves_the_step_at_the_next_block() -> None:
    """L32, L71: shutdown with no grace left cuts the running request inside block 2: the
    step is left before block 3, EngineClosedError, and aclose() returns with the runner
    closed.
    """
    runner = GatedRunner(blocks=BLOCKS, gate_blocks=True)
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner, ot.EngineConfig(shutdown_grace=0)) as engine:
            handle = engine.submit(req(num_steps=5), request_id="r")
            await _stop_inside_block(runner, handle, engine.aclose)
            assert runner.closed
            _left_in_block_2(runner, engine, handle)
            async with handle:
                with pytest.raises(ot.EngineClosedError):
                    await handle.result()


@pytest.mark.anyio
async def test_when_only_some_members_stop_the_step_finishes_for_the_others() -> None:
    """L9, L71: one of two batch members aborted inside a step: the step runs every block
    for both, the aborted one drops at its end (one more step, undecoded), the other's
    image is its solo image.
    """
    runner = GatedRunner(blocks=BLOCKS, gate_blocks=True)
    kept = req(num_steps=3, seed=2, prompt="kept")
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner) as engine:
            gone = engine.submit(req(num_steps=5, seed=1), request_id="gone")
            await runner.wait_arrived(1)
            other = engine.submit(kept, request_id="kept")  # joins at the next boundary
            runner.release(BLOCKS + 1)
            await runner.wait_arrived(BLOCKS + 2)  # inside block 2 of the shared step 2
            engine.abort_nowait("gone")
            runner.open_gate()
            async with gone:
                with pytest.raises(ot.RequestAbortedError):
                    await gone.result()
            async with other:
                output = await other.result()
    assert gone.metrics is not None and gone.metrics.steps_done == 2
    assert runner.blocks_run == BLOCKS * 4  # steps 1 and 2, then kept's last two alone
    assert runner.decodes == 1 and runner.live_states == 0
    assert output.images.equal(expected_images(kept))


@pytest.mark.anyio
async def test_a_decode_is_left_at_the_next_chunk() -> None:
    """L10, L72: a request aborted while chunk 2 of its decode runs leaves the decode
    before chunk 3: released undecoded, RequestAbortedError, no output.
    """
    runner = GatedRunner(blocks=3, gate_decodes=True)
    runner.open_gate()
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner) as engine:
            async with engine.submit(req(num_steps=2), request_id="r") as handle:
                runner.release_decode(1)
                await wait_until(lambda: runner.decodes_arrived == 2)
                engine.abort_nowait("r")
                runner.release_decode(1)
                with pytest.raises(ot.RequestAbortedError):
                    await handle.result()
            assert runner.chunks_decoded == 2 and runner.decodes == 0
            assert runner.live_states == 0
            assert engine.statistics().completed == 0


@pytest.mark.anyio
async def test_a_runner_that_raises_stoprun_itself_fails_its_batch() -> None:
    """L22, L71: a StopRun the engine's checkpoint did not raise is a runner failure."""
    from omni_trio.runners import StopRun

    class Rogue(GatedRunner):
        def _block(self) -> None:
            raise StopRun

    runner = Rogue(blocks=2)
    runner.open_gate()
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner) as engine:
            with pytest.raises(ot.RequestFailedError):
                await engine.generate(req())
    assert runner.live_states == 0


def test_cancel_points_are_declared_apart_from_whole_calls() -> None:
    """L71: a whole-call runner stops at its on_step callback, not at cancel points."""
    assert GatedRunner(blocks=1).capabilities.cancel_points
    assert not GatedRunner().capabilities.cancel_points
    with pytest.raises(ValueError, match="cancel_points"):
        RunnerCapabilities(whole_call=True, cancel_points=True)
    with pytest.raises(ValueError, match="gate_blocks"):
        GatedRunner(gate_blocks=True)
