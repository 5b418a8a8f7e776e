"""Invariants of a running engine, a ledger of request outcomes, and leak checks.

These are the checks of the lifecycle state-machine tests, public so that code
built on omni_trio can run the same ones:

- ``check_engine_invariants(engine, runner)``: what must hold at *every* moment
  the event loop looks (L14, L19), whatever the engine's threads are doing.
- ``engine_settled(engine, runner)``: whether no request is between two states,
  so that exact equalities (runner states == running requests) can be asserted.
- ``RequestLedger``: follows every request through its handle and asserts that it
  ends exactly once, that nothing is delivered after its end, and that the
  statistics count each request where its handle says it is (L15, L17, L19).
- ``assert_nothing_left(engine, runner)``: after shutdown, nothing is alive (L35).
- ``RunnerCounters``: the protocol of the runner counters these read.

All of them must be called from the event loop's thread (the thread that runs the
engine), never from a runner.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import anyio

from .._errors import (
    EngineClosedError,
    EngineDeadError,
    RequestAbortedError,
    RequestError,
    RequestFailedError,
)
from .._outputs import EngineStatistics, GenerationOutput, RequestMetrics, RequestStatus, StepEvent
from .._reasons import AbortReason
from ._checks import assert_no_engine_threads
from ._probe import RequestProbe

if TYPE_CHECKING:
    from .._engine import Engine
    from .._handle import RequestHandle
    from .._record import Record

__all__ = [
    "RequestLedger",
    "RunnerCounters",
    "assert_nothing_left",
    "check_engine_invariants",
    "engine_settled",
]

_STATUSES = tuple(RequestStatus)
# Float slack for metrics identities that hold exactly up to rounding.
_EPS = 1e-6


class RunnerCounters(Protocol):
    """What the checks read from a runner: ``FakeRunner`` and ``GatedRunner`` have it."""

    @property
    def live_states(self) -> int:
        """Per-request states the runner holds now."""
        ...

    @property
    def closed(self) -> bool:
        """Whether ``close()`` was called."""
        ...


def _counts(stats: EngineStatistics) -> dict[RequestStatus, int]:
    return {
        RequestStatus.WAITING: stats.waiting,
        RequestStatus.RUNNING: stats.running,
        RequestStatus.COMPLETED: stats.completed,
        RequestStatus.ABORTED: stats.aborted,
        RequestStatus.FAILED: stats.failed,
    }


def check_engine_invariants(
    engine: Engine, runner: RunnerCounters | None = None
) -> EngineStatistics:
    """Assert what holds at every moment, whatever the engine's threads do; return the stats.

    - L19: every admitted request is counted in exactly one status, no count is
      negative, and the live table holds exactly the waiting and running ones.
    - L2, L3: the live table is keyed by each record's own id; an id held by a
      terminal request belongs to its open handle, never to a live request too.
    - L14: nothing waits in the worker's queue that the engine does not count.
    - L8: with ``runner``, every state the runner holds belongs to a live request
      that the worker took (a request becomes terminal only after its release),
      so an idle engine's runner holds none. Skipped once the worker died: a dead
      worker cannot release anything.

    Raises:
        AssertionError: naming the broken invariant.
    """
    # Read the runner first: a state it holds now belongs to a request that was
    # taken before and that stays live until this (synchronous) check returns.
    states = runner.live_states if runner is not None else 0
    # The counts and the records' statuses in one moment: under the workers' lock,
    # which a worker holds to take a request (WAITING becomes RUNNING there).
    with engine._pool.cond:
        stats = engine.statistics()
        live = dict(engine._live)
        statuses = {request_id: record.status for request_id, record in live.items()}
    counts = _counts(stats)
    assert all(count >= 0 for count in counts.values()), f"negative count: {stats}"
    assert stats.admitted == sum(counts.values()), f"L19: counts do not add up: {stats}"
    taken = 0
    live_counts = dict.fromkeys(_STATUSES, 0)
    for request_id, record in live.items():
        assert record.request_id == request_id, f"live table key {request_id!r} names another"
        status = statuses[request_id]
        assert not status.is_terminal, f"terminal request {request_id!r} still live"
        live_counts[status] += 1
        taken += record.t_taken is not None
    assert live_counts[RequestStatus.WAITING] == stats.waiting, (live_counts, stats)
    assert live_counts[RequestStatus.RUNNING] == stats.running, (live_counts, stats)
    for request_id, handle in list(engine._terminal_open.items()):
        assert request_id not in live, f"L2: id {request_id!r} is live and terminal-open"
        assert handle.request_id == request_id
        assert handle.status.is_terminal, f"open-terminal table holds live {request_id!r}"
        assert not handle.is_closed, f"closed handle {request_id!r} still holds its id"
    queued = engine._pool.counts()[0]
    assert queued <= stats.waiting, (queued, stats)
    if stats.is_dead:
        assert not live, f"L23: requests outlived the worker: {sorted(live)}"
    elif runner is not None:
        assert 0 <= states <= taken, (
            f"L8: the runner holds {states} states but only {taken} live requests were taken"
        )
    return stats


def engine_settled(engine: Engine, runner: RunnerCounters | None = None) -> bool:
    """Return whether no request of ``engine`` is between two states.

    Settled means: no request is taken but not yet running, nor released or
    decoded but not yet terminal; and with ``runner``, the runner holds exactly
    one state per running request. It does not say that the worker waits (it may
    be inside a step it was allowed to run): with a gated runner whose gate is
    closed, also check that a step waits at the gate; then nothing changes until
    the test releases a step. Check the gate *before* calling this: checked after,
    it may show the next step, and this the records as they were before the step
    released last ran (the worker can run a step, hand a finished request to the
    materializer and reach the gate again between the two reads). After the
    worker died, settled means that the engine's threads have exited.

    Poll it with ``wait_until`` under ``anyio.fail_after``.
    """
    if engine.statistics().is_dead:
        return not any(thread.is_alive() for thread in engine.threads)
    held = 0
    for record in list(engine._live.values()):
        if record.status is RequestStatus.WAITING:
            if record.t_suspended is not None and record.state is not None:
                held += 1  # suspended (L61): back in the queue with its parked state
            elif record.t_taken is not None:
                return False  # taken; the loop has not seen it yet, or being released
            continue
        if record.state is None or record.steps_done >= record.steps_total:
            return False  # being prepared, released or materialized
        if record.t_suspended is not None:
            return False  # suspended, and being resumed or released (L61)
        held += 1
    return runner is None or runner.live_states == held


def assert_nothing_left(
    engine: Engine, runner: RunnerCounters | None = None, *, runner_states: bool = True
) -> None:
    """Assert that a shut-down engine holds and runs nothing any more (L31, L32, L35).

    Args:
        engine: an engine whose ``aclose()`` has returned.
        runner: its runner, checked for ``closed`` and, unless ``runner_states`` is
            false, for ``live_states == 0`` (every prepared state was discarded).
        runner_states: set it to false after a worker death: a dead worker never
            hands the states it held back to the runner.

    Raises:
        AssertionError: naming what is left.
    """
    stats = check_engine_invariants(engine)
    assert stats.is_closing, "the engine was not shut down"
    alive = [thread.name for thread in engine.threads if thread.is_alive()]
    assert not alive, f"L35: engine threads alive after shutdown: {alive}"
    assert_no_engine_threads()
    assert not engine._live, f"requests still live after shutdown: {sorted(engine._live)}"
    assert engine._pool.counts()[0] == 0, "requests still queued after shutdown"
    assert (stats.waiting, stats.running) == (0, 0), stats
    if runner is not None:
        assert runner.closed, "L35: the runner was not closed"
        if runner_states:
            assert runner.live_states == 0, f"{runner.live_states} runner states never discarded"


@dataclass(eq=False, slots=True)
class _Entry:
    record: Record
    # What the status checks read (``_moment``): the record, through the public view.
    probe: RequestProbe
    handle: weakref.ref[RequestHandle]
    status: RequestStatus
    metrics: RequestMetrics | None = None
    last_step: int = 0
    outputs: int = 0
    # L61: the suspensions its record had counted at the last check.
    preemptions: int = 0
    reason: str | None = None  # why it is ending early, once it is
    # After the end: events buffered then, minus the ones read since.
    buffered_at_end: int | None = None
    read_since_end: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class _Moment:
    """What one check read of a record: its suspensions, status, and whether suspended."""

    preemptions: int
    status: RequestStatus
    suspended: bool


def _moment(probe: RequestProbe) -> _Moment:
    """Read a request now, through its probe; the suspensions first (see ``_check_waiting``)."""
    preemptions = probe.preemptions
    status = probe.status
    return _Moment(preemptions=preemptions, status=status, suspended=probe.is_suspended)


@dataclass(eq=False, slots=True)
class RequestLedger:
    """Follow requests through their handles; assert each ends once and counts right.

    ``track`` every handle right after ``submit``; report what the consumer got with
    ``event`` and ``outcome``; call ``check`` as often as you like. The ledger holds
    a request only until it is terminal and its handle closed (or dropped), then
    keeps just its final status, so it can follow a long soak.

    Checked per request:

    - L8, L11: the reason a request ends early, once given, never changes.
    - L15: the status changes only forward and, once terminal, never again (but a
      suspended request, L61, goes from RUNNING back to WAITING, and on again); the
      metrics appear with the terminal status (L17) and are never replaced; no step
      event is buffered after the end, and the events read are the request's own,
      in increasing step order, never past the steps done; at most one output is
      returned, and every error matches the terminal status.
    - L12: once the handle is closed, nothing of the request stays buffered.
    - L8, L14: a terminal request's runner state is released (unless the worker died).
    - L3: a live request is the one its id finds in the engine's live table.

    With ``check(engine)``, the ledger must have tracked every request that engine
    admitted: its count of each status must equal ``engine.statistics()`` (L19).
    """

    _entries: dict[int, _Entry] = field(default_factory=dict)
    _final: dict[RequestStatus, int] = field(
        default_factory=lambda: dict.fromkeys(RequestStatus, 0)
    )
    _refs: list[weakref.ref[object]] = field(default_factory=list)

    @property
    def tracked(self) -> int:
        """How many requests the ledger still follows (not yet terminal and closed)."""
        return len(self._entries)

    def counts(self) -> dict[RequestStatus, int]:
        """The number of tracked requests in each status, finished ones included."""
        counts = dict(self._final)
        for entry in self._entries.values():
            counts[entry.record.status] += 1
        return counts

    def track(self, handle: RequestHandle) -> None:
        """Start following the request of ``handle`` (right after ``submit``)."""
        record = handle._record
        assert id(record) not in self._entries, f"{handle!r} tracked twice"
        self._entries[id(record)] = _Entry(
            record, RequestProbe(record), weakref.ref(handle), record.status
        )

    def _entry(self, handle: RequestHandle) -> _Entry | None:
        return self._entries.get(id(handle._record))

    def event(self, handle: RequestHandle, event: StepEvent) -> None:
        """Check a step event the consumer of ``handle`` just read (L13, L15, L18)."""
        record = handle._record
        assert event.request_id == record.request_id, f"{event!r} read from {handle!r}"
        assert event.total == record.steps_total, event
        assert 1 <= event.step <= record.steps_done, (event, record.steps_done)
        if event.preview is not None:
            assert record.request.preview_every > 0, f"L18: preview without asking: {event!r}"
            assert event.step % record.request.preview_every == 0, f"L18: {event!r}"
        self._refs.append(weakref.ref(event))
        entry = self._entry(handle)
        if entry is None:
            return
        assert event.step > entry.last_step, f"event {event.step} after {entry.last_step}"
        entry.last_step = event.step
        if entry.metrics is not None:
            assert event.step <= entry.metrics.steps_done, (event, entry.metrics)
        if entry.buffered_at_end is not None:
            entry.read_since_end += 1

    def outcome(self, handle: RequestHandle, outcome: GenerationOutput | BaseException) -> None:
        """Check what ``handle.result()`` just returned or raised (L15, L22, L23).

        Not for the backend's cancellation exception: a cancelled wait is no outcome.
        """
        entry = self._entry(handle)
        if isinstance(outcome, GenerationOutput):
            self._outcome_completed(handle, entry, outcome)
            return
        assert not isinstance(outcome, anyio.get_cancelled_exc_class()), "not an outcome"
        if isinstance(outcome, RequestError):
            assert outcome.request_id == handle.request_id, f"error for {outcome.request_id!r}"
        match _status_told(outcome):
            case RequestStatus.COMPLETED:
                self._outcome_completed(handle, entry, None)
            case RequestStatus.ABORTED:
                _outcome_aborted(handle, outcome)
            case RequestStatus.FAILED:
                _outcome_failed(handle, outcome)
            case None if isinstance(outcome, anyio.ClosedResourceError):
                assert handle.is_closed, f"ClosedResourceError from open {handle!r}"
            case _:
                raise AssertionError(f"unexpected outcome of {handle!r}: {outcome!r}")

    def _outcome_completed(
        self, handle: RequestHandle, entry: _Entry | None, output: GenerationOutput | None
    ) -> None:
        """The output (L3, L15), or with ``None`` the error of a second ``result()`` call."""
        status = handle.status
        if output is None:
            assert status is RequestStatus.COMPLETED, status
            if entry is not None:
                assert entry.outputs == 1, "L15: 'already returned' before any output"
            return
        request_id = handle.request_id
        assert status is RequestStatus.COMPLETED, f"output for a {status.value} request"
        assert output.request_id == request_id, f"L3: {request_id!r} got another's output"
        assert output.metrics is handle.metrics, "output metrics differ from the handle's"
        self._refs.append(weakref.ref(output))
        if entry is not None:
            entry.outputs += 1
            assert entry.outputs == 1, f"L15: {request_id!r} returned its output twice"

    def check(self, engine: Engine | None = None) -> None:
        """Check every tracked request now; with ``engine``, compare the statistics.

        Raises:
            AssertionError: naming the request and the broken rule.
        """
        dead = engine is not None and engine.statistics().is_dead
        entries = list(self._entries.items())
        if engine is None:
            moments = [_moment(entry.probe) for _, entry in entries]
        else:
            # Under the workers' lock, which a worker holds to take or suspend a
            # request: each status is read with the suspension that explains it.
            with engine._pool.cond:
                moments = [_moment(entry.probe) for _, entry in entries]
        for (key, entry), moment in zip(entries, moments, strict=True):
            if self._check_entry(entry, moment, engine, dead):
                del self._entries[key]
                self._final[entry.status] += 1
        if engine is not None:
            # Both under the lock: a worker takes a waiting request (out of the queue,
            # RUNNING) in one hold of it, and must not do so between the two reads.
            with engine._pool.cond:
                stats = engine.statistics()
                counts = self.counts()
            assert counts == _counts(stats), (
                f"L19: the ledger's statuses {counts} differ from {stats}"
            )

    def _check_entry(
        self, entry: _Entry, moment: _Moment, engine: Engine | None, dead: bool
    ) -> bool:
        """Check one request as ``moment`` read it; return whether it is finished."""
        record = entry.record
        status = moment.status
        # L8, L11: the first reason to end a request early wins; nothing changes it.
        reason = record.token.reason
        if entry.reason is not None:
            assert reason == entry.reason, (
                f"{record.request_id!r}: reason {entry.reason!r} -> {reason!r}"
            )
        entry.reason = reason
        match status:
            case RequestStatus.WAITING:
                _check_waiting(entry, moment, engine)
            case RequestStatus.RUNNING:
                _check_running(entry, engine)
            case _:
                assert status.is_terminal, status
                return _check_terminal(entry, status, engine, dead)
        entry.preemptions = moment.preemptions
        return False

    def alive(self) -> list[object]:
        """Return the events and outputs reported to the ledger that are still alive.

        Drop your own references first; the objects live on only if something
        still holds them (L12). Collect garbage first if cycles may hold them.
        """
        alive = [obj for ref in self._refs if (obj := ref()) is not None]
        self._refs = [ref for ref in self._refs if ref() is not None]
        return alive


def _status_told(error: BaseException) -> RequestStatus | None:
    """The terminal status an error out of ``result()`` says the request has, if any."""
    if isinstance(error, RuntimeError) and "already returned" in str(error):
        return RequestStatus.COMPLETED  # a second call, after the output was returned
    if isinstance(error, RequestAbortedError | EngineClosedError):
        return RequestStatus.ABORTED
    if isinstance(error, RequestFailedError | EngineDeadError):
        return RequestStatus.FAILED
    return None


def _outcome_aborted(handle: RequestHandle, error: BaseException) -> None:
    """An abort's error carries the handle's reason; shutdown's is ``EngineClosedError``."""
    status = handle.status
    assert status is RequestStatus.ABORTED, (status, error)
    if isinstance(error, RequestAbortedError):
        assert error.reason == handle.abort_reason, (error.reason, handle)
    else:
        assert handle.abort_reason == AbortReason.SHUTDOWN, handle.abort_reason


