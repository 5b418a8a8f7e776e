"""The lifecycle as a state machine: generated operation lists, invariants after each.

Layout: ``tests/lifecycle/ops.py`` holds the operations and the Hypothesis
strategies that make plans of them; ``tests/lifecycle/model.py`` the model
(``Machine``) that applies each operation to a live engine and checks what it must
do; ``tests/lifecycle/sched.py`` the worker model that predicts, with one worker,
every batch and every suspension (L60, L61); this module runs plans and holds the
tests.

Determinism rules:

- Hypothesis generates a plan (an engine configuration and a list of operations);
  each example runs its plan on a fresh engine in the test's event loop, on trio
  and on asyncio. The ``ci`` profile (the default) is derandomized with 200
  examples per backend (60 for two workers); ``OMNI_TRIO_HYPOTHESIS_PROFILE=soak``
  runs 2,000 random ones per backend (1,000 for two workers).
- The runner is a ``GatedRunner``: a step runs only when the plan releases it, or
  while an operation that has to wait (``abort``, ``result()``, leaving a handle,
  shutdown) pumps the gate, one release per step that waits at it. After every
  operation the test waits until the engine is settled: no request is between two
  states, and the worker waits at the gate or idles (unused releases are taken
  back then; the gates are read before the engine, see ``Machine.settled``). So
  each operation meets a state that depends on the plan alone, and every token an
  operation sets is seen at the worker's next boundary (see ``sched`` for the two
  races that are not, and how they are resolved).
- Time only bounds: every operation runs under ``anyio.fail_after``, and nothing
  sleeps to let time pass; the polls (``wait_until``) only wait for the threads.
- Deadlines (L62) are on a virtual clock (``tests/lifecycle/clock.py``): it runs with
  real time, and the ``Advance`` operation jumps it forward by whole deadline units,
  before that operation's hang budget starts (a jump passes every cancel scope's
  deadline); deadlines are whole units too, so which have passed depends on the plan
  alone. So this module gives each backend a jumpable clock: its own
  ``anyio_backend`` fixture, over the same two backends as ``conftest.py``'s.
"""

from __future__ import annotations

import gc
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import anyio
import pytest
from hypothesis import HealthCheck, given, settings

import omni_trio as ot
from omni_trio._worker import Worker
from omni_trio.testing import assert_nothing_left, assume_step_cost
from tests.lifecycle.clock import virtual_clock_options
from tests.lifecycle.model import Machine, MachineRunner, hook_submit, note
from tests.lifecycle.ops import (
    MAX_SIZE,
    MAX_STEPS,
    PIXEL_S,
    Advance,
    Plan,
    plans,
    two_worker_plans,
)
from tests.support.core import BUDGET, WorkerKilled

WAITING = ot.RequestStatus.WAITING

_HEALTH = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
settings.register_profile(
    "ci",
    max_examples=200,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=_HEALTH,
)
settings.register_profile("soak", max_examples=2000, deadline=None, suppress_health_check=_HEALTH)
PROFILE = os.environ.get("OMNI_TRIO_HYPOTHESIS_PROFILE", "ci")
#: Examples per backend of the two-worker variant: fewer, it checks less.
TWO_WORKER_EXAMPLES = 60 if PROFILE == "ci" else 1000

#: Hang budget of one operation, and of one example's teardown (seconds).
OP_BUDGET = 10.0


def block_until(predicate: Callable[[], bool]) -> None:
    """Wait for the engine's threads in the loop's thread, blocking it: the loop cannot run.

    The worker thread needs nothing of the loop (L20), so what it does next happens
    meanwhile. Polls, under the hang budget ``BUDGET``; never a pause to let time pass.
    """
    given_up = time.monotonic() + BUDGET
    while not predicate():
        assert time.monotonic() < given_up, "the engine's threads did not get there"
        time.sleep(0.001)


def at_the_boundary(worker: threading.Thread) -> bool:
    """Whether ``worker``'s step loop waits for the pool's lock in ``Worker._boundary``.

    There it enters ``with self._cond`` (``Condition.__enter__``, then the lock's
    acquire, in C: no frame of its own); past the lock it would be in the policy's
    frames, or on the condition (``Condition.wait``).
    """
    frame = sys._current_frames().get(worker.ident or -1)
    return (
        frame is not None
        and frame.f_code is threading.Condition.__enter__.__code__
        and frame.f_back is not None
        and frame.f_back.f_code is Worker._boundary.__code__
    )


