"""Races: cancellations at delivery, shutdown against admission, abort and completion, id reuse.

Determinism rules:

- every test runs on trio and asyncio, on a ``GatedRunner``: steps run only when
  the test releases them;
- races are made deterministic, never left to timing: a step waits at its gate
  while the other side of the race happens; a consumer is cancelled from inside
  the engine's own wake-up (``cancel_at_delivery``); "late" cleanup is held back
  by an ``anyio.Event`` until the id was reused; nothing sleeps to let time pass;
- every test has a hang budget (``anyio.fail_after``) and checks, afterwards, that
  no engine thread is left, that the runner holds no state, and that every request
  was counted where its handle says (``RequestLedger``).
"""

from __future__ import annotations

import gc
import threading
import warnings
import weakref

import anyio
import anyio.lowlevel
import pytest
import torch

import omni_trio as ot
from omni_trio.testing import (
    FakeState,
    GatedRunner,
    RequestLedger,
    assert_engine_idle,
    assert_nothing_left,
    cancel_at_delivery,
    live_objects,
    probe,
    wait_until,
)
from tests.support.core import BUDGET, check_all, outcome_of, req, solo_images, status

pytestmark = pytest.mark.anyio


# -- consumers cancelled while the result is delivered: L11, L15 ---------------


@pytest.mark.parametrize("before", [True, False], ids=["cancel_then_set", "set_then_cancel"])
async def test_consumer_cancelled_as_its_result_is_delivered(before: bool) -> None:
    """L11, L15: a cancellation racing the delivery loses nothing and duplicates nothing.

    The request stays completed (a finished result is never turned into an
    abort); the output reaches the consumer exactly once, either in the cancelled
    call or in the next one; after closing, nothing of it is left (L12).
    """
    runner = GatedRunner()
    ledger = RequestLedger()
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner) as engine:
            handle = engine.submit(req(num_steps=2), request_id="r")
            ledger.track(handle)
            got: list[ot.GenerationOutput] = []
            with anyio.CancelScope() as scope:
                cancel_at_delivery(handle, scope, before=before)
                async with anyio.create_task_group() as tg:

                    async def consume() -> None:
                        got.append(await handle.result())

                    tg.start_soon(consume)
                    await anyio.wait_all_tasks_blocked()
                    runner.open_gate()
                    await anyio.sleep_forever()
            assert scope.cancelled_caught
            assert handle.status is ot.RequestStatus.COMPLETED
            assert handle.abort_reason is None
            if not got:
                got.append(await handle.result())  # the output was kept for it
            (output,) = got
            ledger.outcome(handle, output)
            with pytest.raises(RuntimeError, match="already returned"):
                await handle.result()
            assert torch.equal(output.images, solo_images(req(num_steps=2)))
            ref = weakref.ref(output)
            del output
            got.clear()
            await handle.aclose()
            assert ref() is None  # L12: the engine kept no reference to it
            check_all(engine, runner, ledger)
            assert_engine_idle(engine)
        assert_nothing_left(engine, runner)


async def test_generate_cancelled_as_its_result_is_delivered() -> None:
    """L11, L12: generate() cancelled at delivery: the request completed, its output is freed."""
    runner = GatedRunner()
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner) as engine:
            original_submit = engine.submit
            scope = anyio.CancelScope()

            def submit(
                request: ot.GenerationRequest, *, request_id: str | None = None
            ) -> ot.RequestHandle:
                handle = original_submit(request, request_id=request_id)
                cancel_at_delivery(handle, scope)
                return handle

            engine.submit = submit  # type: ignore[method-assign,assignment]
            results: list[ot.GenerationOutput] = []
            with scope:
                async with anyio.create_task_group() as tg:

                    async def call() -> None:
                        results.append(await engine.generate(req(num_steps=2), request_id="g"))

                    tg.start_soon(call)
                    await anyio.wait_all_tasks_blocked()
                    runner.open_gate()
                    await anyio.sleep_forever()
            assert scope.cancelled_caught
            stats = engine.statistics()
            assert (stats.completed, stats.aborted) == (1, 0)
            results.clear()
            assert live_objects(ot.GenerationOutput, request_id="g") == []
            assert_engine_idle(engine)
        assert_nothing_left(engine, runner)


