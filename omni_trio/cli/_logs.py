"""The server's logging: every line on stderr, as text or one JSON object per line.

``serve`` sends the whole process's log through one handler on the root logger:
the library's (``omni_trio.*``), the HTTP server's (``hypercorn.*`` and
``uvicorn.*``, access log included) and Python's warnings. So with
``--log-format json`` every line on stderr is a JSON object.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

__all__ = ["LOG_FORMATS", "JsonFormatter", "configure_logging"]

LOG_FORMATS = ("text", "json")

_TEXT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line.

    Keys: ``time`` (ISO 8601, UTC, milliseconds), ``level``, ``logger``,
    ``message``; ``request_id`` when the record concerns a request (its
    ``extra``); ``exc`` with the traceback when the record has one.
    """

    def format(self, record: logging.LogRecord) -> str:
        seconds = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        entry: dict[str, Any] = {
            "time": f"{seconds}.{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        request_id = getattr(record, "request_id", None)
        if request_id is not None:
            entry["request_id"] = request_id
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            entry["exc"] = record.exc_text
        return json.dumps(entry, ensure_ascii=False, default=str)


def configure_logging(level: str, log_format: str) -> None:
    """Send every log record of ``level`` or above to stderr, in ``log_format``.

    Args:
        level: ``debug``, ``info``, ``warning`` or ``error``.
        log_format: ``text`` or ``json``.
    """
    handler = logging.StreamHandler(sys.stderr)
    formatter = JsonFormatter() if log_format == "json" else logging.Formatter(_TEXT)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(level.upper())
    for name in ("hypercorn", "uvicorn"):
        # Each server may have set its own handlers and level: route them here.
        server = logging.getLogger(name)
        server.handlers = []
        server.propagate = True
        server.setLevel(logging.NOTSET)
    logging.captureWarnings(True)
