"""The server's log format: ``--log-format json`` writes one JSON object per record, the
model libraries' records included.

The formatter is pure: hand-made records, no handler. ``configure_logging`` changes the
process's logging, so it runs in a subprocess of its own.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from omni_trio.cli._logs import JsonFormatter
from tests.support.cli import python


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


# Logs a warning through each model library's own logger, then runs diffusers' and
# transformers' progress bars, as loading a pipeline does.
LIBRARIES_LOG = """
import sys
from omni_trio.cli._logs import configure_logging
configure_logging(sys.argv[1], "json", model_libraries=True)
from diffusers.utils import logging as diffusers_logging
from huggingface_hub.utils import logging as hub_logging
from transformers.utils import logging as transformers_logging
diffusers_logging.get_logger("diffusers.probe").warning("from diffusers")
transformers_logging.get_logger("transformers.probe").warning("from transformers")
hub_logging.get_logger("huggingface_hub.probe").warning("from huggingface_hub")
for bar in (diffusers_logging.tqdm, transformers_logging.tqdm):
    for _ in bar(range(3), desc="Loading pipeline components..."):
        pass
"""


@pytest.mark.parametrize("level", ["warning", "error"])
def test_the_model_libraries_log_through_the_one_handler(tmp_path: Path, level: str) -> None:
    """diffusers, transformers and huggingface_hub log through the root handler (one JSON
    line each, once: not also raw through a handler of their own), at --log-level and
    above only, and draw no progress bar."""
    result = python("-c", LIBRARIES_LOG, level, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    entries = [json.loads(line) for line in result.stderr.splitlines()]
    expected = [] if level == "error" else ["diffusers", "transformers", "huggingface_hub"]
    assert [(e["level"], e["logger"], e["message"]) for e in entries] == [
        ("WARNING", f"{name}.probe", f"from {name}") for name in expected
    ]
