"""The library's loggers, the line of a finished request, and records whose traceback
was formatted in another thread.

The hierarchy is ``omni_trio``: ``omni_trio.engine`` (one line per finished
request, runner failures, the worker's death), ``omni_trio.worker`` (the threads'
start and end, at DEBUG) and ``omni_trio.serve`` (the HTTP layer). The library adds
only a ``NullHandler`` to ``omni_trio``: where the lines go is the application's
choice (``omni-trio serve`` configures stderr).

Records about one request carry its id as ``record.request_id`` (the
``extra={"request_id": ...}`` convention), so a handler can filter or index on it;
a request's last line carries its tenant too, as ``record.tenant`` (``None`` for
the default tenant, L56).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from ._outputs import RequestStatus
from ._reasons import AbortReason

if TYPE_CHECKING:
    from collections.abc import Sequence

    from ._record import Record
    from ._worker import Worker

__all__ = ["ENGINE", "SERVE", "WORKER", "log_exception", "log_finished", "log_stuck"]

logging.getLogger("omni_trio").addHandler(logging.NullHandler())

ENGINE = logging.getLogger("omni_trio.engine")
WORKER = logging.getLogger("omni_trio.worker")
SERVE = logging.getLogger("omni_trio.serve")


def log_exception(
    logger: logging.Logger,
    message: str,
    error: BaseException,
    text: str,
    *,
    extra: dict[str, object],
) -> None:
    """Log ``message`` at ERROR with ``error`` as ``exc_info`` and ``text`` as its traceback.

    ``text`` is the traceback formatted already, in the engine thread that caught
    ``error`` (``_failure.format_traceback``): setting it as the record's
    ``exc_text`` makes every standard formatter print it instead of formatting the
    exception itself, so logging never runs a runner's ``str()`` on the event loop.
    Once the handlers ran, the record lets go of ``error`` (it keeps the text).

    Args:
        logger: where to log.
        message: the line, formatted already (no ``%`` arguments).
        error: the exception, for handlers that want the object.
        text: its traceback, formatted.
        extra: attributes for the record (``request_id``, ...).
    """
    if not logger.isEnabledFor(logging.ERROR):
        return
    filename, line, function, _ = logger.findCaller(stacklevel=2)
    record = logger.makeRecord(
        logger.name,
        logging.ERROR,
        filename,
        line,
        message,
        (),
        (type(error), error, error.__traceback__),
        function,
        extra,
    )
    record.exc_text = text
    logger.handle(record)
    # Every handler has seen the exception; a handler that keeps records (pytest's,
    # a MemoryHandler) keeps only the text, not the exception and what it holds (a
    # runner's tensors), as QueueHandler.prepare does.
    record.exc_info = None


def log_finished(record: Record, status: RequestStatus, outcome: object) -> None:
    """Log the one line of a request that just became terminal (see docs/design.md).

    INFO; WARNING when shutdown cut it or when a consumer that iterates its events
    was too slow to read them all (the channel dropped some to coalesce). Called
    from the event loop's thread.
    """
    metrics = record.metrics
    assert metrics is not None
    reason = record.token.reason if status is RequestStatus.ABORTED else None
    dropped = record.channel.dropped if record.reading else 0
    warn = reason == AbortReason.SHUTDOWN or dropped > 0
    level = logging.WARNING if warn else logging.INFO
    if not ENGINE.isEnabledFor(level):
        return
    parts = [
        f"request {record.request_id} {status.value}:",
        f"steps {metrics.steps_done}/{record.steps_total},",
        f"queue wait {metrics.queue_wait_s:.3f} s, total {metrics.total_s:.3f} s",
    ]
    if reason is not None:
        parts.append(f", reason {reason}")
    if metrics.result_cache_hit:
        parts.append(", from the result cache")
    if status is RequestStatus.FAILED:
        parts.append(f", error {_summary(outcome)}")
    if dropped:
        parts.append(f", slow consumer: {dropped} step event(s) dropped unread")
    ENGINE.log(
        level,
        " ".join(parts[:3]) + "".join(parts[3:]),
        extra={
            "request_id": record.request_id,
            "outcome": status.value,
            "tenant": record.request.tenant,
        },
    )


def _summary(outcome: object) -> str:
    """The type and message of an engine error (formatted already: never the runner's code)."""
    return f"{type(outcome).__name__}: {outcome}" if isinstance(outcome, Exception) else "?"


def log_stuck(workers: Sequence[Worker], stop_timeout_s: float) -> None:
    """Log, at ERROR, each of ``workers``, which have not exited ``stop_timeout_s`` after
    shutdown cut their requests: its threads, and each request it holds at which step."""
    for worker in workers:
        batch = worker.batch
        steps = {
            member.item: f"step {done + 1} of {total}"
            for member, (done, total) in zip(batch.members, batch.steps, strict=True)
        }
        in_step = worker.in_step_s
        held = [
            f"{request_id} ({steps.get(request_id, 'decoding')}"
            + (f", {in_step:.1f} s in this step)" if in_step is not None else ")")
            for request_id in worker.holding
        ]
        ENGINE.error(
            "the engine's worker %s has not exited %g s after shutdown cut its requests"
            " (threads alive: %s); it holds %s; still waiting for it: a runner call"
            " without a cancel point cannot be stopped",
            worker.name,
            stop_timeout_s,
            ", ".join(worker.thread_names) or "none",
            ", ".join(held) or "no request",
            extra={"request_ids": worker.holding, "worker": worker.name},
        )
