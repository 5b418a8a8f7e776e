"""Why a request was aborted: the one vocabulary of abort reasons.

The engine, its handles and the HTTP server name a reason with ``AbortReason``;
``RequestAbortedError.reason``, ``RequestHandle.abort_reason``, the log line of a
finished request and the server's answers carry it. A ``StrEnum``: each member is
the plain string it stands for (``AbortReason.USER == "user"``), so a reason given
as a ``str`` to ``abort`` works as before, and an application's own reasons (any
other non-empty ``str``) travel the same way.
"""

from __future__ import annotations

import enum

__all__ = ["AbortReason"]


class AbortReason(enum.StrEnum):
    """The abort reasons the library gives; see ``docs/contract.md``."""

    #: ``abort()`` without a reason (the default).
    USER = "user"
    #: The consumer left ``async with handle`` (or closed it) before the end (L11).
    CONSUMER_GONE = "consumer_gone"
    #: The consumer's task was cancelled while it waited for the request (L11).
    CANCELLED = "cancelled"
    #: Shutdown cut the request off (L31, L32); only the engine gives it.
    SHUTDOWN = "shutdown"
    #: The request's deadline passed (L62).
    DEADLINE = "deadline"
    #: The HTTP client went away before the answer (L46, L51).
    CLIENT_DISCONNECTED = "client_disconnected"
    #: The weights were updated with ``policy="abort"`` while it ran (L102).
    WEIGHTS_UPDATED = "weights_updated"
