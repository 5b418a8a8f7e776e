"""The server's logging: every line on stderr, as text or one JSON object per line.

``serve`` sends the whole process's log through one handler on the root logger:
the library's (``omni_trio.*``), the HTTP server's (``hypercorn.*`` and
``uvicorn.*``, access log included), Python's warnings, and the model libraries'
(``diffusers``, ``transformers``, ``huggingface_hub``), which otherwise write raw
lines to stderr through handlers of their own. Those libraries' progress bars
("Loading pipeline components", "Loading weights") are turned off: a server's
log is no terminal. So with ``--log-format json`` every line on stderr is a JSON
object, and ``--log-level`` holds for every line.
"""

from __future__ import annotations

import importlib
import json
import logging
import sys
import time
from collections.abc import Iterable
from typing import Any

__all__ = ["LOG_FORMATS", "JsonFormatter", "configure_logging", "log_notes", "logs_json"]

#: The model libraries that log through a stderr handler of their own, by default,
#: and draw progress bars while a pipeline loads.
MODEL_LIBRARIES = ("diffusers", "transformers", "huggingface_hub")

LOG_FORMATS = ("text", "json")

_TEXT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line.

    Keys: ``time`` (ISO 8601, UTC, milliseconds), ``level``, ``logger``,
    ``message``; ``request_id`` when the record concerns a request (its
    ``extra``), and ``tenant`` when that request has one (L56); ``exc`` with the
    traceback when the record has one.
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
        tenant = getattr(record, "tenant", None)
        if tenant is not None:
            entry["tenant"] = tenant
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            entry["exc"] = record.exc_text
        return json.dumps(entry, ensure_ascii=False, default=str)


def configure_logging(level: str, log_format: str, *, model_libraries: bool = False) -> None:
    """Send every log record of ``level`` or above to stderr, in ``log_format``.

    Args:
        level: ``debug``, ``info``, ``warning`` or ``error``.
        log_format: ``text`` or ``json``.
        model_libraries: route the model libraries' logs here too, and turn their
            progress bars off. It imports them (and so torch): only where a model
            will load.
    """
    handler = logging.StreamHandler(sys.stderr)
    formatter = JsonFormatter() if log_format == "json" else logging.Formatter(_TEXT)
    handler.setFormatter(formatter)
    # On the handler too: a library's record passes its own logger's level, not the root's.
    handler.setLevel(level.upper())
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
    if model_libraries:
        _route_model_libraries()


def _route_model_libraries() -> None:
    """Route each of ``MODEL_LIBRARIES`` that is installed through the root logger, bars off."""
    for name in MODEL_LIBRARIES:
        try:
            library: Any = importlib.import_module(f"{name}.utils.logging")
        except ImportError:
            continue
        if hasattr(library, "disable_default_handler"):  # diffusers, transformers
            library.disable_default_handler()
            library.disable_progress_bar()
        else:  # huggingface_hub: a plain StreamHandler, added as it is imported
            hub = logging.getLogger(name)
            for handler in list(hub.handlers):
                if type(handler) is logging.StreamHandler:
                    hub.removeHandler(handler)
            importlib.import_module(f"{name}.utils").disable_progress_bars()
        library.enable_propagation()


def logs_json() -> bool:
    """Whether ``configure_logging`` made the log JSON lines: then errors are records too."""
    return any(isinstance(h.formatter, JsonFormatter) for h in logging.getLogger().handlers)


def log_notes(notes: Iterable[str]) -> None:
    """Log each of ``notes`` (what the command ignored, and why) at INFO."""
    for note in notes:
        logging.getLogger("omni_trio.cli").info("%s", note)