# -- shutdown races: L30-L36 ---------------------------------------------------


async def test_shutdown_races_admission() -> None:
    """L30, L31, L19: submitters racing aclose() are admitted or refused, never lost.

    Each submit either raises ``EngineClosedError`` (once shutdown began, always)
    or admits a request that then ends with an output or ``EngineClosedError``;
    nothing hangs and every admitted request is counted.
    """
    runner = GatedRunner()
    ledger = RequestLedger()
    outcomes: list[str] = []
    closing_seen = anyio.Event()
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner, ot.EngineConfig(max_batch_size=2)) as engine:

            async def submitter(i: int) -> None:
                for j in range(6):
                    closing = engine.statistics().is_closing
                    try:
                        handle = engine.submit(req(num_steps=2, seed=j), request_id=f"s{i}-{j}")
                    except ot.EngineClosedError:
                        outcomes.append("refused")
                        closing_seen.set()
                        return
                    assert not closing, "L30: admitted after shutdown began"
                    ledger.track(handle)
                    async with handle:
                        outcome = await outcome_of(handle)
                        ledger.outcome(handle, outcome)
                        assert isinstance(outcome, ot.GenerationOutput | ot.EngineClosedError)
                        outcomes.append(type(outcome).__name__)

            async with anyio.create_task_group() as tg:
                for i in range(4):
                    tg.start_soon(submitter, i)
                runner.release(3)
                await wait_until(lambda: runner.steps_run >= 3)
                tg.start_soon(engine.aclose)
                runner.open_gate()
            assert closing_seen.is_set()
        assert_nothing_left(engine, runner)
        ledger.check(engine)
        assert ledger.tracked == 0
        assert outcomes.count("refused") == 4  # every submitter ended refused
        assert engine.statistics().admitted == len(outcomes) - 4


@pytest.mark.parametrize("first", ["abort", "shutdown"])
async def test_shutdown_races_abort(first: str) -> None:
    """L8, L32, L34, L36: abort and aclose at the same step boundary; the first reason wins.

    ``await engine.abort`` returns ``True`` once released whichever came first;
    the request's error says which did; a second abort after shutdown answers
    ``False`` at once.
    """
    runner = GatedRunner()
    ledger = RequestLedger()
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner) as engine:
            handle = engine.submit(req(num_steps=5), request_id="r")
            ledger.track(handle)
            await runner.wait_arrived(1)
            aborted: list[bool] = []

            async def abort() -> None:
                aborted.append(await engine.abort("r"))

            async with anyio.create_task_group() as tg:
                if first == "abort":
                    tg.start_soon(abort)
                    await wait_until(lambda: probe(handle).cancel_reason is not None)
                    tg.start_soon(engine.aclose)
                    await wait_until(lambda: engine.statistics().is_closing)
                else:
                    tg.start_soon(engine.aclose)
                    await wait_until(lambda: engine.statistics().is_closing)
                    tg.start_soon(abort)
                    await anyio.wait_all_tasks_blocked()
                runner.release(1)  # the step in flight ends; the boundary drops it
            assert aborted == [True]
            async with handle:
                outcome = await outcome_of(handle)
                ledger.outcome(handle, outcome)
            expected = ot.RequestAbortedError if first == "abort" else ot.EngineClosedError
            assert isinstance(outcome, expected), outcome
            assert handle.metrics is not None and handle.metrics.steps_done == 1
            with anyio.fail_after(1):
                assert await engine.abort("r") is False
                await engine.aclose()
        assert_nothing_left(engine, runner)
        ledger.check(engine)