@pytest.fixture(params=["trio", "asyncio"])
def anyio_backend(request: pytest.FixtureRequest) -> tuple[str, dict[str, Any]]:
    """Both backends, each with a clock that ``Advance`` can jump (see ``clock``)."""
    backend = str(request.param)
    return backend, virtual_clock_options(backend)


async def run_plan(plan: Plan) -> None:
    """Run ``plan`` on a fresh engine, checking the invariants after every operation.

    Also callable outside pytest, to replay a plan: ``anyio.run(run_plan, plan,
    backend="trio", backend_options=virtual_clock_options("trio"))``.
    """
    runners = [MachineRunner(max_batch_size=3) for _ in range(plan.workers)]
    config = ot.EngineConfig(
        max_batch_size=plan.max_batch_size,
        max_waiting=plan.max_waiting,
        event_buffer=plan.event_buffer,
        shutdown_grace=plan.shutdown_grace,
        max_steps=MAX_STEPS,
        max_height=MAX_SIZE,
        max_width=MAX_SIZE,
        max_preemptions=plan.max_preemptions,
        tenant_weights=plan.tenant_weights,
    )
    machine: Machine | None = None
    death: ot.EngineDeadError | None = None
    try:
        async with ot.open_engine(runners if plan.workers > 1 else runners[0], config) as engine:
            # Fair share's costs from the requests alone, so the worker model
            # predicts its order (L57).
            assume_step_cost(engine, PIXEL_S)
            try:
                async with anyio.create_task_group() as tg:
                    machine = Machine(runners, engine, tg, plan)
                    hook_submit(machine)
                    tg.start_soon(machine.pump_forever)
                    final = [] if plan.final is None else [plan.final]
                    for op in [*plan.ops, *final]:
                        if isinstance(op, Advance):
                            # Before the budget starts: a jump would pass its deadline.
                            machine.advance_clock(op)
                        with anyio.fail_after(OP_BUDGET):
                            await machine.apply(op)
                            await machine.settle()
                        machine.check()
                    with anyio.fail_after(OP_BUDGET):
                        await machine.teardown()
                    # The gate was open: every step ran; replay them on the model.
                    machine.sync()
                    tg.cancel_scope.cancel()
            finally:
                for runner in runners:
                    runner.open_gate()  # never leave a worker at a closed gate
    except ot.EngineDeadError as exc:
        death = exc
    died = death is not None
    if death is not None:
        assert isinstance(death.__cause__, WorkerKilled), death.__cause__
    assert machine is not None
    stats = engine.statistics()
    # L23: leaving open_engine raised EngineDeadError exactly when the worker died
    # (with several workers only the first can die, L43).
    assert died is stats.is_dead
    for runner in runners:
        assert_nothing_left(engine, runner, runner_states=not (died or runner.died))
    machine.ledger.check(engine)
    assert machine.ledger.tracked == 0, "a request was never finished"
    for status, count in machine.ledger.counts().items():
        if count:
            note(f"some request {status.value}")
    note(f"ops applied: {len(plan.ops) // 10 * 10}+")
    if died:
        note("the worker died")
    machine.tracked.clear()
    if machine.ledger.alive():
        gc.collect()
    # L12: no event or output outlives its consumer.
    assert machine.ledger.alive() == []


