"""The model of the lifecycle state machine: what each operation must do to an engine.

``Machine`` applies the operations of a plan (``ops``) to a live engine with one
``MachineRunner`` per worker, and checks after each what the contract says of it;
``Tracked`` is one admitted request as the model sees it. With one worker, the
worker model (``sched.WorkerModel``) predicts every batch the runner runs and how
each request ends, suspensions included (L60, L61); with two, placement is left
to the engine and only what does not depend on it is checked (see ``check_workers``).
"""

from __future__ import annotations

import gc
import math
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel
import pytest
import torch
from hypothesis import event
from hypothesis.control import currently_in_test_context

import omni_trio as ot
from omni_trio.testing import (
    FakeState,
    GatedRunner,
    RequestLedger,
    RequestProbe,
    assert_engine_idle,
    assert_nothing_left,
    check_engine_invariants,
    engine_settled,
    probe,
    probe_engine,
    wait_until,
)
from tests.support.core import Boom, WorkerKilled, expected_images, req

from .clock import jump
from .ops import (
    ABSENT_ID,
    DEADLINE_UNIT,
    INVALID_FIELD,
    MAX_SIZE,
    MAX_STEPS,
    PICKS,
    PIXEL_S,
    SLOTS,
    TIGHT_DEADLINE,
    TIGHT_PRIORITY,
    Abort,
    Advance,
    CancelCaller,
    Drop,
    FailAt,
    Generate,
    Kill,
    Leave,
    Op,
    OpenGate,
    Plan,
    Release,
    Result,
    Shutdown,
    Submit,
)
from .sched import Job, WorkerModel

#: A step nobody releases fails after this long instead of hanging (seconds).
GATE_TIMEOUT = 15.0
#: Poll interval while waiting for the engine's threads (seconds; not measured,
#: just well below the time a thread hop takes on a loaded 2-core machine).
POLL = 0.0002
#: The longest pause between polls: waits back off from ``POLL`` to this, so a long
#: wait does not keep the GIL from the engine's threads (not measured either).
POLL_MAX = 0.005


def request_for(op: Submit, size: int, ranked: dict[str, Any]) -> object:
    """What ``submit`` is given for ``op``: a valid request, or one ``op.invalid`` breaks."""
    match op.invalid:
        case "steps":
            return req(
                num_steps=MAX_STEPS + 1, height=op.size, width=op.size, seed=op.seed, **ranked
            )
        case "multiple":
            return ot.GenerationRequest(num_steps=op.steps, height=12, width=16, **ranked)
        case "width":
            return ot.GenerationRequest(num_steps=op.steps, height=8, width=MAX_SIZE + 8, **ranked)
        case "extra":
            return ot.GenerationRequest(
                num_steps=op.steps, height=8, width=8, extra={"x": 1}, **ranked
            )
        case "type":
            return {"prompt": "not a request"}
        case _:
            return req(
                num_steps=op.steps,
                height=size,
                width=size,
                seed=op.seed,
                preview_every=op.preview_every,
                **ranked,
            )


def check_refusal(op: Submit, error: ot.OmniTrioError, expected: set[type[Exception]]) -> None:
    """``submit`` refused ``op`` with ``error``: one of the ``expected``, saying why."""
    assert type(error) in expected, f"submit raised {error!r}, expected {expected}"
    if isinstance(error, ot.InvalidRequestError):
        assert op.invalid is not None and error.field == INVALID_FIELD[op.invalid], error
    if isinstance(error, ot.DeadlineError):
        # L62: the estimate is stated, and it is over the deadline.
        assert error.deadline_s == TIGHT_DEADLINE < error.estimate_s, error
        note("submit refused: deadline unmeetable")


def admitted_and_live(stats: ot.EngineStatistics) -> tuple[int, int]:
    """Admitted, and waiting plus running: exact between two reads in one loop callback.

    Only the event loop makes a request terminal, so while the test's own code runs
    neither count can move but by its submit; a worker taking a request only moves it
    from waiting to running.
    """
    return stats.admitted, stats.waiting + stats.running


class MachineRunner(GatedRunner):
    """A GatedRunner that can tell when a step waits at its gate, and kill the worker."""

    def __init__(self, *, max_batch_size: int) -> None:
        super().__init__(gate_timeout=GATE_TIMEOUT, max_batch_size=max_batch_size)
        self.granted = 0
        self.kill = False
        self.died = False  # it raised the kill
        # The requests of every step, as it reached the gate (for the worker model),
        # and the states stepped that this runner never prepared (L42: a request
        # lives its whole life on one worker).
        self.batches: list[list[ot.GenerationRequest]] = []
        self.foreign: list[FakeState] = []
        # The request of every state, and the requests decoded (by identity: the
        # engine hands the runner the very request object that was submitted).
        self.request_of: dict[FakeState, ot.GenerationRequest] = {}
        self.decoded: set[int] = set()
        # Every request the worker took, in the order it prepared them (L60).
        self.prepared: list[ot.GenerationRequest] = []

    def prepare(self, request: ot.GenerationRequest, request_id: str) -> FakeState:
        state = super().prepare(request, request_id)
        with self._changed:
            self.request_of[state] = request
            self.prepared.append(request)
        return state

    def decode(self, state: FakeState) -> torch.Tensor:
        with self._changed:
            self.decoded.add(id(self.request_of[state]))
        return super().decode(state)

    def release(self, n: int = 1) -> None:
        with self._changed:
            self.granted += n
        super().release(n)

    def revoke(self) -> None:
        """Take back the releases that no step used."""
        with self._changed:
            self.granted -= self._permits
            self._permits = 0

    def at_gate(self) -> bool:
        """Whether a step waits at the gate and no release is on its way to it.

        Every arrival at the gate either used a release or still waits; a release
        that is granted but not yet used will wake the waiting step soon.
        """
        with self._changed:
            return not self._open and self._permits == 0 and self.arrived > self.granted

    def step(self, states: Sequence[FakeState]) -> None:
        with self._changed:
            # Before the gate: a step that waits there is always recorded.
            self.batches.append([self.request_of[s] for s in states if s in self.request_of])
            self.foreign += [s for s in states if s not in self.request_of]
        super().step(states)
        if self.kill:
            self.died = True
            raise WorkerKilled("the device fell off the bus")

    def holds(self) -> set[int]:
        """The requests (by identity) whose state this runner holds now."""
        with self._changed:
            return {id(r) for s, r in self.request_of.items() if not s.discarded}


