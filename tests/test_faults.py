"""Fault injection: runner errors, worker deaths, cancellations and shutdown races.

Determinism rules:

- every test runs on trio and asyncio; the runners are ``GatedRunner`` subclasses
  that raise at one call for one request (named by its id), so the fault lands at
  a known step of a known request;
- races are made deterministic, never left to timing: a step or a decode waits at
  its gate while the other side of the race happens, a consumer is cancelled from
  inside the engine's own wake-up (a hooked ``done`` event), and "late" cleanup is
  held back by an ``anyio.Event`` until the id was reused;
- every test has a hang budget (``anyio.fail_after``) and checks, afterwards, that
  no engine thread is left, that the runner holds no state, and that every request
  was counted where its handle says (``RequestLedger``).
"""

from __future__ import annotations

import gc
import threading
import warnings
import weakref
from collections.abc import Sequence
from typing import Literal

import anyio
import anyio.lowlevel
import pytest
import torch

import omni_trio as ot
from omni_trio.testing import (
    FakeRunner,
    FakeState,
    GatedRunner,
    assert_engine_idle,
    live_objects,
    wait_until,
)

# Public in omni_trio.testing once re-exported; imported from the module meanwhile.
from omni_trio.testing._invariants import (
    RequestLedger,
    assert_nothing_left,
    check_engine_invariants,
)

from .util import BUDGET, req, solo_images

pytestmark = pytest.mark.anyio

Call = Literal["prepare", "step", "decode", "discard", "close"]


class RunnerBroke(Exception):
    """What a faulty runner raises: an ordinary error, confined to requests (L22)."""


class WorkerKilled(BaseException):
    """Not an Exception: raised from the runner, it kills the engine's thread (L23)."""


class _FaultyStep(FakeRunner):
    """The step fault, placed under GatedRunner's gate: it raises once released."""

    call: Call
    target: str
    at_step: int

    def _maybe_raise(self, call: Call, request_id: str | None = None) -> None:
        raise NotImplementedError

    def step(self, states: Sequence[FakeState]) -> None:
        for state in states:
            if state.steps_done + 1 == self.at_step:
                self._maybe_raise("step", state.request_id)
        super().step(states)


class FaultyRunner(GatedRunner, _FaultyStep):
    """A GatedRunner that raises ``error`` in one call for the request ``target``.

    ``step`` raises (once released at the gate) when ``target`` is about to run
    step ``at_step``; ``discard`` frees the state first, then raises; ``close``
    ignores ``target``.
    """

    def __init__(
        self,
        call: Call,
        error: BaseException,
        *,
        target: str = "bad",
        at_step: int = 1,
        max_batch_size: int = 4,
        gate_decodes: bool = False,
    ) -> None:
        super().__init__(max_batch_size=max_batch_size, gate_decodes=gate_decodes)
        self.call = call
        self.error = error
        self.target = target
        self.at_step = at_step
        self.raised = 0

    def _maybe_raise(self, call: Call, request_id: str | None = None) -> None:
        if call == self.call and (call == "close" or request_id == self.target):
            self.raised += 1
            raise self.error

    def prepare(self, request: ot.GenerationRequest, request_id: str) -> FakeState:
        self._maybe_raise("prepare", request_id)
        return super().prepare(request, request_id)

    def decode(self, state: FakeState) -> torch.Tensor:
        self._maybe_raise("decode", state.request_id)
        return super().decode(state)

    def discard(self, state: FakeState) -> None:
        super().discard(state)
        self._maybe_raise("discard", state.request_id)

    def close(self) -> None:
        super().close()
        self._maybe_raise("close")


def check_all(engine: ot.Engine, runner: GatedRunner, ledger: RequestLedger) -> None:
    """Invariants that hold after any fault: counts add up, the ledger agrees (L19)."""
    check_engine_invariants(engine, runner)
    ledger.check(engine)


def status(handle: ot.RequestHandle) -> ot.RequestStatus:
    """The status now (a call, so that type checkers do not narrow it across awaits)."""
    return handle.status


async def outcome_of(handle: ot.RequestHandle) -> ot.GenerationOutput | Exception:
    try:
        return await handle.result()
    except ot.OmniTrioError as exc:
        return exc


# -- the runner raises an Exception: L22 ---------------------------------------