@pytest.mark.anyio
@pytest.mark.timeout(3600 if PROFILE == "soak" else 120)
@settings(settings.get_profile(PROFILE))
@given(plan=plans)
async def test_lifecycle_state_machine(plan: Plan) -> None:
    """L1-L19, L22, L23, L30-L36, L57, L60-L62: any sequence of operations keeps every invariant.

    After each operation: every request ends exactly once and nothing follows its
    end (L15); the statistics add up and match each handle's status (L19); ids are
    held exactly as L2/L3 say; an idle engine's tables are empty (L14); the runner
    holds exactly the running requests' states (L8); undisturbed requests complete
    with the right images (L3, L9); aborts land within one step (L6, L7); after
    shutdown no thread is left and nothing is held (L31-L35); the worker takes
    requests by priority, then fair share between tenants, then deadline, then
    admission (L57, L60, L62), and two tenants waiting together never drift apart
    by more than one request's cost over their weights (L57); each batch is
    the one the worker model predicts, suspensions included: a strictly higher
    priority that cannot start suspends the lowest-ranked member or the whole
    batch, at most max_preemptions times each, and between tenants of one priority
    a tenant over its share of a full batch gives a place up to another's
    newcomer (L61 amended), and the suspended request resumes
    from the step it reached, its events neither repeated nor missing; ended while
    suspended it is released at once, undecoded, and the counts of suspended
    requests and suspensions agree (L61); a deadline the
    clock passes aborts its request with "deadline", at once if waiting, at the
    next step boundary if running, never decoded, and no other; an unmeetable one
    is refused (L62).
    """
    await run_plan(plan)


@pytest.mark.anyio
@pytest.mark.timeout(3600 if PROFILE == "soak" else 120)
@settings(settings.get_profile(PROFILE), max_examples=TWO_WORKER_EXAMPLES)
@given(plan=two_worker_plans)
async def test_lifecycle_state_machine_two_workers(plan: Plan) -> None:
    """L42, L43, L61: with two workers, what does not depend on placement still holds.

    The same plans on two workers, one GatedRunner each (``Release`` names the
    worker; ``Kill`` kills the first only). Which worker takes a request is the
    engine's choice, so no batch is predicted; read from the runner that prepared
    each request: every runner steps only states it prepared (a request lives its
    life on one worker, L42); each worker's ``running`` and the runner's live and
    parked states equal its running and suspended requests; the suspensions and
    ``statistics().suspended``, ``preemptions`` and ``workers_alive`` add up; once
    the first worker dies the engine lives on (L43), and a request it failed
    carries its error. Everything the one-worker
    machine checks without its worker model holds too: ends, ids, aborts within a
    step and undecoded, shutdown leaving nothing on either runner.
    """
    await run_plan(plan)


def test_profile_sizes() -> None:
    """The CI profile runs at least 200 examples; the soak profile at least 2,000."""
    assert settings.get_profile("ci").max_examples >= 200
    assert settings.get_profile("soak").max_examples >= 2000
    assert settings.get_profile(PROFILE).deadline is None
    assert TWO_WORKER_EXAMPLES >= 60


@pytest.mark.anyio
async def test_invariants_hold_while_the_worker_takes_a_request() -> None:
    """L19: the invariant check must pass when the worker takes a request during it.

    "a" holds the worker at the gate, "b" waits. Inside the check, right after it
    reads the statistics ("b" waiting), "a"'s step is let go and the worker reaches
    the boundary where it would take "b". The check reads the counts and the
    records' statuses under the workers' lock, so the worker waits for it at the
    boundary, and "b" still reads WAITING when the check reads it. Exact: the check
    goes on once the worker's step loop is at the lock, or once "b" was taken (as it
    would be, were the lock not held: then the check sees "b" waiting in the counts
    and running in the records).
    """
    from omni_trio.testing import GatedRunner, check_engine_invariants, probe
    from tests.support.core import req

    runner = GatedRunner()
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner, ot.EngineConfig(max_batch_size=1)) as engine:
            a = engine.submit(req(num_steps=1), request_id="a")
            await runner.wait_arrived(1)
            b = engine.submit(req(num_steps=1), request_id="b")
            [worker] = [t for t in engine.threads if t.name.endswith("-worker")]
            statistics = engine.statistics
            seen: list[bool] = []

            def racing_statistics() -> ot.EngineStatistics:
                stats = statistics()
                runner.release(1)  # "a" ends; the worker would take "b" at the boundary
                block_until(lambda: runner.steps_run == 1)
                block_until(lambda: at_the_boundary(worker) or probe(b).status is not WAITING)
                seen.append(at_the_boundary(worker))
                return stats

            engine.statistics = racing_statistics  # type: ignore[method-assign]
            failure: str | None = None
            try:
                check_engine_invariants(engine, runner)
            except AssertionError as exc:
                failure = repr(exc)
            finally:
                engine.statistics = statistics  # type: ignore[method-assign]
                runner.open_gate()
            for handle in (a, b):
                async with handle:
                    await handle.result()
    assert b.metrics is not None and b.metrics.steps_done == 1
    assert failure is None, failure
    assert seen == [True], "the check went on before the worker reached the lock"


