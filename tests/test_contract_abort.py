"""Abort: L6-L10.

Determinism: GatedRunner steps wait for ``release``; ``wait_arrived(n)`` proves the
worker is blocked inside step n, so an abort made then lands at a known boundary.
"""

from __future__ import annotations

import anyio
import pytest
import torch

import omni_trio as ot
from omni_trio.testing import GatedRunner, assert_engine_idle, probe, wait_until
from tests.support.core import BUDGET, req, solo_images, together

pytestmark = pytest.mark.anyio


async def test_abort_waiting_request_is_terminal_at_once() -> None:
    """L6: a waiting request aborted is terminal at once and never reaches the worker."""
    runner = GatedRunner()
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner, ot.EngineConfig(max_batch_size=1)) as engine:
            async with engine.submit(req(), request_id="a") as first:
                await runner.wait_arrived(1)
                async with engine.submit(req(), request_id="b") as waiting:
                    assert engine.abort_nowait("b") is True
                    assert waiting.status is ot.RequestStatus.ABORTED  # no await in between
                    with pytest.raises(ot.RequestAbortedError) as info:
                        await waiting.result()
                    assert info.value.reason == "user"
                    assert info.value.request_id == "b"
                runner.open_gate()
                await first.result()
            assert runner.prepares == 1  # "b" was never prepared
            assert engine.statistics().aborted == 1


async def test_abort_running_request_lands_at_next_boundary() -> None:
    """L7: the worker runs at most one more step for an aborted request, then releases it."""
    runner = GatedRunner()
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner) as engine:
            async with engine.submit(req(num_steps=10), request_id="r") as handle:
                runner.release(1)
                await runner.wait_arrived(2)  # blocked inside step 2
                engine.abort_nowait("r")
                runner.release(1)  # step 2 completes; the boundary drops the request
                with pytest.raises(ot.RequestAbortedError):
                    await handle.result()
                assert handle.metrics is not None
                assert handle.metrics.steps_done == 2
            assert runner.steps_run == 2
            assert runner.live_states == 0


async def test_abort_waits_for_release() -> None:
    """L8: await abort() returns only once the worker holds no state of the request."""
    runner = GatedRunner()
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner) as engine:
            async with engine.submit(req(num_steps=10), request_id="r") as handle:
                await runner.wait_arrived(1)
                async with anyio.create_task_group() as tg:

                    async def abort() -> None:
                        assert await engine.abort("r") is True
                        assert runner.live_states == 0
                        assert handle.status is ot.RequestStatus.ABORTED

                    tg.start_soon(abort)
                    await wait_until(lambda: probe(handle).cancel_reason is not None)
                    # The worker is still inside step 1: abort() cannot have returned.
                    assert runner.live_states == 1
                    runner.release(1)
            assert handle.abort_reason == "user"


async def test_abort_is_idempotent_and_false_for_unknown_or_finished() -> None:
    """L8: repeated aborts are harmless; unknown and finished ids give False and change nothing."""
    runner = GatedRunner()
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner) as engine:
            assert engine.abort_nowait("nobody") is False
            assert await engine.abort("nobody") is False
            async with engine.submit(req(num_steps=1), request_id="done") as done:
                runner.release(1)
                await done.result()
                assert engine.abort_nowait("done") is False
                assert await engine.abort("done") is False
                assert done.status is ot.RequestStatus.COMPLETED
            async with engine.submit(req(num_steps=5), request_id="r") as handle:
                await runner.wait_arrived(2)
                assert engine.abort_nowait("r", reason="first") is True
                assert engine.abort_nowait("r", reason="second") is True
                runner.open_gate()
                assert await engine.abort("r") is True
                assert await engine.abort("r") is False
                assert handle.abort_reason == "first"
            stats = engine.statistics()
            assert (stats.completed, stats.aborted) == (1, 1)
            assert_engine_idle(engine)


async def test_abort_reason_shutdown_is_reserved() -> None:
    """L8: the engine's own reason cannot be passed by a caller."""
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(GatedRunner()) as engine:
            with pytest.raises(ValueError, match="reason"):
                engine.abort_nowait("x", reason="shutdown")