async def test_shutdown_races_completion() -> None:
    """L32, L33: shutdown cuts in while a request runs its last step: it is still delivered.

    Its denoising finishes at the boundary the cut lands on, so it is decoded and
    its result stays readable; a batch-mate with steps left gets EngineClosedError.
    """
    runner = GatedRunner()
    ledger = RequestLedger()
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner, ot.EngineConfig(max_batch_size=2)) as engine:
            last = engine.submit(req(num_steps=2), request_id="last")
            longer = engine.submit(req(num_steps=5, seed=4), request_id="longer")
            ledger.track(last)
            ledger.track(longer)
            runner.release(1)
            await runner.wait_arrived(2)  # both are inside step 2: last's final step
            async with anyio.create_task_group() as tg:
                tg.start_soon(engine.aclose)
                await wait_until(lambda: engine.statistics().is_closing)
                assert probe(last).cancel_reason == "shutdown"
                runner.release(1)
        async with last, longer:
            output = await last.result()
            ledger.outcome(last, output)
            assert torch.equal(output.images, solo_images(req(num_steps=2)))
            outcome = await outcome_of(longer)
            ledger.outcome(longer, outcome)
            assert isinstance(outcome, ot.EngineClosedError)
            assert longer.metrics is not None and longer.metrics.steps_done == 2
        assert_nothing_left(engine, runner)
        ledger.check(engine)


async def test_abort_of_a_waiting_request_races_the_workers_take() -> None:
    """L6, L7: the status never lies about the queue: once the worker took a request it
    reads RUNNING (abort lands at the next boundary); while it reads WAITING, abort ends it
    at once. Regression: the status used to read WAITING until the loop saw a message."""
    runner = GatedRunner()
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner, ot.EngineConfig(max_batch_size=1)) as engine:
            handle = engine.submit(req(num_steps=3), request_id="r")
            # Block the loop's thread (no checkpoint) until the worker took the request.
            assert runner.wait_until_sync(lambda: runner.prepares == 1, timeout=BUDGET)
            assert handle.status is ot.RequestStatus.RUNNING
            assert engine.statistics().waiting == 0
            assert engine.statistics().running == 1
            queued = engine.submit(req(num_steps=3), request_id="queued")
            assert queued.status is ot.RequestStatus.WAITING
            assert engine.abort_nowait("queued") is True
            assert status(queued) is ot.RequestStatus.ABORTED  # at once (L6)
            assert engine.abort_nowait("r") is True
            runner.open_gate()
            with pytest.raises(ot.RequestAbortedError):
                await handle.result()
            assert handle.metrics is not None and handle.metrics.steps_done <= 1  # L7
            await handle.aclose()
            await queued.aclose()
            assert runner.prepares == 1  # "queued" never reached the worker


# -- id reuse while the old request's cleanup is pending: L2, L3 ---------------


class HeldDiscardRunner(GatedRunner):
    """A GatedRunner whose discard of ``target`` waits until ``let_go`` is set."""

    def __init__(self, target: str) -> None:
        super().__init__()
        self.target = target
        self.discarding = threading.Event()
        self.let_go = threading.Event()

    def discard(self, state: FakeState) -> None:
        if state.request_id == self.target and not self.let_go.is_set():
            self.discarding.set()
            if not self.let_go.wait(BUDGET):
                raise RuntimeError("HeldDiscardRunner: let_go never set")
        super().discard(state)


