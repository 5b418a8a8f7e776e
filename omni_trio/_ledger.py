"""The engine's tables of requests, and the messages of its threads that change them.

``Ledger`` is ``Engine``'s base: the half that runs when a thread's message arrives
(``_dispatch``, through the loop's inbox) and every terminal transition (``_terminate``),
a worker's death (L43) and the engine's (L23). Everything here runs in the event loop's
thread, in the order the messages were posted, so the tables are always consistent when
a task looks at them. ``Engine`` (``_engine``) holds the other half: admission, abort,
adapters and weights, statistics, shutdown; it sets the tables in its ``__init__``.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, assert_never, cast

from ._errors import EngineClosedError, EngineDeadError, RequestAbortedError, RequestFailedError
from ._failure import format_traceback
from ._log import ENGINE, log_exception, log_finished
from ._messages import Completed, Died, Exited, Held, Message, Released, Stepped, died
from ._outputs import GenerationOutput, RequestStatus, StepEvent
from ._reasons import AbortReason
from ._record import Record

if TYPE_CHECKING:
    import anyio

    from ._deadlines import DeadlineTimer
    from ._handle import RequestHandle
    from ._pool import Pool
    from ._resultstore import ResultStore
    from ._weightops import EngineWeights
    from ._worker import Worker
    from ._workitem import WorkItem

__all__ = ["Ledger"]


class Ledger:
    """The engine's tables and what changes them (see the module's docstring)."""

    # Set by ``Engine.__init__``.
    _pool: Pool
    _workers: list[Worker]
    _results: ResultStore | None
    _deadlines: DeadlineTimer[Record]
    _weights: EngineWeights
    # L43: the workers whose threads have not died, and those that exited.
    _alive: set[int]
    _exited_workers: set[int]
    _exited: anyio.Event
    # Non-terminal requests by id: the engine drives them, so it holds them.
    _live: dict[str, Record]
    # Terminal requests whose handle is open keep their id (L2), held weakly.
    _terminal_open: weakref.WeakValueDictionary[str, RequestHandle]
    _counts: dict[RequestStatus, int]
    # Member-steps run for requests after their abort was asked, summed.
    _steps_after_abort: int
    _closing: bool
    _dead: EngineDeadError | None

    # -- messages from the engine's threads ----------------------------------

    def _dispatch(self, message: Message[WorkItem]) -> None:
        try:
            self._apply(message)
        except Exception as exc:  # an engine bug: fail loudly, never crash the loop
            self._die(died(exc, "the engine failed to apply a message"))

    def _apply(self, message: Message[WorkItem]) -> None:
        match message:
            case Stepped(item, step, total, preview):
                record = cast(Record, item)
                if not record.status.is_terminal and not record.channel.is_receive_closed:
                    record.channel.send_nowait(
                        StepEvent(
                            request_id=record.request_id,
                            step=step,
                            total=total,
                            preview=preview,
                        )
                    )
            case Completed(item):
                record = cast(Record, item)
                self._terminate(record, RequestStatus.COMPLETED, message)
            case Released(item, failure):
                record = cast(Record, item)
                if failure is not None:
                    # L22: the message was formatted in the thread that caught the
                    # error; the loop never runs the runner's code to describe it.
                    failed = RequestFailedError(failure.message, request_id=record.request_id)
                    failed.__cause__ = failure.cause
                    if failure.traceback:  # the first request this exception failed
                        others = failure.request_ids[1:]
                        also = f" (and {', '.join(others)}, of its batch)" if others else ""
                        log_exception(
                            ENGINE,
                            failure.message + also,
                            failure.cause,
                            failure.traceback,
                            extra={
                                "request_id": record.request_id,
                                "request_ids": failure.request_ids,
                            },
                        )
                    self._terminate(record, RequestStatus.FAILED, failed)
                else:
                    self._terminate(record, RequestStatus.ABORTED, self._cut_error(record))
            case Died(worker=worker) if worker is not None and self._alive - {worker}:
                self._lose_worker(message, worker)
                self._weights.worker_lost()
            case Died():
                self._die(message)
                self._weights.worker_lost()
            case Held(worker, round_):
                self._weights.held(worker, round_)
            case Exited(worker):
                self._exited_workers.add(worker)
                if len(self._exited_workers) == len(self._workers):
                    self._exited.set()
            case _:
                assert_never(message)

    def _terminate(self, record: Record, status: RequestStatus, outcome: Any) -> None:
        """Make ``record`` terminal: outcome, metrics, wake-ups, tables."""
        if record.status.is_terminal:
            return
        self._counts[status] += 1
        record.terminal_status = status
        metrics = record.metrics = record.build_metrics(status)
        if metrics.steps_after_abort is not None:
            self._steps_after_abort += metrics.steps_after_abort
        if status is RequestStatus.COMPLETED:
            if self._results is not None:
                self._results.completed(record, outcome.kept)
            # ``outcome`` is the Completed message: the images, and a video's frames.
            outcome = GenerationOutput(
                request_id=record.request_id,
                images=outcome.images,
                video=outcome.video,
                metrics=metrics,
                trajectory=outcome.trajectory,
            )
        if record.deadline is not None:
            self._deadlines.ended(record)
        request_id = record.request_id
        if self._live.get(request_id) is record:
            del self._live[request_id]
        handle = record.handle_ref() if record.handle_ref is not None else None
        if handle is not None and not handle.is_closed:
            record.outcome = outcome
            self._terminal_open[request_id] = handle
        record.channel.close_send()
        record.done.set()
        log_finished(record, status, outcome)

    def _forget(self, record: Record, handle: RequestHandle) -> None:
        """Free the id of a terminal request whose handle just closed (L3)."""
        if self._terminal_open.get(record.request_id) is handle:
            del self._terminal_open[record.request_id]

    def _cut_error(self, record: Record) -> Exception:
        reason = record.token.reason or AbortReason.SHUTDOWN
        if reason == AbortReason.SHUTDOWN:
            return EngineClosedError(f"request {record.request_id!r} was cut off by shutdown")
        return RequestAbortedError(
            f"request {record.request_id!r} was aborted ({reason})",
            reason=reason,
            request_id=record.request_id,
        )

    def _lose_worker(self, death: Died, index: int) -> None:
        """Worker ``index`` died; the others serve on (L43): fail only what it held."""
        if index not in self._alive:
            return
        self._alive.discard(index)
        text = death.traceback or format_traceback(death.error)
        log_exception(
            ENGINE,
            f"{death.message}; {len(self._alive)} worker(s) serve on",
            death.error,
            text,
            extra={},
        )
        with self._pool.cond:
            # Its suspended requests end now; its exiting thread discards their state.
            self._workers[index].orphan_parked()
        for record in list(self._live.values()):
            if record.worker == index:
                record.token.cancel(AbortReason.SHUTDOWN)
                failed = RequestFailedError(
                    f"request {record.request_id!r} failed: {death.message}",
                    request_id=record.request_id,
                )
                failed.__cause__ = death.error
                self._terminate(record, RequestStatus.FAILED, failed)

    def _die(self, death: Died) -> None:
        if self._dead is not None:
            return
        dead = EngineDeadError(death.message)
        dead.__cause__ = death.error
        self._dead = dead
        self._alive.clear()
        text = death.traceback or format_traceback(death.error)
        log_exception(ENGINE, death.message, death.error, text, extra={})
        self._closing = True
        live = list(self._live.values())
        # Cut first, so that no suspension in flight parks a request that ends here.
        for record in live:
            record.token.cancel(AbortReason.SHUTDOWN)
        self._pool.withdraw_all()
        self._pool.stop()
        for record in live:
            self._terminate(record, RequestStatus.FAILED, self._dead_error())

    def _dead_error(self) -> EngineDeadError:
        assert self._dead is not None
        error = EngineDeadError(str(self._dead))
        error.__cause__ = self._dead.__cause__
        return error
