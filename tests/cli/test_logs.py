"""The server's log format: ``--log-format json`` writes one JSON object per record.

Pure: a formatter and hand-made records, no handler, no server.
"""

from __future__ import annotations

import json
import logging

from omni_trio.cli._logs import JsonFormatter


def test_the_json_format_is_one_object_per_line() -> None:
    """--log-format json: time, level, logger, message, request_id when there is one,
    and the traceback text as ``exc``."""
    formatter = JsonFormatter()
    record = logging.LogRecord("omni_trio.engine", logging.INFO, "f", 1, "a %s", ("b",), None)
    record.request_id = "r-1"
    entry = json.loads(formatter.format(record))
    assert set(entry) == {"time", "level", "logger", "message", "request_id"}
    assert (entry["level"], entry["logger"], entry["message"]) == (
        "INFO",
        "omni_trio.engine",
        "a b",
    )
    assert entry["time"].endswith("Z")
    try:
        raise ValueError("boom\nsecond line")
    except ValueError as exc:
        failed = logging.LogRecord("x", logging.ERROR, "f", 1, "m", (), (ValueError, exc, None))
    text = formatter.format(failed)
    assert "\n" not in text and "boom" in json.loads(text)["exc"]