@dataclass(frozen=True)
class Counters:
    """The runners' counters summed, for the checks that take one runner.

    A runner whose worker died (L43) is left out of ``live_states``: the engine
    ends that worker's suspended requests at once, and its exiting thread discards
    their states after, so for a while it holds states of requests no longer live.
    """

    runners: Sequence[MachineRunner]

    @property
    def live_states(self) -> int:
        return sum(runner.live_states for runner in self.runners if not runner.died)

    @property
    def closed(self) -> bool:
        return all(runner.closed for runner in self.runners)


def note(text: str) -> None:
    """Count ``text`` in Hypothesis' statistics; ``run_plan`` also runs outside a test."""
    if currently_in_test_context():
        event(text)


@dataclass(eq=False)
class Tracked:
    """One admitted request as the test sees it."""

    probe: RequestProbe  # kept to follow a request whose handle is gone
    handle: ot.RequestHandle | None  # None when dropped or owned by generate()
    request_id: str
    request: ot.GenerationRequest
    reader: bool = False
    disturbed: bool = False  # something may legitimately end it other than completion
    reason: str | None = None  # the first abort reason, when this test set it
    steps_at_abort: int | None = None
    # Aborted while live with the gate closed, so before its last step ran: it
    # must end aborted (or failed), never completed (L7, L10).
    must_abort: bool = False
    output_taken: bool = False
    # result() raised the terminal error: its traceback ties the handle to the
    # frames of this test in a cycle that only the garbage collector frees, so
    # the handle is not dropped by this test.
    error_raised: bool = False
    # The rank of L60 and L62: its priority, its deadline in whole units of the
    # machine's clock (see ``Machine.epoch``; None: none), its admission order.
    priority: int = 0
    deadline_epoch: int | None = None
    admission: int = 0
    # What the worker model knows of it (one worker only).
    job: Job | None = None
    was_read: bool = False  # a consumer read its events before the teardown

    @property
    def rank(self) -> tuple[int, float, int]:
        """Smaller is taken first: higher priority, earlier deadline, earlier admission.

        Deadlines of one epoch differ by the real time between their submissions,
        so among them the earlier admission has the earlier deadline too.
        """
        deadline = math.inf if self.deadline_epoch is None else self.deadline_epoch
        return (-self.priority, deadline, self.admission)

    @property
    def status(self) -> ot.RequestStatus:
        return self.probe.status

    @property
    def token_reason(self) -> str | None:
        return self.probe.cancel_reason

    @property
    def steps_done(self) -> int:
        return self.probe.steps_done

    @property
    def suspended(self) -> bool:
        """L61: waiting again, with the state it reached parked."""
        return self.status is ot.RequestStatus.WAITING and self.probe.holds_state

    @property
    def abort_requested(self) -> bool:
        """Whether something asked the engine to end the request early, or it ended."""
        return self.probe.cancel_reason is not None or self.status.is_terminal

    @property
    def holds_id(self) -> bool:
        """L2: live, or terminal with its handle open."""
        handle_open = self.handle is not None and not self.handle.is_closed
        return not self.status.is_terminal or handle_open


_OUTCOME_ERRORS = (ot.OmniTrioError, RuntimeError, anyio.ClosedResourceError)


