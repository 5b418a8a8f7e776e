"""Runner faults: an Exception fails only its requests (L22), a BaseException kills (L23).

Determinism rules:

- every test runs on trio and asyncio; the runner is a ``GatedRunner`` subclass
  that raises at one call (``prepare``, ``step``, ``decode``, ``discard``,
  ``close``) for one request, named by its id, so the fault lands at a known step
  of a known request; steps run only when the test releases them;
- nothing sleeps to let time pass: the test waits for states (``wait_arrived``,
  ``wait_until``), each under a hang budget (``anyio.fail_after``);
- afterwards every test checks that no engine thread is left, that the runner
  holds no state, and that every request was counted where its handle says
  (``RequestLedger``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import anyio
import pytest
import torch

import omni_trio as ot
from omni_trio.testing import (
    FakeRunner,
    FakeState,
    GatedRunner,
    RequestLedger,
    assert_engine_idle,
    assert_nothing_left,
    probe,
    wait_until,
)
from tests.support.core import (
    BUDGET,
    RunnerBroke,
    WorkerKilled,
    check_all,
    outcome_of,
    req,
    solo_images,
)

pytestmark = pytest.mark.anyio

Call = Literal["prepare", "step", "decode", "discard", "close"]


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
                await wait_until(lambda: probe(bad).cancel_reason is not None)
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