@pytest.mark.anyio
async def test_settling_is_not_fooled_by_a_step_between_its_reads() -> None:
    """L20: the machine's settling reads each gate before the engine.

    "a" (one step) waits at the gate, "b" waits in the queue: settled. Then "a"'s
    step is released, and the gate, when read, first lets the worker run that step
    and reach the gate again with "b" (the worker needs nothing of the loop, L20):
    as a switch of the GIL between two reads may. "a" has run its last step and is
    not terminal yet (its output reaches the loop only once the loop runs again), so
    the engine is not settled. (Read after the records, the gate shows "b"'s step
    waiting and the records "a" before its step: settled, wrongly.)
    """
    from omni_trio.testing import wait_until
    from tests.support.core import req

    runner = MachineRunner(max_batch_size=1)
    plan = Plan(
        max_batch_size=1, max_waiting=8, event_buffer=4, shutdown_grace=0.0, ops=[], final=None
    )
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner, ot.EngineConfig(max_batch_size=1)) as engine:
            async with anyio.create_task_group() as tg:
                machine = Machine([runner], engine, tg, plan)
                a = engine.submit(req(num_steps=1), request_id="a")
                b = engine.submit(req(num_steps=1), request_id="b")
                await wait_until(machine.settled)
                at_gate = runner.at_gate

                def racing_at_gate() -> bool:
                    block_until(lambda: runner.arrived == 2)
                    return at_gate()

                runner.release(1)
                runner.at_gate = racing_at_gate  # type: ignore[method-assign]
                try:
                    settled = machine.settled()
                finally:
                    runner.at_gate = at_gate  # type: ignore[method-assign]
                    runner.open_gate()
                assert runner.arrived == 2
                for handle in (a, b):
                    async with handle:
                        await handle.result()
    assert not settled


@pytest.mark.anyio
async def test_invariants_hold_while_a_dying_worker_drops_its_suspended_requests() -> None:
    """L19, L23, L61: the counts match the statuses while a worker dies holding a suspended one.

    "low" is suspended for "high" (L61); "high"'s step kills the worker (L23). The
    loop is kept from running (the worker thread needs nothing of it, L20) until
    the dying thread has closed the runner, its last act after it emptied its
    queue of suspended requests and discarded their states. The loop has not yet
    learnt of the death, so "low" still reads WAITING, and ``statistics().waiting``
    must count it. (It counts the queues, and "low" is in none any more: waiting
    0, running 1, "low" WAITING, until the dying worker marked what it withdraws
    as its own. Found by the machine's soak: its settling polls
    ``check_engine_invariants``, which failed in that window.)
    """
    from omni_trio.testing import check_engine_invariants, wait_until
    from tests.support.core import req

    runner = MachineRunner(max_batch_size=1)
    failure: str | None = None
    with anyio.fail_after(BUDGET):
        with pytest.raises(ot.EngineDeadError):
            async with ot.open_engine(runner, ot.EngineConfig(max_batch_size=1)) as engine:
                low = engine.submit(req(num_steps=3), request_id="low")
                await runner.wait_arrived(1)
                high = engine.submit(req(num_steps=3, priority=1), request_id="high")
                runner.release(1)
                await runner.wait_arrived(2)  # "low" suspended, "high"'s step at the gate
                await wait_until(lambda: engine.statistics().suspended == 1)

                def check_once_closed() -> str | None:
                    # Blocking: the loop cannot run, so it cannot learn of the death.
                    block_until(lambda: runner.closed)
                    try:
                        check_engine_invariants(engine, runner)
                    except AssertionError as exc:
                        return repr(exc)
                    return None

                runner.kill = True
                runner.release(1)
                failure = check_once_closed()
                for handle in (low, high):
                    await handle.aclose()
    assert runner.closed and runner.died
    assert failure is None, failure
