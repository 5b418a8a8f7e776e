"""What the ``omni-trio`` commands share: their errors and exit statuses.

A command raises ``UsageError`` for arguments it cannot use and ``CommandError``
for anything else that stops it; ``reported`` (which ``main`` runs a command in)
prints either as one line, ``omni-trio: error: <message>``, and returns its
``exit_status``.
"""

from __future__ import annotations

import logging
import sys
import traceback
from collections.abc import Callable

from ._logs import logs_json

__all__ = [
    "EXIT_ERROR",
    "EXIT_INTERRUPTED",
    "EXIT_USAGE",
    "PROG",
    "CommandError",
    "UsageError",
    "exit_status_for",
    "report",
    "reported",
    "summary",
]

PROG = "omni-trio"
"""The command's name, as errors and the usage line print it."""

EXIT_ERROR = 1
"""A command failed: a model did not load, a request failed, a needed extra is missing."""

EXIT_USAGE = 2
"""The arguments were wrong (argparse uses 2 for these too)."""

EXIT_INTERRUPTED = 130
"""Stopped by Ctrl-C (128 + SIGINT, as shells report it)."""


def exit_status_for(signum: int) -> int:
    """The exit status of a command stopped by signal ``signum``: 128 + it, as shells report.

    ``EXIT_INTERRUPTED`` for SIGINT, 143 for SIGTERM.
    """
    return 128 + signum


class CommandError(Exception):
    """A command cannot go on; the message is one line for the user.

    Args:
        message: what went wrong, and where it helps, what to do.
        exit_status: the process's exit status (default ``EXIT_ERROR``).
    """

    def __init__(self, message: str, *, exit_status: int = EXIT_ERROR) -> None:
        super().__init__(message)
        self.exit_status = exit_status


class UsageError(CommandError):
    """The command's arguments are wrong; exits with ``EXIT_USAGE``."""

    def __init__(self, message: str) -> None:
        super().__init__(message, exit_status=EXIT_USAGE)


def summary(exc: BaseException) -> str:
    """``exc`` as one line: its type and the first line of its message."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def reported(run: Callable[[], int], *, debug: bool) -> int:
    """``run()``'s exit status; an error it raises reported (``report``), Ctrl-C as 130.

    Args:
        run: the command.
        debug: print an error's traceback too.
    """
    try:
        return run()
    except KeyboardInterrupt:
        sys.stderr.write(f"\n{PROG}: interrupted\n")
        return EXIT_INTERRUPTED
    except Exception as exc:
        return report(exc, debug=debug)


def report(exc: Exception, *, debug: bool) -> int:
    """Print ``exc`` as one line (after its traceback with ``debug``); return the exit status.

    Once ``serve`` made its log JSON lines, the line is a log record instead (its
    traceback in ``exc``), so that stderr stays JSON to its end.
    """
    if isinstance(exc, CommandError):
        message, status = str(exc), exc.exit_status
    else:
        hint = "" if debug else " (run with --debug for the traceback)"
        message, status = f"{summary(exc)}{hint}", EXIT_ERROR
    if logs_json():
        failure = exc if debug else None
        logging.getLogger("omni_trio.cli").error("%s: error: %s", PROG, message, exc_info=failure)
        return status
    if debug:
        traceback.print_exception(exc)
    sys.stderr.write(f"{PROG}: error: {message}\n")
    return status