async def test_id_reuse_while_old_cleanup_is_pending() -> None:
    """L2, L3: the old request's late cleanup never touches the new one with its id.

    While the worker still releases the old request, its id is refused (L2) and
    nothing about it changes. Once it is terminal and closed, the id is reused;
    then the old consumers' late actions run (a pending abort() returns, a
    cancelled result() unwinds, the old reader ends, the old handle is aborted and
    closed again): the new request keeps every event, is not aborted, and gets
    its own output.
    """
    runner = HeldDiscardRunner(target="r")
    ledger = RequestLedger()
    config = ot.EngineConfig(event_buffer=16)
    late = anyio.Event()
    late_results: list[object] = []
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner, config) as engine, anyio.create_task_group() as tg:
            old = engine.submit(req(num_steps=6), request_id="r")
            ledger.track(old)
            old_events: list[int] = []

            async def old_reader() -> None:
                async for event in old:
                    # As each arrives (the test reads the list while this runs).
                    old_events.append(event.step)  # noqa: PERF401
                await late.wait()
                late_results.append(await old.abort())  # late: acts on the old record

            async def old_aborter() -> None:
                late_results.append(await engine.abort("r"))  # found the old record
                await late.wait()

            caller_scope = anyio.CancelScope()

            async def old_result_caller() -> None:
                with caller_scope:
                    await old.result()
                assert caller_scope.cancelled_caught
                await late.wait()
                late_results.append("cancelled caller unwound")

            tg.start_soon(old_reader)
            await wait_until(lambda: probe(old).reading)
            runner.release(2)
            await wait_until(lambda: old_events == [1, 2])
            tg.start_soon(old_aborter)
            await wait_until(lambda: probe(old).cancel_reason is not None)
            runner.release(1)  # step 3 ends; the boundary drops "r"; discard is held
            await wait_until(runner.discarding.is_set)
            # L2: cleanup pending: the id is refused and nothing changes.
            with pytest.raises(ot.DuplicateRequestError):
                engine.submit(req(), request_id="r")
            assert old.status is ot.RequestStatus.RUNNING
            assert probe(old).cancel_reason == "user"
            tg.start_soon(old_result_caller)
            await anyio.wait_all_tasks_blocked()
            caller_scope.cancel()  # it now waits, shielded, for the release
            await anyio.wait_all_tasks_blocked()
            assert old.status is ot.RequestStatus.RUNNING
            runner.let_go.set()
            await wait_until(lambda: old.status.is_terminal)
            assert status(old) is ot.RequestStatus.ABORTED
            with pytest.raises(ot.DuplicateRequestError):  # terminal, handle open
                engine.submit(req(), request_id="r")
            # The old reader sees the end of its events before its handle closes (trio
            # runs woken tasks in a random order: it may not have yet).
            await anyio.wait_all_tasks_blocked()
            await old.aclose()
            # L3: the id is free; the new request takes it.
            new_request = req(num_steps=4, seed=9)
            new = engine.submit(new_request, request_id="r")
            ledger.track(new)
            late.set()  # now the old consumers' late actions run
            await anyio.wait_all_tasks_blocked()
            await old.aclose()
            assert await old.abort() is False
            with pytest.raises(anyio.ClosedResourceError):
                await old.result()
            assert probe(new).cancel_reason is None
            runner.open_gate()
            async with new:
                steps = [event.step async for event in new]
                output = await new.result()
                ledger.outcome(new, output)
            assert steps == [1, 2, 3, 4]
            assert output.request_id == "r"
            assert torch.equal(output.images, solo_images(new_request))
            assert new.status is ot.RequestStatus.COMPLETED
            check_all(engine, runner, ledger)
            assert_engine_idle(engine)
        assert_nothing_left(engine, runner)
    assert sorted(map(str, late_results)) == ["False", "True", "cancelled caller unwound"]


async def test_dropped_handle_after_an_error_frees_its_id_at_once() -> None:
    """L3, L14: a consumer that read the error and dropped its handle frees the id at once."""
    runner = GatedRunner()
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner) as engine:
            handle = engine.submit(req(), request_id="r")
            engine.abort_nowait("r")
            with pytest.raises(ot.RequestAbortedError):
                await handle.result()
            ref = weakref.ref(handle)
            gc.disable()
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", ResourceWarning)
                    del handle
                    alive = ref() is not None
                    try:
                        fresh = engine.submit(req(), request_id="r")
                    except ot.DuplicateRequestError:
                        fresh = None
                    if alive:
                        gc.collect()  # clean up before failing, so no warning escapes
            finally:
                gc.enable()
            if fresh is not None:
                runner.open_gate()
                await fresh.aclose()
            assert not alive, "the dropped handle is still alive"
            assert fresh is not None, "its id is still taken"