def _outcome_failed(handle: RequestHandle, error: BaseException) -> None:
    """A failure chains the runner's error (L22) or the dead worker's (L23)."""
    status = handle.status
    assert status is RequestStatus.FAILED, (status, error)
    whose = "L22: the runner's" if isinstance(error, RequestFailedError) else "L23: the worker's"
    assert error.__cause__ is not None, f"{whose} error is not chained"


def _check_waiting(entry: _Entry, moment: _Moment, engine: Engine | None) -> None:
    """A waiting request was waiting when last checked, or was suspended since (L15, L61).

    Nothing goes back but a suspended request: RUNNING, then WAITING with its state
    parked, until its worker takes it again. The worker counts the suspension and
    makes the request WAITING in one hold of its lock, and resumes one that reads
    RUNNING already; so read under that lock (``check(engine)``), a request that went
    back reads suspended. Read without it, a resume may come between the status and
    the suspension: then it counts more suspensions than at the last check.
    """
    request_id = entry.record.request_id
    if entry.status is RequestStatus.RUNNING:
        assert moment.suspended or moment.preemptions > entry.preemptions, (
            f"L15, L61: {request_id!r} went back from running to waiting, never suspended"
        )
    else:
        assert entry.status is RequestStatus.WAITING, f"L15: {request_id!r} went back"
    _check_live(entry, RequestStatus.WAITING, engine)