@pytest.mark.parametrize("call", ["prepare", "decode", "discard"])
async def test_runner_error_fails_only_its_request(call: Call) -> None:
    """L22: prepare, decode or discard raising fails that request alone, cause chained.

    Its batch-mates complete with exactly the images they would have had alone
    (L9), a request admitted afterwards is served, and nothing is left held.
    """
    error = RunnerBroke(f"{call} broke")
    runner = FaultyRunner(call, error)
    ledger = RequestLedger()
    config = ot.EngineConfig(max_batch_size=4)
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner, config) as engine:
            mates = {rid: req(num_steps=3, seed=i) for i, rid in enumerate(["a", "bad", "b"])}
            handles = {rid: engine.submit(r, request_id=rid) for rid, r in mates.items()}
            for handle in handles.values():
                ledger.track(handle)
            runner.open_gate()
            for rid, handle in handles.items():
                async with handle:
                    outcome = await outcome_of(handle)
                    ledger.outcome(handle, outcome)
                    if rid == "bad":
                        assert isinstance(outcome, ot.RequestFailedError), outcome
                        assert outcome.request_id == "bad"
                        assert outcome.__cause__ is error
                        assert handle.status is ot.RequestStatus.FAILED
                    else:
                        assert isinstance(outcome, ot.GenerationOutput), outcome
                        assert torch.equal(outcome.images, solo_images(mates[rid]))
                check_all(engine, runner, ledger)
            assert runner.raised == 1
            # The engine serves on.
            after = engine.submit(req(num_steps=2, seed=7), request_id="after")
            ledger.track(after)
            async with after:
                output = await after.result()
                ledger.outcome(after, output)
            assert torch.equal(output.images, solo_images(req(num_steps=2, seed=7)))
            check_all(engine, runner, ledger)
            assert_engine_idle(engine)
        assert_nothing_left(engine, runner)
        stats = engine.statistics()
        assert (stats.completed, stats.failed) == (3, 1)


async def test_step_error_fails_its_batch_and_spares_the_queue() -> None:
    """L22: a step that raises fails exactly the requests of that step's batch.

    A request waiting with another batch key is not touched: it runs afterwards
    and completes with its own images.
    """
    error = RunnerBroke("step broke")
    runner = FaultyRunner("step", error, at_step=2)
    ledger = RequestLedger()
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner, ot.EngineConfig(max_batch_size=4)) as engine:
            bad = engine.submit(req(num_steps=3, height=16), request_id="bad")
            mate = engine.submit(req(num_steps=3, height=16, seed=2), request_id="mate")
            other_request = req(num_steps=3, height=8, width=8, seed=5)
            other = engine.submit(other_request, request_id="other")  # another batch key
            for handle in (bad, mate, other):
                ledger.track(handle)
            runner.release(1)
            await runner.wait_arrived(2)  # the batch {bad, mate} is at step 2
            assert other.status is ot.RequestStatus.WAITING
            runner.open_gate()
            async with bad, mate, other:
                for handle in (bad, mate):
                    outcome = await outcome_of(handle)
                    ledger.outcome(handle, outcome)
                    assert isinstance(outcome, ot.RequestFailedError)
                    assert outcome.request_id == handle.request_id
                    assert outcome.__cause__ is error
                    # "mate" joined at once, or at the first boundary.
                    assert handle.metrics is not None and handle.metrics.steps_done <= 1
                assert bad.metrics is not None and bad.metrics.steps_done == 1
                output = await other.result()
                ledger.outcome(other, output)
                assert torch.equal(output.images, solo_images(other_request))
            check_all(engine, runner, ledger)
            assert_engine_idle(engine)
        assert_nothing_left(engine, runner)


async def test_discard_error_after_abort_fails_that_request() -> None:
    """L8, L22: abort() still returns once released; the discard error fails the request."""
    error = RunnerBroke("discard broke")
    runner = FaultyRunner("discard", error)
    ledger = RequestLedger()
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner) as engine:
            bad = engine.submit(req(num_steps=5), request_id="bad")
            good = engine.submit(req(num_steps=2), request_id="good")
            ledger.track(bad)
            ledger.track(good)
            await runner.wait_arrived(1)
            aborted: list[bool] = []

            async def abort() -> None:
                aborted.append(await engine.abort("bad"))  # waits for the release

            async with anyio.create_task_group() as tg:
                tg.start_soon(abort)
                await wait_until(lambda: bad._record.token.reason is not None)
                runner.release(1)
            assert aborted == [True]
            assert bad.status is ot.RequestStatus.FAILED
            runner.open_gate()
            async with bad, good:
                outcome = await outcome_of(bad)
                ledger.outcome(bad, outcome)
                assert isinstance(outcome, ot.RequestFailedError)
                assert outcome.__cause__ is error
                output = await good.result()
                ledger.outcome(good, output)
            check_all(engine, runner, ledger)
        assert_nothing_left(engine, runner)


async def test_close_error_surfaces_on_exit_and_spares_results() -> None:
    """L33, L35: a runner whose close() raises: open_engine's exit says so, results stand.

    Every request had ended before the close; their outcomes are untouched, the
    threads are joined, and leaving the block raises an ``OmniTrioError`` whose
    cause is the runner's error (today ``EngineDeadError``: the engine treats any
    error out of ``close()`` as a death of its worker).
    """
    error = RunnerBroke("close broke")
    runner = FaultyRunner("close", error)
    ledger = RequestLedger()
    with anyio.fail_after(BUDGET):
        with pytest.raises(ot.OmniTrioError) as info:
            async with ot.open_engine(runner) as engine:
                handle = engine.submit(req(num_steps=2), request_id="r")
                ledger.track(handle)
                runner.open_gate()
                await wait_until(lambda: handle.status.is_terminal)
        assert info.value.__cause__ is error
        assert_nothing_left(engine, runner)
        # L33: the finished result is still there for its open handle.
        output = await handle.result()
        ledger.outcome(handle, output)
        assert output.request_id == "r"
        await handle.aclose()
        ledger.check(engine)
        assert engine.statistics().completed == 1


