"""The library's loggers, and records whose traceback was formatted in another thread.

The hierarchy is ``omni_trio``: ``omni_trio.engine`` (one line per finished
request, runner failures, the worker's death), ``omni_trio.worker`` (the threads'
start and end, at DEBUG) and ``omni_trio.serve`` (the HTTP layer). The library adds
only a ``NullHandler`` to ``omni_trio``: where the lines go is the application's
choice (``omni-trio serve`` configures stderr).

Records about one request carry its id as ``record.request_id`` (the
``extra={"request_id": ...}`` convention), so a handler can filter or index on it.
"""

from __future__ import annotations

import logging

__all__ = ["ENGINE", "SERVE", "WORKER", "log_exception"]

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