@dataclass(eq=False)
class Machine:
    runners: list[MachineRunner]
    engine: ot.Engine
    tg: anyio.abc.TaskGroup
    plan: Plan
    ledger: RequestLedger = field(default_factory=RequestLedger)
    tracked: list[Tracked] = field(default_factory=list)
    gate_open: bool = False
    chaos: bool = False  # a runner failure or a kill is armed
    closing: bool = False
    closed: bool = False
    pumps: list[Callable[[], bool]] = field(default_factory=list)
    generated: int = 0
    on_submit: Callable[[ot.RequestHandle], None] | None = None
    finished_ids: list[str] = field(default_factory=list)
    # Virtual time in DEADLINE_UNITs jumped so far: a deadline of ``d`` units set
    # at epoch ``e`` has passed exactly when the epoch is ``e + d`` or more.
    epoch: int = 0
    admissions: int = 0
    # What the last check saw waiting, and how many prepares it had seen (L60).
    waiting_before: list[Tracked] = field(default_factory=list)
    prepared_seen: dict[int, int] = field(default_factory=dict)
    # The live requests before the last jump of the clock: status, suspended, cancel reason.
    before_jump: dict[Tracked, tuple[ot.RequestStatus, bool, str | None]] | None = None
    # One worker: the model of its boundaries, the requests it follows (by
    # identity) and how many of the runner's batches it replayed.
    sim: WorkerModel | None = None
    simulated: dict[int, Tracked] = field(default_factory=dict)
    batches_seen: int = 0

    def __post_init__(self) -> None:
        self.counters = Counters(self.runners)
        if len(self.runners) == 1:
            self.sim = WorkerModel(
                max_batch=self.plan.max_batch_size,
                max_preemptions=self.plan.max_preemptions,
                weights=dict(self.plan.tenant_weights),
                pixel_s=PIXEL_S,
            )

    # -- helpers --

    @property
    def runner(self) -> MachineRunner:
        """The first runner (the only one, with one worker)."""
        return self.runners[0]

    def prepared(self) -> list[ot.GenerationRequest]:
        """Every request any worker prepared."""
        return [request for runner in self.runners for request in runner.prepared]

    def decoded(self, tracked: Tracked) -> bool:
        return any(id(tracked.request) in runner.decoded for runner in self.runners)

    @contextmanager
    def pumping(self, after: Callable[[], bool] | None = None) -> Iterator[None]:
        """Release every step that waits at the gate while the block runs.

        With ``after``, only once ``after()`` holds: a test that cancels a wait must
        not let the request finish before the cancellation reached the engine.
        """
        condition = after if after is not None else lambda: True
        self.pumps.append(condition)
        try:
            yield
        finally:
            self.pumps.remove(condition)

    async def pump_forever(self) -> None:
        pause = POLL
        while True:
            pause = min(pause * 2, POLL_MAX)
            if any(condition() for condition in self.pumps):
                for runner in self.runners:
                    if runner.at_gate():
                        runner.release(1)
                        pause = POLL
            await anyio.sleep(pause)

    def live(self) -> list[Tracked]:
        return [t for t in self.tracked if not t.status.is_terminal]

    def holder(self, request_id: str) -> Tracked | None:
        holders = [t for t in self.tracked if t.request_id == request_id and t.holds_id]
        assert len(holders) <= 1, f"L2: two requests hold {request_id!r}"
        return holders[0] if holders else None

    def open_handle(
        self, pick: int, *, suspended: bool = False
    ) -> tuple[Tracked, ot.RequestHandle] | None:
        """The ``pick``-th request whose handle this test holds open, if any.

        ``suspended``: among the suspended ones, if there are any.
        """
        found = [
            (t, t.handle) for t in self.tracked if t.handle is not None and not t.handle.is_closed
        ]
        if suspended and any(t.suspended for t, _ in found):
            found = [(t, handle) for t, handle in found if t.suspended]
        return found[pick % len(found)] if found else None

    def target(self, pick: int, *, suspended: bool = False) -> str:
        """The id an abort names: a request's that holds its id, a finished one, or unknown.

        ``suspended``: a suspended request's, if there is one.
        """
        held = [t.request_id for t in self.tracked if t.holds_id]
        if suspended and any(t.suspended for t in self.tracked):
            return next(t.request_id for t in self.tracked if t.suspended)
        if pick < PICKS - 2 and held:
            return held[pick % len(held)]
        if pick == PICKS - 2 and self.finished_ids:
            return self.finished_ids[-1]
        return ABSENT_ID

    def released(self, tracked: Tracked) -> bool:
        """Whether the engine's threads let go of the request's state (L8, L11).

        A dead worker never hands its states back (see test_faults).
        """
        if not tracked.probe.holds_state or self.engine.statistics().is_dead:
            return True
        worker = tracked.probe.worker
        return worker is None or not probe_engine(self.engine).workers[worker].is_alive

    def disturb_live(self) -> None:
        for tracked in self.live():
            tracked.disturbed = True

    def settled(self) -> bool:
        """Whether the engine is settled: see ``engine_settled``, and each worker waits.

        Each worker with running requests waits at its gate, and an idle one has
        nothing to take. The gates are read first: a step that waits at its gate
        then waits until this test releases it, so its worker cannot move while the
        rest is read. Read last, a gate could show the *next* step of a batch whose
        records were read before the released step ran: between the reads (a
        switch of the GIL) the worker can end that step, hand a finished member to
        the materializer and arrive at the gate again; the engine looked settled
        with that member's last step not yet run, and the check that followed saw
        it running with its state released and its output not yet delivered.
        """
        engine = self.engine
        waits = [runner.at_gate() for runner in self.runners]
        # What holds at every moment is checked while waiting too: a broken
        # invariant fails at once rather than as a timeout.
        check_engine_invariants(engine, self.counters)
        if not engine_settled(engine, self.counters):
            return False
        if engine.statistics().is_dead:
            return True
        records = probe_engine(engine).requests
        new = any(r.worker is None for r in records)
        workers = engine.statistics().workers
        for index, waiting_at_gate in enumerate(waits):
            mine = [r for r in records if r.worker == index]
            running = sum(r.status is ot.RequestStatus.RUNNING for r in mine)
            # The worker thread writes its count after it posted the releases.
            alive = workers[index].alive
            if alive and workers[index].running != running:
                return False
            if self.gate_open:
                continue
            if running:
                if not waiting_at_gate:
                    return False
            elif alive and (mine or new):
                # An idle worker takes at once: nothing waits for it, neither its
                # own suspended requests nor new ones.
                return False
        return not (self.gate_open and records)

    async def settle(self) -> None:
        await wait_until(self.settled, interval=POLL, max_interval=POLL_MAX)
        for index, runner in enumerate(self.runners):
            if not any(
                r.status is ot.RequestStatus.RUNNING and r.worker == index
                for r in probe_engine(self.engine).requests
            ):
                runner.revoke()

    def check(self) -> None:
        """The invariants after every operation."""
        engine = self.engine
        stats = check_engine_invariants(engine, self.counters)
        self.ledger.check(engine)
        # The ledger checked that each live request is the one its id finds (L3).
        for tracked in self.tracked:
            self.check_end(tracked)
        self.sync()
        if not stats.is_dead:
            # Settled: the runners hold exactly the running and suspended requests' states.
            held = sum(t.status is ot.RequestStatus.RUNNING or t.suspended for t in self.tracked)
            assert self.counters.live_states == held, (self.counters.live_states, held)
            # A dead worker's thread has discarded what it held (L43).
            left = [runner.live_states for runner in self.runners if runner.died]
            assert not any(left), f"L43: a dead worker's runner still holds {left} states"
            self.check_workers(stats)
        view = probe_engine(engine)
        if not view.live_ids and not view.open_ids and not stats.is_dead:
            assert_engine_idle(engine)  # L14
            assert self.counters.live_states == 0
        self.check_order()
        # L62: the timer holds exactly the live requests whose deadline is to come.
        pending = self.deadlines_to_come()
        assert view.pending_deadlines == len(pending), (view.pending_deadlines, pending)
        kept = [t for t in self.tracked if t.holds_id or t.reader]
        self.finished_ids += [t.request_id for t in self.tracked if t not in kept]
        self.tracked = kept

    def deadlines_to_come(self) -> list[Tracked]:
        """The live requests whose deadline has not passed on the machine's clock."""
        return [
            t
            for t in self.tracked
            if not t.status.is_terminal
            and t.deadline_epoch is not None
            and t.deadline_epoch > self.epoch
        ]

    def sync(self) -> None:
        """One worker: replay what the runner ran on the worker model; compare the ends.

        Every token the engine sees was set by an operation before it released
        any step (an operation that pumps waits for its abort to reach the engine
        first; nothing ends a request on its own), so a token newly set is seen
        at the first boundary this replay meets (unless it is loose).
        """
        sim, runner = self.sim, self.runner
        if sim is None or sim.dead:
            return
        taken = {id(request) for request in runner.prepared}
        # The worker's death cuts everything (its tokens are no operation's); the
        # step that killed it waited at the gate before any token mattered.
        dead = self.engine.statistics().is_dead
        for tracked in [] if dead else self.simulated.values():
            job = tracked.job
            assert job is not None
            reason = tracked.token_reason
            if job.where != "ended" and job.token is None and reason is not None:
                sim.cancel(job, reason, taken=id(tracked.request) in taken)
        new = runner.batches[self.batches_seen :]
        self.batches_seen += len(new)
        batches = [[self.job_of(request) for request in batch] for batch in new]
        sim.sync(batches, at_gate=runner.at_gate(), fail_at=runner.fail_at_step, kill=runner.kill)
        stats = self.engine.statistics()
        assert stats.is_dead is sim.dead, f"L23: dead {stats.is_dead}, the model says {sim.dead}"
        if sim.dead:
            return
        for tracked in list(self.simulated.values()):
            self.compare(tracked)
        parked = len(sim.parked)
        # L61: suspended requests read WAITING and keep their state; every
        # suspension and resume is counted.
        seen = (stats.suspended, runner.parked_states, stats.preemptions, runner.suspends)
        assert seen == (parked, parked, sim.preemptions, sim.preemptions), (seen, sim.parked)
        assert runner.resumes == sim.resumes, (runner.resumes, sim.resumes)
        if sim.preemptions:
            note("a request was suspended")
        if sim.resumes:
            note("a suspended request resumed")

    def job_of(self, request: ot.GenerationRequest) -> Job:
        job = self.simulated[id(request)].job
        assert job is not None
        return job

    def compare(self, tracked: Tracked) -> None:
        """Where the model has a request must be where the engine has it."""
        job, status, steps = tracked.job, tracked.status, tracked.steps_done
        assert job is not None
        engine_says = f"the engine has {tracked.request_id!r} {status.value} at step {steps}"
        match job.where:
            case "running":
                assert status is ot.RequestStatus.RUNNING, f"{job}: {engine_says}"
            case "fresh":
                assert status is ot.RequestStatus.WAITING, f"{job}: {engine_says}"
                assert not tracked.probe.holds_state, f"{job}: {engine_says}, holding state"
            case "parked":
                assert tracked.suspended, f"L61: suspended {job}: {engine_says}"
            case "ended":
                assert status.is_terminal, f"{job}: {engine_says}"
                if job.end is not None:
                    assert status is job.end, f"{job} ends {job.end.value}: {engine_says}"
                if job.ended_suspended:
                    # L61: ended while suspended: released at once, never decoded.
                    assert not self.decoded(tracked), f"L61: suspended {job} decoded"
                    assert not tracked.probe.holds_state, f"L61: suspended {job} not released"
                    note("a suspended request ended early")
                del self.simulated[id(tracked.request)]
        if job.end is not None or job.where != "ended":
            # L61: a suspended request resumes from the step it reached.
            assert steps == job.steps, f"{job}: {engine_says}"

    def check_workers(self, stats: ot.EngineStatistics) -> None:
        """L42, L43, L61: each worker's counts add up to what its runner holds.

        Read from each request's worker (the runner that prepared it) rather than
        predicted: with several workers, which one takes a request is the engine's
        choice, but every request stays on it, and the counts must agree.
        """
        records = probe_engine(self.engine).requests
        assert stats.workers_alive == sum(not r.died for r in self.runners), stats
        assert len(stats.workers) == len(self.runners)
        suspended = 0
        for index, (runner, worker) in enumerate(zip(self.runners, stats.workers, strict=True)):
            assert not runner.foreign, f"L42: runner {index} stepped states it never prepared"
            assert worker.alive is not runner.died, (index, worker)
            assert worker.preemptions == runner.suspends, (index, worker, runner.suspends)
            if runner.died:
                continue
            mine = [r for r in records if r.worker == index]
            running = sum(r.status is ot.RequestStatus.RUNNING for r in mine)
            parked = len(mine) - running
            suspended += parked
            assert worker.running == running, (index, worker, running)
            assert (runner.live_states, runner.parked_states) == (running + parked, parked), (
                index,
                runner.live_states,
                runner.parked_states,
                running,
                parked,
            )
            # Every state it holds is a request of its worker's.
            assert runner.holds() == {id(r.request) for r in mine}, f"L42: runner {index}"
        assert stats.suspended == suspended, (stats, suspended)
        assert stats.preemptions == sum(runner.suspends for runner in self.runners), stats
        if len(self.runners) > 1 and stats.preemptions:
            note("a request was suspended")

    def check_order(self) -> None:
        """L60, L62: each request a worker took ranked before every one left waiting.

        A new request (never taken) that waited at the last check and waits still
        was in the queue all along, so every request taken since was taken while
        it waited, and must rank before it. (Suspended ones are left to the worker
        model: one may run again in between, and a worse one join it; with
        several workers, it waits for its own worker only.)
        """
        taken: list[ot.GenerationRequest] = []
        for index, runner in enumerate(self.runners):
            seen = self.prepared_seen.get(index, 0)
            taken += runner.prepared[seen:]
            self.prepared_seen[index] = len(runner.prepared)
        by_request = {id(t.request): t for t in self.tracked}
        still = [
            t
            for t in self.waiting_before
            if t.status is ot.RequestStatus.WAITING and not t.probe.holds_state
        ]
        for request in taken:
            first = by_request[id(request)]
            for waiting in still:
                # Between tenants of one priority fair share decides (L57; the
                # worker model checks it): here only priority, and the rank
                # within a tenant.
                same = first.request.tenant == waiting.request.tenant
                assert (first.rank < waiting.rank) if same else first.rank[0] <= waiting.rank[0], (
                    f"L60: {first.request_id!r} {first.rank} was taken while"
                    f" {waiting.request_id!r} {waiting.rank} waited"
                )
        if taken and still:
            note("a request was taken while a worse-ranked one waited")
        self.waiting_before = [t for t in self.tracked if t.status is ot.RequestStatus.WAITING]

    def check_end(self, tracked: Tracked) -> None:
        """How a request ended must match what happened to it."""
        status = tracked.status
        if not status.is_terminal:
            return
        if not tracked.disturbed:
            assert status is ot.RequestStatus.COMPLETED, f"undisturbed {tracked} ended {status}"
        if tracked.reason is not None and status is ot.RequestStatus.ABORTED:
            assert tracked.token_reason == tracked.reason  # the first reason wins
        if tracked.must_abort:
            assert status is not ot.RequestStatus.COMPLETED, f"L10: aborted {tracked} completed"
            assert not self.decoded(tracked), f"L10: {tracked} decoded"
        if tracked.steps_at_abort is not None and status is ot.RequestStatus.ABORTED:
            # L7: at most one more step after the abort.
            assert tracked.steps_done <= tracked.steps_at_abort + 1, tracked
        if status is ot.RequestStatus.FAILED:
            assert self.chaos, f"{tracked} failed with no failure armed"

    def take_outcome(
        self, tracked: Tracked, handle: ot.RequestHandle, outcome: ot.GenerationOutput | Exception
    ) -> None:
        self.ledger.outcome(handle, outcome)
        if isinstance(outcome, ot.RequestError | ot.EngineClosedError | ot.EngineDeadError):
            tracked.error_raised = True
        metrics = handle.metrics
        if metrics is not None and tracked.job is not None and tracked.job.end is not None:
            # L61: its metrics count its suspensions.
            assert metrics.preemptions == tracked.job.preemptions, (metrics, tracked.job)
        if isinstance(outcome, ot.GenerationOutput):
            assert not tracked.output_taken, "L15: output returned twice"
            tracked.output_taken = True
            assert torch.equal(outcome.images, expected_images(tracked.request)), (
                f"L3, L9: wrong images for {tracked.request_id!r}"
            )
        elif isinstance(outcome, ot.RequestFailedError):
            # A runner failure; with several workers, a worker's death too (L43).
            causes = (RuntimeError, WorkerKilled) if len(self.runners) > 1 else RuntimeError
            assert isinstance(outcome.__cause__, causes), outcome.__cause__
        elif isinstance(outcome, ot.EngineDeadError):
            assert isinstance(outcome.__cause__, WorkerKilled), outcome.__cause__
        if not tracked.disturbed:
            assert isinstance(outcome, ot.GenerationOutput) or (
                tracked.output_taken and isinstance(outcome, RuntimeError)
            ), f"undisturbed {tracked.request_id!r} got {outcome!r}"

    async def read_events(self, tracked: Tracked, handle: ot.RequestHandle) -> None:
        tracked.was_read = True
        try:
            async for event in handle:
                self.ledger.event(handle, event)
        except anyio.ClosedResourceError:
            pass  # closed by another operation while reading
        finally:
            tracked.reader = False

    def track(
        self,
        handle: ot.RequestHandle,
        request: ot.GenerationRequest,
        *,
        keep: bool,
        deadline_epoch: int | None = None,
        loose: bool = False,
    ) -> Tracked:
        """Follow an admitted request; ``keep``: this test holds its handle.

        ``loose``: the engine may see its abort at a moment of the threads' choosing
        (see ``sched``).
        """
        self.ledger.track(handle)
        self.admissions += 1
        tracked = Tracked(
            probe(handle),
            handle if keep else None,
            handle.request_id,
            request,
            priority=request.priority,
            deadline_epoch=deadline_epoch,
            admission=self.admissions,
        )
        self.tracked.append(tracked)
        if self.sim is not None:
            tracked.job = Job(tracked.request_id, request, tracked.rank, loose=loose)
            self.sim.admit(tracked.job)
            self.simulated[id(request)] = tracked
        return tracked

    # -- operations --

    async def apply(self, op: Op) -> None:
        note(f"op {type(op).__name__}")
        match op:
            case Submit():
                self.submit(op)
            case Release(n, worker):
                self.runners[worker % len(self.runners)].release(n)
            case OpenGate():
                self.open_gate()
            case Abort():
                await self.abort(op)
            case Leave():
                await self.leave(op)
            case CancelCaller(pick, "result"):
                await self.cancel_result(pick)
            case CancelCaller(_, "generate"):
                await self.generate(MAX_STEPS, cancel=True)
            case Generate(steps):
                await self.generate(steps, cancel=False)

            case Result(pick):
                await self.result(pick)
            case Drop(pick):
                self.drop(pick)
            case FailAt(step):
                self.fail_at(step)
            case Kill():
                # With several workers only the first dies: the others serve on (L43).
                self.runner.kill = True
                self.chaos = True
                self.disturb_live()
            case Shutdown(background):
                await self.shutdown(background=background)
            case Advance():
                await self.check_expiry()
            case _:
                raise AssertionError(op)

    def fail_at(self, step: int | None) -> None:
        """Arm every runner to fail its ``step``-th step (L22); ``None`` disarms them."""
        for runner in self.runners:
            runner.fail_at_step = step
        if step is not None:
            self.chaos = True
            self.disturb_live()

    def expected_admission_error(
        self, request_id: str | None, invalid: str | None, *, tight: bool = False
    ) -> set[type[Exception]]:
        """What submit must raise (empty: it must admit), by the order L30, L4, L2, L62, L5.

        ``tight``: the request's deadline is one no estimate meets, and a step was
        measured: ``DeadlineError``, unless an earlier check refuses it.
        """
        stats = self.engine.statistics()
        if stats.is_dead:
            return {ot.EngineDeadError}
        if self.closing:
            return {ot.EngineClosedError}
        if invalid in ("type", "empty_id"):
            return {ot.InvalidRequestError}
        errors: set[type[Exception]] = set()
        if request_id is not None and self.holder(request_id) is not None:
            errors.add(ot.DuplicateRequestError)
        if invalid is not None:
            errors.add(ot.InvalidRequestError)
        if not errors and tight:
            errors.add(ot.DeadlineError)
        if not errors:
            waiting = sum(t.status is ot.RequestStatus.WAITING for t in self.tracked)
            if waiting >= self.plan.max_waiting:
                errors.add(ot.QueueFullError)
        return errors

    def tight_refused(self, size: int) -> bool:
        """L62: whether admission refuses a ``TIGHT_DEADLINE`` request of ``size`` now.

        At ``TIGHT_PRIORITY`` it is ranked behind everything waiting (new or
        suspended) and preempts nothing, so it is refused exactly when something
        waits or no live worker could start it at the next boundary: each runs a
        batch that is full or has another batch key. Settled between operations,
        no worker moves meanwhile (nor with the gate open: then nothing is live).
        """
        engine = probe_engine(self.engine)
        records = engine.requests
        if any(r.status is ot.RequestStatus.WAITING for r in records):
            return True
        places = min(self.plan.max_batch_size, self.runner.capabilities.max_batch_size)
        for index, worker in enumerate(engine.workers):
            batch = [r for r in records if r.worker == index]
            if not worker.is_alive:
                continue
            if not batch:
                return False
            key = (batch[0].request.height, batch[0].request.width, batch[0].request.num_images)
            if len(batch) < places and key == (size, size, 1):
                return False
        return True

    def submit(self, op: Submit) -> None:
        request_id = None if op.slot is None else f"r{op.slot}"
        if op.invalid == "empty_id":
            request_id = ""
        deadline = op.deadline
        workers = probe_engine(self.engine).workers
        if deadline == "tight" and (
            any(w.step_s is None for w in workers if w.is_alive) or not self.tight_refused(op.size)
        ):
            # Admitted, it would expire at a moment of the threads' choosing: sent
            # only when admission must refuse it.
            deadline = None
        deadline_s = None
        if deadline is not None:
            deadline_s = TIGHT_DEADLINE if deadline == "tight" else deadline * DEADLINE_UNIT
        priority, size = op.priority, op.size
        running = [t for t in self.tracked if t.status is ot.RequestStatus.RUNNING]
        if deadline == "tight":
            priority = TIGHT_PRIORITY
        elif op.urgent and running:
            priority = max([priority, *(t.priority + 1 for t in running)])
            # Not joinable while the batch has room (another batch key), so it
            # starts only by suspending the whole batch (L61); a full batch it
            # joins (the batch's key) gives up its lowest-ranked member.
            size = running[0].request.height
            if len(running) < self.plan.max_batch_size:
                size = 8 if size == 16 else 16
        ranked: dict[str, Any] = {
            "deadline_s": deadline_s,
            "priority": priority,
            "tenant": op.tenant,
        }
        request = request_for(op, size, ranked)
        tight = deadline == "tight" and op.invalid != "type"
        expected = self.expected_admission_error(request_id or None, op.invalid, tight=tight)
        before = self.engine.statistics()
        error: ot.OmniTrioError | None = None
        try:
            handle = self.engine.submit(request, request_id=request_id)  # type: ignore[arg-type]
        except ot.OmniTrioError as exc:
            error = exc
        if error is not None:
            check_refusal(op, error, expected)
            after = self.engine.statistics()
            assert admitted_and_live(after) == admitted_and_live(before)
            return
        assert not expected, f"submit admitted, expected {expected}"
        assert isinstance(request, ot.GenerationRequest)
        # L1: admitted synchronously, visible at once. An idle worker may take it
        # the moment it is queued (a thread switch can come at any bytecode), so the
        # exact check is "live", not "waiting": the gated tests pin WAITING itself.
        assert handle.status in (ot.RequestStatus.WAITING, ot.RequestStatus.RUNNING)
        after = self.engine.statistics()
        admitted, live = admitted_and_live(before)
        assert admitted_and_live(after) == (admitted + 1, live + 1)
        epoch = self.epoch + deadline if isinstance(deadline, int) else None
        tracked = self.track(handle, request, keep=True, deadline_epoch=epoch)
        tracked.disturbed = self.chaos
        if epoch is not None:
            note(f"submit with a deadline, priority {priority}")
        if op.read:
            tracked.reader = True
            self.tg.start_soon(self.read_events, tracked, handle)

    async def abort(self, op: Abort) -> None:
        request_id = self.target(op.pick, suspended=op.suspended)
        tracked = self.holder(request_id)
        live = tracked is not None and not tracked.status.is_terminal
        assert live == (request_id in probe_engine(self.engine).live_ids), (
            "model and engine disagree"
        )
        if op.how == "handle" and (
            tracked is None or tracked.handle is None or tracked.handle.is_closed
        ):
            return
        first = tracked is not None and live and tracked.token_reason is None
        suspended = tracked is not None and tracked.suspended
        waiting = tracked is not None and tracked.status is ot.RequestStatus.WAITING
        waiting = waiting and not suspended
        state = "unknown" if tracked is None else tracked.status.value
        note(f"abort of a {'suspended' if suspended else state} request ({op.how})")
        steps_before = tracked.steps_done if tracked is not None else 0
        if first:
            assert tracked is not None
            tracked.disturbed = True
            tracked.reason = op.reason
            tracked.steps_at_abort = steps_before
            tracked.must_abort = not self.gate_open
        with self.pumping():
            match op.how:
                case "nowait":
                    found = self.engine.abort_nowait(request_id, reason=op.reason)
                case "await":
                    found = await self.engine.abort(request_id, reason=op.reason)
                case "handle":
                    assert tracked is not None and tracked.handle is not None
                    found = await tracked.handle.abort(reason=op.reason)
        assert found is live, f"L8: abort of {request_id!r} returned {found}"
        if tracked is None or not live:
            return
        if first:
            assert tracked.token_reason == op.reason
        if waiting and not self.gate_open:
            # L6: a request in the queue ends at once and never reaches the worker.
            assert tracked.status is ot.RequestStatus.ABORTED, tracked
            assert tracked.steps_done == 0
        # A suspended one is released at once, with no step (the worker model
        # checks it after settling: L61).
        if op.how != "nowait":
            # L8: returns once the request is terminal and released.
            assert tracked.status.is_terminal
            assert self.released(tracked)

    def advance_clock(self, op: Advance) -> None:
        """Jump the clock ``op.units`` deadline units; call it outside any hang budget.

        A jump passes every cancel scope's deadline (see ``clock``): ``run_plan``
        calls this before it starts the operation's budget, and the clock stands
        still while shutting down, whose grace period is such a deadline. It gates
        nothing and releases nothing: a running request whose deadline passed waits
        at the gate, as after an ``abort_nowait``, until a later operation lets its
        step run (teardown opens the gate).
        """
        if self.closing:
            self.before_jump = None
            return
        self.before_jump = {t: (t.status, t.suspended, t.token_reason) for t in self.live()}
        self.epoch += op.units
        jump(op.units * DEADLINE_UNIT)

    async def check_expiry(self) -> None:
        """L62: every deadline the jump passed expired, at once if waiting; no other did."""
        before, self.before_jump = self.before_jump, None
        if before is None:
            note("no jump: shutting down")
            return
        expired = [
            t for t in before if t.deadline_epoch is not None and t.deadline_epoch <= self.epoch
        ]
        # The timer task runs on the loop's next turns; nothing else can end them.
        # Its count too: a request that something aborted before still leaves it.
        to_come = len(self.deadlines_to_come())
        await wait_until(
            lambda: (
                all(t.abort_requested for t in expired)
                and probe_engine(self.engine).pending_deadlines == to_come
            ),
            interval=POLL,
            max_interval=POLL_MAX,
        )
        for tracked, (status, suspended, reason) in before.items():
            if tracked not in expired:
                assert tracked.token_reason == reason, f"L62: {tracked} ended before its deadline"
                continue
            note(f"deadline passed for a {'suspended' if suspended else status.value} request")
            if reason is None:
                assert tracked.token_reason == "deadline", tracked
                tracked.disturbed = True
                tracked.reason = "deadline"
                tracked.steps_at_abort = tracked.steps_done
                tracked.must_abort = not self.gate_open
            if suspended:
                # L61, L62: released at once, with no step (the worker model checks it
                # after settling); it reads RUNNING while the materializer releases it.
                pass
            elif status is ot.RequestStatus.WAITING:
                # L6, L62: a waiting request ends at once and never reaches the worker.
                assert tracked.status is ot.RequestStatus.ABORTED, tracked
                assert tracked.steps_done == 0 and not tracked.probe.holds_state, tracked
                assert all(r is not tracked.request for r in self.prepared()), tracked
            elif not self.gate_open and not self.engine.statistics().is_dead:
                # L7, L62: a running one stops at its next step boundary, and its
                # step waits at the gate.
                assert tracked.status is ot.RequestStatus.RUNNING, tracked

    async def leave(self, op: Leave) -> None:
        found = self.open_handle(op.pick, suspended=op.suspended)
        if found is None:
            return
        tracked, handle = found
        live = not tracked.status.is_terminal
        # With the gate open the request may end on its own before the exit.
        first = live and tracked.token_reason is None and not self.gate_open
        if live:
            tracked.disturbed = True
        with self.pumping(after=lambda: tracked.abort_requested):
            match op.how:
                case "aclose":
                    await handle.aclose()
                case "exit":
                    async with handle:
                        pass
                case "exception":
                    with pytest.raises(Boom):
                        async with handle:
                            raise Boom
                case "cancel":
                    with anyio.CancelScope() as scope:
                        async with handle:
                            scope.cancel()
                            await anyio.sleep_forever()
                    assert scope.cancelled_caught
        # L11: the exit returned only after the release; L12: nothing kept.
        assert handle.is_closed and tracked.status.is_terminal
        assert self.released(tracked)
        if first:
            expected = "cancelled" if op.how == "cancel" else "consumer_gone"
            assert tracked.token_reason == expected
            tracked.reason = expected
            tracked.must_abort = True

    async def cancel_result(self, pick: int) -> None:
        """L11: cancelling a task that waits in result() aborts with 'cancelled'."""
        found = self.open_handle(pick)
        if found is None:
            return
        tracked, handle = found
        live = not tracked.status.is_terminal
        first = live and tracked.token_reason is None and not self.gate_open
        if live:
            tracked.disturbed = True
        outcome: list[ot.GenerationOutput | Exception] = []
        with self.pumping(after=lambda: tracked.abort_requested):
            with anyio.CancelScope() as scope:
                async with anyio.create_task_group() as tg:

                    async def cancel_soon() -> None:
                        for _ in range(3):
                            await anyio.lowlevel.checkpoint()
                        scope.cancel()

                    tg.start_soon(cancel_soon)
                    try:
                        outcome.append(await handle.result())
                    except _OUTCOME_ERRORS as exc:
                        outcome.append(exc)
        if outcome:
            self.take_outcome(tracked, handle, outcome[0])
        elif live:
            # The wait was cancelled: the request ended, released, before it returned.
            assert tracked.status.is_terminal
            assert self.released(tracked)
            if first:
                assert tracked.token_reason == "cancelled"
                tracked.reason = "cancelled"
                tracked.must_abort = True
        del outcome

    async def generate(self, steps: int, *, cancel: bool) -> None:
        """generate(): submit and wait in one call; cancelled, it aborts (L11)."""
        self.generated += 1
        request_id = f"g{self.generated}"
        request = req(
            num_steps=steps,
            height=8,
            width=8,
            seed=self.generated % 4,
            priority=0,
        )
        expected = self.expected_admission_error(request_id, None)
        results: list[ot.GenerationOutput | Exception] = []
        admitted: list[tuple[Tracked, ot.RequestHandle]] = []

        # Cancelled, its abort races the worker's take when the worker idles, and
        # any boundary with the gate open.
        idle = not any(t.status is ot.RequestStatus.RUNNING for t in self.tracked)
        loose = cancel and (self.gate_open or idle)

        def on_submit(handle: ot.RequestHandle) -> None:
            # Inside generate(), right after its submit: track it before it can end.
            tracked = self.track(handle, request, keep=False, loose=loose)
            tracked.disturbed = self.chaos or cancel
            admitted.append((tracked, handle))

        async def call() -> None:
            try:
                results.append(await self.engine.generate(request, request_id=request_id))
            except _OUTCOME_ERRORS as exc:
                results.append(exc)

        def may_pump() -> bool:
            # Cancelled: only once the cancellation reached the engine.
            return bool(admitted) and (not cancel or admitted[0][0].abort_requested)

        self.on_submit = on_submit
        try:
            with self.pumping(after=may_pump), anyio.CancelScope() as scope:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(call)
                    await wait_until(
                        lambda: bool(results or admitted), interval=POLL, max_interval=POLL_MAX
                    )
                    if cancel:
                        scope.cancel()
        finally:
            self.on_submit = None
        if not admitted:
            assert len(results) == 1 and isinstance(results[0], ot.OmniTrioError)
            assert type(results[0]) in expected, (results, expected)
            return
        assert not expected, f"generate admitted, expected {expected}"
        [(tracked, handle)] = admitted
        # L11: generate() returns or is cancelled only once the request was released.
        assert handle.is_closed and tracked.status.is_terminal
        assert self.released(tracked)
        if results:
            self.take_outcome(tracked, handle, results[0])
        else:
            # Cancelled: the request was aborted, unless it had ended already.
            assert cancel
            ended = tracked.status in (ot.RequestStatus.COMPLETED, ot.RequestStatus.FAILED)
            assert tracked.token_reason == "cancelled" or ended, tracked

    async def result(self, pick: int) -> None:
        found = self.open_handle(pick)
        if found is None:
            return
        tracked, handle = found
        outcome: ot.GenerationOutput | Exception
        if self.closed:
            # L34: after shutdown, a wait returns at once, with nothing pumped.
            with anyio.fail_after(2):
                try:
                    outcome = await handle.result()
                except _OUTCOME_ERRORS as exc:
                    outcome = exc
        else:
            with self.pumping():
                try:
                    outcome = await handle.result()
                except _OUTCOME_ERRORS as exc:
                    outcome = exc
        self.take_outcome(tracked, handle, outcome)

    def drop(self, pick: int) -> None:
        """L14: a consumer that drops its handle without closing it."""
        found = self.open_handle(pick)
        if found is None or found[0].reader or found[0].error_raised:
            return
        tracked, handle = found
        ref = weakref.ref(handle)
        tracked.handle = None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            del found, handle
            if ref() is not None:
                gc.collect()
        assert ref() is None, "something still holds the dropped handle"

    async def shutdown(self, *, background: bool) -> None:
        suspended = [t for t in self.tracked if t.suspended]
        waiting = [
            t for t in self.tracked if t.status is ot.RequestStatus.WAITING and t not in suspended
        ]
        running = [t for t in self.tracked if t.status is ot.RequestStatus.RUNNING]
        note(f"shutdown with waiting: {bool(waiting)}, running: {bool(running)}")
        if suspended:
            note("shutdown with a suspended request")
        waiting += suspended
        if not self.closing:
            self.closing = True
            if self.sim is not None:
                # Without a grace period the worker stops at its next boundary.
                self.sim.stopping = self.plan.shutdown_grace == 0
            for tracked in running:
                # L32: within a grace period a running request may still finish.
                tracked.disturbed = tracked.disturbed or self.plan.shutdown_grace == 0
            for tracked in waiting:
                tracked.disturbed = True
        closed = anyio.Event()

        async def close() -> None:
            await self.engine.aclose()
            closed.set()

        self.tg.start_soon(close)
        await wait_until(
            lambda: self.engine.statistics().is_closing, interval=POLL, max_interval=POLL_MAX
        )
        # L30: admission stopped.
        error = ot.EngineDeadError if self.engine.statistics().is_dead else ot.EngineClosedError
        with pytest.raises(error):
            self.engine.submit(req(num_steps=1, height=8, width=8, seed=0))
        # L61: a suspended request is released at once, with no step released.
        await wait_until(
            lambda: all(t.status.is_terminal for t in suspended),
            interval=POLL,
            max_interval=POLL_MAX,
        )
        # L31: waiting requests ended at once, cut off by shutdown.
        for tracked in waiting:
            assert tracked.status is ot.RequestStatus.ABORTED, tracked
            assert tracked.token_reason == "shutdown"
        for tracked in suspended:
            assert not self.decoded(tracked) and self.released(tracked), tracked
        for tracked in running:
            # L32: without a grace period, running requests are cut at once;
            # with one, they may go on (grace periods here outlast any plan).
            if self.plan.shutdown_grace == 0:
                assert tracked.token_reason is not None, tracked
            else:
                assert tracked.token_reason != "shutdown", tracked
        if background:
            return
        with self.pumping():
            await closed.wait()
        self.closed = True
        # L31-L35: everything ended, the threads are gone, the runner closed.
        dead = self.engine.statistics().is_dead
        for runner in self.runners:
            assert_nothing_left(self.engine, runner, runner_states=not (dead or runner.died))
        for tracked in self.tracked:
            assert tracked.status.is_terminal
        # L34: waits after shutdown return at once.
        with anyio.fail_after(2):
            for slot in range(SLOTS + 1):
                assert await self.engine.abort(f"r{slot}") is False

    def open_gate(self) -> None:
        for runner in self.runners:
            runner.open_gate()
        self.gate_open = True

    async def teardown(self) -> None:
        """Let everything run, take every outcome, close every handle, shut down."""
        self.open_gate()
        for tracked in list(self.tracked):
            handle = tracked.handle
            if handle is None or handle.is_closed:
                continue
            if not tracked.reader:
                ended = tracked.status.is_terminal  # nothing is added while reading
                steps = []
                async for event in handle:
                    self.ledger.event(handle, event)
                    steps.append(event.step)
                if tracked.status is ot.RequestStatus.COMPLETED and steps:
                    # L13: the newest events are kept: the last step is never dropped.
                    assert steps[-1] == tracked.request.num_steps, steps
                if ended and tracked.status is ot.RequestStatus.COMPLETED and not tracked.was_read:
                    # L13, L61: nobody read them, so the newest ``event_buffer`` are
                    # kept, one per step, none repeated or missing across suspensions.
                    last = tracked.request.num_steps
                    first = max(1, last - self.plan.event_buffer + 1)
                    assert steps == list(range(first, last + 1)), (tracked.request_id, steps)
            if not tracked.output_taken:
                try:
                    outcome: ot.GenerationOutput | Exception = await handle.result()
                except _OUTCOME_ERRORS as exc:
                    outcome = exc
                self.take_outcome(tracked, handle, outcome)
                del outcome
            await handle.aclose()
        sim = self.sim
        if sim is not None and any(
            job.token is None for job in [*sim.running, *sim.fresh, *sim.parked]
        ):
            # What still runs (a dropped handle's request) is cut by this shutdown,
            # with the gate open, at a boundary of the threads' choosing: the worker
            # model does not replay the teardown.
            note("teardown with a dropped request still live")
            self.sim = None
        await self.engine.aclose()
        self.closed = True


def hook_submit(machine: Machine) -> None:
    """Let the machine see the handles that generate() submits internally."""
    engine = machine.engine
    original = engine.submit

    def submit(request: ot.GenerationRequest, *, request_id: str | None = None) -> ot.RequestHandle:
        handle = original(request, request_id=request_id)
        if machine.on_submit is not None:
            machine.on_submit(handle)
        return handle

    engine.submit = submit  # type: ignore[method-assign,assignment]