async def test_abort_one_batch_member_leaves_others_unchanged() -> None:
    """L9: an aborted member leaves at the next boundary; the others match their solo outputs."""
    runner = GatedRunner()
    requests = {
        "a": req(num_steps=6, seed=1, prompt="a"),
        "b": req(num_steps=6, seed=2, prompt="b"),
        "c": req(num_steps=4, seed=3, prompt="c"),
    }
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner, ot.EngineConfig(max_batch_size=4)) as engine:
            with together(engine):  # one batch of three from the first step
                handles = {rid: engine.submit(r, request_id=rid) for rid, r in requests.items()}
            runner.release(2)
            await runner.wait_arrived(3)
            engine.abort_nowait("b")
            runner.open_gate()
            outputs = {}
            for rid, handle in handles.items():
                async with handle:
                    if rid == "b":
                        with pytest.raises(ot.RequestAbortedError):
                            await handle.result()
                    else:
                        outputs[rid] = await handle.result()
            assert handles["b"].metrics is not None
            assert handles["b"].metrics.steps_done == 3
            for rid in ("a", "c"):
                torch.testing.assert_close(outputs[rid].images, solo_images(requests[rid]))
            # b's steps stop at 3: 6 + 3 + 4 member-steps in all.
            assert runner.steps_run == 13
            assert runner.live_states == 0


@pytest.mark.parametrize("abort_at", ["last_step", "during_decode"])
async def test_aborted_request_is_never_decoded(abort_at: str) -> None:
    """L10: an abort before the decode means no decode and no GenerationOutput."""
    runner = GatedRunner(gate_decodes=abort_at == "during_decode")
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner) as engine:
            async with engine.submit(req(num_steps=2), request_id="r") as handle:
                if abort_at == "last_step":
                    runner.release(1)
                    await runner.wait_arrived(2)  # inside the last step
                    engine.abort_nowait("r")
                    runner.release(1)
                else:
                    runner.release(2)
                    await wait_until(lambda: runner.decodes_arrived == 1)
                    engine.abort_nowait("r")
                    runner.release_decode(1)
                with pytest.raises(ot.RequestAbortedError):
                    await handle.result()
                assert handle.metrics is not None
                assert handle.metrics.steps_done == 2
            expected_decodes = 0 if abort_at == "last_step" else 1
            assert runner.decodes == expected_decodes
            assert engine.statistics().completed == 0
            assert runner.live_states == 0


async def test_handle_abort_nowait_signals_only_its_request() -> None:
    """L8: handle.abort_nowait signals without waiting, and only its own admission."""
    runner = GatedRunner()
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner) as engine:
            async with engine.submit(req(num_steps=5), request_id="r") as handle:
                await runner.wait_arrived(1)
                assert handle.abort_nowait(reason="mine") is True
                assert handle.status is ot.RequestStatus.RUNNING  # only signalled
                runner.open_gate()
                with pytest.raises(ot.RequestAbortedError) as info:
                    await handle.result()
                assert info.value.reason == "mine"
                assert handle.abort_nowait() is False
            # The id is free again: the old handle's abort never touches the new request.
            async with engine.submit(req(num_steps=2), request_id="r") as new:
                assert handle.abort_nowait() is False
                await new.result()


async def test_the_engine_gives_abort_reasons_of_one_vocabulary() -> None:
    """The engine's own reasons are ``AbortReason`` members; a caller's str stays as given."""
    runner = GatedRunner()
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner, ot.EngineConfig(max_batch_size=1)) as engine:
            async with engine.submit(req(), request_id="run") as running:
                await runner.wait_arrived(1)
                by_default = engine.submit(req())
                engine.abort_nowait(by_default.request_id)
                given = engine.submit(req())
                await given.abort(reason="mine")
                async with engine.submit(req()) as left:
                    pass
                running.abort_nowait()
                runner.open_gate()
                with pytest.raises(ot.RequestAbortedError) as info:
                    await running.result()
        assert info.value.reason is ot.AbortReason.USER
        assert by_default.abort_reason is ot.AbortReason.USER
        assert left.abort_reason is ot.AbortReason.CONSUMER_GONE
        assert given.abort_reason == "mine" and type(given.abort_reason) is str
        await by_default.aclose()
        await given.aclose()
    assert [reason.value for reason in ot.AbortReason] == [
        "user",
        "consumer_gone",
        "cancelled",
        "shutdown",
        "deadline",
        "client_disconnected",
        "weights_updated",
    ]