def _check_running(entry: _Entry, engine: Engine | None) -> None:
    """A running request was live when last checked: once ended, it ends once (L15)."""
    assert not entry.status.is_terminal, (
        f"L15: {entry.record.request_id!r} ended twice: {entry.status}"
    )
    _check_live(entry, RequestStatus.RUNNING, engine)


def _check_live(entry: _Entry, status: RequestStatus, engine: Engine | None) -> None:
    """What holds of a live request: no metrics yet, and its id finds it (L3, L17)."""
    record = entry.record
    request_id = record.request_id
    entry.status = status
    assert record.metrics is None, f"{request_id!r} has metrics while live"
    if engine is not None:
        assert engine._live.get(request_id) is record, (
            f"L3: the live table's {request_id!r} is another admission"
        )


def _check_terminal(
    entry: _Entry, status: RequestStatus, engine: Engine | None, dead: bool
) -> bool:
    """Check a completed, aborted or failed request; return whether its handle is closed.

    At its first check as terminal its end is recorded (L17); at every later one
    it must be unchanged, with no event added (L15). Once its handle is closed,
    nothing of it is kept and its id is free (L2, L3, L12).
    """
    record = entry.record
    request_id = record.request_id
    if entry.status.is_terminal:
        assert status is entry.status, f"L15: {request_id!r} ended twice: {entry.status}"
        assert record.metrics is entry.metrics, f"L17: {request_id!r} metrics replaced"
        assert entry.buffered_at_end is not None
        buffered = record.channel.buffered
        assert buffered + entry.read_since_end <= entry.buffered_at_end, (
            f"L15: {request_id!r} got an event after its end"
        )
        entry.buffered_at_end, entry.read_since_end = buffered, 0
    else:
        entry.status = status
        assert record.metrics is not None, f"L17: {request_id!r} ended without metrics"
        entry.metrics = record.metrics
        entry.buffered_at_end = record.channel.buffered
        _check_metrics(record, record.metrics, status)
        assert entry.last_step <= record.metrics.steps_done
    assert record.done.is_set(), f"{request_id!r} terminal but not done"
    if not dead:
        assert record.state is None, f"L8: terminal {request_id!r} still holds its state"
    return _check_released(entry, engine)


