"""What a test may see of the engine beyond its public surface, and what it may inject.

A ``RequestHandle`` shows what a consumer needs. A test also needs a few facts that
only the engine's side of the request knows: whether something already asked the
engine to end it (before it is terminal), whether the engine's threads still hold
its runner state, whether a consumer iterates its events, which worker took it.
``probe(handle)`` gives exactly those, read-only, and keeps reading them after the
handle was dropped. ``probe_engine(engine)`` does the same for the engine's tables
(the live requests, the ids held by open handles, the pending deadlines) and each
worker's measurements (``WorkerProbe``), so that no test reads a private attribute.

Two things to inject: ``cancel_at_delivery`` makes the race between a consumer's
cancellation and the delivery of its result deterministic, and
``assume_step_time`` gives a worker a measured step time, so that admission's
deadline estimate (L62) is exact.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import anyio

from .._outputs import RequestStatus

if TYPE_CHECKING:
    from collections.abc import Mapping

    from .._engine import Engine
    from .._handle import RequestHandle
    from .._record import Record
    from .._request import GenerationRequest
    from .._worker import Worker

__all__ = [
    "EngineProbe",
    "RequestProbe",
    "WorkerProbe",
    "assume_step_time",
    "cancel_at_delivery",
    "probe",
    "probe_engine",
]


class RequestProbe:
    """A read-only view of one admission's engine-side state; see ``probe``.

    It follows the admission, not the id: after the id was reused it still reads
    the old request. Every read is of the state now, from the event loop's thread.
    """

    __slots__ = ("_record",)

    def __init__(self, record: Record) -> None:
        self._record = record

    def __repr__(self) -> str:
        return f"<RequestProbe {self.request_id!r} {self.status.value}>"

    @property
    def request_id(self) -> str:
        """The request's id."""
        return self._record.request_id

    @property
    def status(self) -> RequestStatus:
        """The request's status now, as its handle would say."""
        return self._record.status

    @property
    def request(self) -> GenerationRequest:
        """The request as admitted."""
        return self._record.request

    @property
    def cancel_reason(self) -> str | None:
        """Why something asked the engine to end the request early, the moment it asked.

        An ``AbortReason`` (``"user"``, ``"consumer_gone"``, ``"cancelled"``,
        ``"shutdown"``, ``"deadline"``, ...) or the reason given to an abort;
        ``None`` while nothing asked. Unlike
        ``RequestHandle.abort_reason`` it is set before the request is terminal,
        and stays set when the request ended otherwise (the first reason wins).
        """
        return self._record.token.reason

    @property
    def steps_done(self) -> int:
        """The denoising steps the worker finished for it so far."""
        return self._record.steps_done

    @property
    def holds_state(self) -> bool:
        """Whether the engine's threads still hold its runner state (L8, L11).

        False before the worker prepared it and once the state was discarded; a
        dead worker never hands its states back.
        """
        return self._record.state is not None

    @property
    def reading(self) -> bool:
        """Whether a consumer has started iterating the handle's events (L18)."""
        return self._record.reading

    @property
    def worker(self) -> int | None:
        """The index of the worker that took the request (L42); ``None`` before."""
        return self._record.worker

    @property
    def preemptions(self) -> int:
        """How often the request was suspended so far (L61)."""
        return self._record.preemptions

    @property
    def is_suspended(self) -> bool:
        """Whether the request is suspended now: parked, its state kept (L61)."""
        return self._record.t_suspended is not None


def probe(handle: RequestHandle) -> RequestProbe:
    """Return a read-only view of ``handle``'s request, beyond what the handle shows.

    The view keeps the request's record alive as long as the view lives (not its
    handle: dropping the handle still frees the id, L14).
    """
    return RequestProbe(handle._record)


class WorkerProbe:
    """A read-only view of one worker's measurements; see ``EngineProbe.workers``."""

    __slots__ = ("_engine", "_index")

    def __init__(self, engine: Engine, index: int) -> None:
        self._engine = engine
        self._index = index

    def __repr__(self) -> str:
        return f"<WorkerProbe {self._worker.name!r}>"

    @property
    def _worker(self) -> Worker:
        return self._engine._workers[self._index]

    @property
    def is_alive(self) -> bool:
        """Whether the worker serves: its threads have not died (L43)."""
        return self._index in self._engine._alive

    @property
    def step_s(self) -> float | None:
        """The moving average of its batch steps' durations (L62); ``None`` before one."""
        return self._worker.batch.step_s

    @property
    def step_times(self) -> Mapping[int, float]:
        """What one step alone of each shape (``step_pixels``) took at its fastest, by the
        shapes it measured warm (L4: ``max_step_s``); empty before."""
        return {shape.pixels: shape.step_s for shape in self._worker.batch.shapes}

    @property
    def steps_left(self) -> int:
        """The steps left of its running batch (its longest member's), for the estimate."""
        return self._worker.batch.steps_left

    @property
    def parked_bytes(self) -> int:
        """What its suspended requests park now, by their runner's ``state_bytes`` (L61)."""
        return self._worker.parked_bytes