# -- the worker dies: L23 ------------------------------------------------------


@pytest.mark.parametrize("call", ["prepare", "step", "decode", "discard"])
async def test_worker_death_fails_live_requests_and_nothing_else(call: Call) -> None:
    """L23: a BaseException out of the runner: every live request gets EngineDeadError.

    A request that had completed before keeps its output (nothing else is
    touched), ``submit`` raises ``EngineDeadError``, leaving ``open_engine``
    raises it with the runner's exception as cause, and no thread is left.
    """
    killed = WorkerKilled(f"{call}: the device fell off the bus")
    runner = FaultyRunner(call, killed, at_step=2, max_batch_size=1)
    ledger = RequestLedger()
    with anyio.fail_after(BUDGET):
        with pytest.raises(ot.EngineDeadError) as exit_info:
            async with ot.open_engine(runner, ot.EngineConfig(max_batch_size=1)) as engine:
                early = engine.submit(req(num_steps=1), request_id="early")
                ledger.track(early)
                runner.release(1)
                await wait_until(lambda: early.status is ot.RequestStatus.COMPLETED)
                bad = engine.submit(req(num_steps=3), request_id="bad")
                waiting = engine.submit(req(num_steps=3), request_id="waiting")
                ledger.track(bad)
                ledger.track(waiting)
                runner.open_gate()
                async with bad, waiting:
                    for handle in (bad, waiting):
                        outcome = await outcome_of(handle)
                        ledger.outcome(handle, outcome)
                        assert isinstance(outcome, ot.EngineDeadError), outcome
                        assert outcome.__cause__ is killed
                        assert handle.status is ot.RequestStatus.FAILED
                with pytest.raises(ot.EngineDeadError):
                    engine.submit(req())
                assert engine.statistics().is_dead
                # The request that had completed is not touched.
                assert early.status is ot.RequestStatus.COMPLETED
                output = await early.result()
                ledger.outcome(early, output)
                await early.aclose()
                check_all(engine, runner, ledger)
        assert exit_info.value.__cause__ is killed
        assert runner.raised == 1
        assert_nothing_left(engine, runner, runner_states=False)


async def test_worker_death_discards_the_states_it_held() -> None:
    """L8, L14, L23: after the worker died, the runner holds no per-request state."""
    killed = WorkerKilled("the device fell off the bus")
    runner = FaultyRunner("step", killed, at_step=2)
    with anyio.fail_after(BUDGET), pytest.raises(ot.EngineDeadError):
        async with ot.open_engine(runner, ot.EngineConfig(max_batch_size=2)) as engine:
            handles = [engine.submit(req(num_steps=3), request_id=rid) for rid in ("a", "bad")]
            runner.open_gate()
            for handle in handles:
                async with handle:
                    with pytest.raises(ot.EngineDeadError):
                        await handle.result()
    assert runner.closed
    assert runner.live_states == 0, f"{runner.live_states} states never discarded"


# -- consumers cancelled while the result is delivered: L11, L15 ---------------


class CancelOnDelivery:
    """Stands in for a record's ``done`` event: cancels ``scope`` as the outcome lands.

    ``before`` cancels just before the event is set, otherwise just after: either
    way the cancellation reaches the consumer in the very callback that delivers
    its result, before the consumer's task runs again.
    """

    def __init__(self, event: anyio.Event, scope: anyio.CancelScope, *, before: bool) -> None:
        self._event = event
        self._scope = scope
        self._before = before

    def set(self) -> None:
        if self._before:
            self._scope.cancel()
        self._event.set()
        if not self._before:
            self._scope.cancel()

    def is_set(self) -> bool:
        return self._event.is_set()

    async def wait(self) -> None:
        await self._event.wait()


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
                record = handle._record
                record.done = CancelOnDelivery(record.done, scope, before=before)  # type: ignore[assignment]
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
                record = handle._record
                record.done = CancelOnDelivery(record.done, scope, before=False)  # type: ignore[assignment]
                return handle

            engine.submit = submit  # type: ignore[method-assign]
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
                    await wait_until(lambda: handle._record.token.reason is not None)
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
                assert last._record.token.reason == "shutdown"
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
                    old_events.append(event.step)
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
            await wait_until(lambda: old._record.reading)
            runner.release(2)
            await wait_until(lambda: old_events == [1, 2])
            tg.start_soon(old_aborter)
            await wait_until(lambda: old._record.token.reason is not None)
            runner.release(1)  # step 3 ends; the boundary drops "r"; discard is held
            await wait_until(runner.discarding.is_set)
            # L2: cleanup pending: the id is refused and nothing changes.
            with pytest.raises(ot.DuplicateRequestError):
                engine.submit(req(), request_id="r")
            assert old.status is ot.RequestStatus.RUNNING
            assert old._record.token.reason == "user"
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
            assert new._record.token.reason is None
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