def _check_released(entry: _Entry, engine: Engine | None) -> bool:
    """A terminal request holds its id while its handle is open, frees all once closed."""
    record = entry.record
    request_id = record.request_id
    handle = entry.handle()
    if handle is not None and not handle.is_closed:
        if engine is not None:
            assert engine._terminal_open.get(request_id) is handle, (
                f"L2: terminal {request_id!r} with an open handle does not hold its id"
            )
        return False
    if handle is not None:
        # L12: closing dropped the buffered events and the output.
        assert record.channel.buffered == 0, f"L12: events of closed {request_id!r} kept"
        assert record.outcome is None, f"L12: outcome of closed {request_id!r} kept"
    if engine is not None:
        assert engine._live.get(request_id) is not record
        held = engine._terminal_open.get(request_id)
        assert held is None or held._record is not record, f"{request_id!r} id not freed"
    return True


def _check_metrics(record: Record, metrics: RequestMetrics, status: RequestStatus) -> None:
    """L16, L17: metrics are filled and consistent for every terminal outcome."""
    request_id = record.request_id
    times = (
        metrics.queue_wait_s,
        metrics.exec_s,
        metrics.output_ready_wait_s,
        metrics.total_s,
        *metrics.stage_durations.values(),
    )
    assert all(math.isfinite(t) and t >= 0 for t in times), f"L17: {request_id!r}: {metrics}"
    parts = metrics.queue_wait_s + metrics.exec_s + metrics.output_ready_wait_s
    assert parts <= metrics.total_s + _EPS, f"L17: {request_id!r}: {metrics}"
    assert metrics.steps_done == record.steps_done, (metrics.steps_done, record.steps_done)
    assert 0 <= metrics.steps_done <= record.steps_total, metrics
    assert "output_ready_wait" not in metrics.stage_durations, f"L16: {metrics}"
    if status is RequestStatus.COMPLETED:
        # L95: a result-cache hit ran no step; its output is an earlier request's.
        steps = 0 if metrics.result_cache_hit else record.steps_total
        assert metrics.steps_done == steps, f"L17: {request_id!r}: {metrics}"
        assert abs(parts - metrics.total_s) <= _EPS, f"L16: {request_id!r}: {metrics}"
    if status is RequestStatus.ABORTED:
        latency = metrics.abort_latency_s
        assert latency is not None and latency >= 0, f"L17: {request_id!r}: {metrics}"
    else:
        assert metrics.abort_latency_s is None, f"L17: {request_id!r}: {metrics}"