class EngineProbe:
    """A read-only view of an engine's tables and workers; see ``probe_engine``.

    Every read is of the state now, from the event loop's thread.
    """

    __slots__ = ("_engine",)

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def __repr__(self) -> str:
        return f"<EngineProbe {len(self._engine._live)} live>"

    @property
    def live_ids(self) -> frozenset[str]:
        """The ids of the live (not yet terminal) requests."""
        return frozenset(self._engine._live)

    @property
    def is_held(self) -> bool:
        """Whether the workers are held (L102, L103): an update of the weights or a sleep
        waits for the requests in flight, or the engine sleeps; no worker takes a new
        request."""
        return self._engine._pool.hold is not None

    @property
    def requests(self) -> tuple[RequestProbe, ...]:
        """A probe of every live request, in admission order."""
        return tuple(RequestProbe(record) for record in self._engine._live.values())

    def request(self, request_id: str) -> RequestProbe | None:
        """A probe of the live request ``request_id``; ``None`` if none is live.

        For a request whose handle the test does not hold (``Engine.generate``'s).
        """
        record = self._engine._live.get(request_id)
        return None if record is None else RequestProbe(record)

    @property
    def open_ids(self) -> frozenset[str]:
        """The ids that terminal requests still hold, their handles open (L2)."""
        return frozenset(self._engine._terminal_open)

    @property
    def pending_deadlines(self) -> int:
        """How many deadlines the timer still waits for (L62)."""
        return len(self._engine._deadlines)

    @property
    def idle_workers(self) -> int:
        """How many workers wait for work now (on the pool's condition)."""
        return self._engine._pool.idle

    @property
    def workers(self) -> tuple[WorkerProbe, ...]:
        """A probe of each worker, in the order of the runners."""
        engine = self._engine
        return tuple(WorkerProbe(engine, index) for index in range(len(engine._workers)))


def probe_engine(engine: Engine) -> EngineProbe:
    """Return a read-only view of ``engine``'s tables and workers."""
    return EngineProbe(engine)


def assume_step_time(
    engine: Engine,
    step_s: float,
    *,
    worker: int = 0,
    step_times: Mapping[int, float] | None = None,
) -> None:
    """Make worker ``worker`` of ``engine`` read ``step_s`` as its measured step time.

    Admission's deadline estimate (L62) then uses it until the worker measures its
    next step: call it while the worker is held in a step (a ``GatedRunner`` at its
    gate) or idle, so that the estimate is exact. With ``step_times`` (a request's
    ``step_pixels`` to the seconds one step of it alone takes), the worker reads those
    as the shapes it measured warm, and no other, which ``EngineConfig.max_step_s``
    reads (L4).
    """
    engine._workers[worker].assume_step_time(step_s, shapes=step_times)


def assume_step_cost(engine: Engine, pixel_s: float | None) -> None:
    """Price every request of ``engine`` for fair share at ``pixel_s`` per pixel-step (L57).

    A request admitted from now on costs its steps times ``pixel_s`` times its
    ``num_images x height x width x max(1, num_frames)``, whatever the workers
    measure, so the order fair share picks depends on the requests alone (tests,
    simulations). ``None``: back to the measured costs.
    """
    engine._pool.costs.pin(pixel_s)


class _CancelOnDelivery:
    """Stands in for a record's ``done`` event: cancels ``scope`` as the outcome lands."""

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


def cancel_at_delivery(
    handle: RequestHandle, scope: anyio.CancelScope, *, before: bool = False
) -> None:
    """Cancel ``scope`` in the very callback that makes ``handle``'s request terminal.

    The cancellation reaches a consumer waiting in ``result()`` inside ``scope``
    together with its outcome, before its task runs again: the race between a
    cancellation and a delivery, made deterministic (L11, L15). Call it right after
    ``submit``, before anything waits for the request.

    Args:
        handle: the request's handle.
        scope: the scope to cancel.
        before: cancel just before the request becomes terminal rather than just
            after; either way in the same callback.
    """
    record = handle._record
    record.done = _CancelOnDelivery(record.done, scope, before=before)  # type: ignore[assignment]
