"""Hypercorn's access log without its phantom lines: one line per request.

Hypercorn (0.18 and before, pgjones/hypercorn#357) logs an access line with no
status (``"POST /v1/images/generations 1.1" - -``) just before the real one when
the client closes the connection right after the response: the close arrives while
Hypercorn still sends the response's end, before it marks the stream closed, and a
close on a stream that is not closed is logged as a request that got no answer.

The fix is exact, not a filter on the text: the app is wrapped so that its scope
records that the response was sent in full (before the send that races), and the
access logger drops a line without a response for a scope that has one. A request
that really got no answer (the client left first) still gets its line.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from hypercorn.logging import Logger

__all__ = ["SENT", "AccessLogger", "marking_sent"]

#: The scope key that says the app sent its whole response.
SENT = "omni_trio.response_sent"

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]


def marking_sent(app: App) -> App:
    """Wrap ``app`` so that an HTTP scope says when its response's last body was sent."""

    async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return

        async def sending(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                scope[SENT] = True  # before the send: the close races with it
            await send(message)

        await app(scope, receive, sending)

    return wrapped


class AccessLogger(Logger):
    """Hypercorn's logger, minus the line of a close that raced a complete response."""

    async def access(self, request: Any, response: Any, request_time: float) -> None:
        if response is None and request.get(SENT, False):
            return  # the real line, with the status, follows
        await super().access(request, response, request_time)
