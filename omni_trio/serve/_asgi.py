"""ASGI plumbing the endpoints share: reading a request, answering it, watching its client.

The endpoints (``_images``, ``_edits``, the ``_video*`` modules) import these and
never each other:

- ``Scope``, ``Message``, ``Receive``, ``Send``: the ASGI types; ``Asgi`` runs a
  bound ``(scope, receive, send)`` method as an app under a Starlette route;
- ``header`` and ``headers``: a request's headers as text (latin-1, as HTTP/1.1
  defines); ``read_body``: the whole body, refused (413) past a byte limit before
  anything is parsed;
- ``send_json`` and ``send_error``: a complete JSON answer; ``error_response``:
  the same error as a Starlette response, for the routes that take a ``Request``;
- ``SSE_HEADERS`` and ``sse_event``: server-sent events;
- ``Client``: the HTTP side of one answer (its ``send``, and whether the client
  went away, read from the receive channel, which ``CLIENT_GONE`` reports).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

import anyio
import anyio.lowlevel
from starlette.responses import JSONResponse

from .._reasons import AbortReason
from ._errors import ApiError

if TYPE_CHECKING:
    from .._handle import RequestHandle

__all__ = [
    "CLIENT_GONE",
    "SSE_HEADERS",
    "Asgi",
    "Client",
    "Message",
    "Receive",
    "Scope",
    "Send",
    "error_response",
    "header",
    "headers",
    "read_body",
    "send_error",
    "send_json",
    "sse_event",
    "trace_headers",
]

Scope = Mapping[str, Any]
Message = Mapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

#: The abort reason of a request whose client disconnected.
CLIENT_GONE = AbortReason.CLIENT_DISCONNECTED

SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


class Asgi:
    """A bound ``async (scope, receive, send)`` method as an ASGI app.

    Starlette calls a function or method with a ``Request``; an object with
    ``__call__`` it runs as an ASGI app, as the routes that watch for the
    client's disconnect, or bound the body as it is read, need.
    """

    def __init__(self, call: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        self._call = call

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._call(scope, receive, send)


def header(scope: Scope, name: str) -> str | None:
    """The first value of header ``name`` (latin-1, as HTTP/1.1 defines), if sent."""
    wanted = name.lower().encode("latin-1")
    for key, value in scope.get("headers", ()):
        if key == wanted:
            return bytes(value).decode("latin-1")
    return None


def trace_headers(scope: Scope) -> dict[str, str]:
    """The request's W3C trace context (``traceparent``, ``tracestate``), the only headers a
    trace reads (L99: never a key)."""
    found = {name: header(scope, name) for name in ("traceparent", "tracestate")}
    return {name: value for name, value in found.items() if value is not None}


def headers(scope: Scope) -> dict[str, str]:
    """The request's headers by (lower-case) name, as text; a repeated one keeps its last value."""
    return {
        bytes(key).decode("latin-1"): bytes(value).decode("latin-1")
        for key, value in scope.get("headers", ())
    }


async def read_body(scope: Scope, receive: Receive, limit: int) -> bytes | None:
    """Read the whole body, or ``None`` if the client left; 413 past ``limit`` bytes.

    Raises:
        ApiError: 413 ``request_too_large`` (from ``Content-Length``, or as soon as
            the bytes read pass ``limit``), 400 ``invalid_header`` for a
            ``Content-Length`` that is not a number.

    Cancellation:
        Safe: what was read is dropped.
    """
    too_large = ApiError(
        413,
        f"the request body is larger than {limit} bytes",
        code="request_too_large",
        headers={"Connection": "close"},
    )
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                declared = int(value)
            except ValueError:
                raise ApiError(
                    400, "invalid Content-Length header", code="invalid_header"
                ) from None
            if declared > limit:
                raise too_large
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        if message["type"] != "http.request":
            continue
        chunk: bytes = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _raw_headers(headers: Mapping[str, str] | None) -> list[tuple[bytes, bytes]]:
    """``headers`` as ASGI takes them: lower-case latin-1 names and latin-1 values."""
    return [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in (headers or {}).items()]


async def send_json(
    send: Send, status: int, body: object, headers: Mapping[str, str] | None = None
) -> None:
    """Send a complete JSON response.

    Cancellation:
        Safe between the two messages only as far as the server allows; the
        response may be cut short.
    """
    data = json.dumps(body, separators=(",", ":")).encode()
    raw = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(data)).encode()),
        *_raw_headers(headers),
    ]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": data, "more_body": False})


async def send_error(send: Send, error: ApiError) -> None:
    """Send ``error`` as its status, its headers and its OpenAI-style JSON body.

    Cancellation:
        As ``send_json``.
    """
    await send_json(send, error.status, error.body(), error.headers)


def error_response(error: ApiError) -> JSONResponse:
    """``error`` as a Starlette response: its status, its headers, its JSON body."""
    return JSONResponse(error.body(), status_code=error.status, headers=dict(error.headers))


def sse_event(event: str, data: Mapping[str, object]) -> bytes:
    """One server-sent event: ``event: <event>`` and a one-line JSON ``data``."""
    payload = json.dumps(data, separators=(",", ":"))
    return f"event: {event}\ndata: {payload}\n\n".encode()


class Client:
    """The HTTP side of one answer: its ``send``, and whether the client went away.

    With a ``handle``, a disconnect aborts its request (reason ``CLIENT_GONE``);
    without one (a video job's event stream: the job outlives its watchers) it
    only stops the answer.
    """

    def __init__(self, receive: Receive, send: Send, handle: RequestHandle | None) -> None:
        self._receive = receive
        self._send = send
        self._handle = handle
        self.scope = anyio.CancelScope()
        self.is_gone = False
        self.is_finished = False

    def gone(self) -> None:
        """The client disconnected: abort the request, stop answering."""
        # After the last body message a server may report a disconnect that only
        # means "response complete" (Uvicorn, httpx's ASGITransport do).
        if not self.is_gone and not self.is_finished:
            self.is_gone = True
            # First reason wins: leaving the handle's block afterwards keeps this one.
            if self._handle is not None:
                self._handle.abort_nowait(reason=CLIENT_GONE)
            self.scope.cancel()

    async def watch(self) -> None:
        """Read the receive channel until ``http.disconnect``; then ``gone()``.

        Cancellation:
            Safe: it only reads.
        """
        while True:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                self.gone()
                return

    async def send(self, message: Message) -> None:
        """Send, treating a failed write (ASGI 2.4 servers raise OSError) as a disconnect.

        Cancellation:
            As the server's ``send``.
        """
        try:
            await self._send(message)
        except OSError:
            self.gone()
            await anyio.lowlevel.checkpoint()  # delivers the cancellation

    async def stream(
        self,
        request_id: str,
        events: Callable[[], Awaitable[None]],
        headers: Mapping[str, str] | None = None,
    ) -> None:
        """Answer with server-sent events: the headers (``headers`` too), then what
        ``events`` sends.

        The client is watched meanwhile: a disconnect cancels ``events`` (and, with
        a handle, aborts its request). ``events`` ends the body (``end()``).

        Cancellation:
            Stops the stream; the cancellation propagates.
        """
        raw = [*SSE_HEADERS, (b"x-request-id", request_id.encode()), *_raw_headers(headers)]
        with self.scope:
            await self.send({"type": "http.response.start", "status": 200, "headers": raw})
            async with anyio.create_task_group() as tg:
                tg.start_soon(self.watch)
                await events()
                tg.cancel_scope.cancel()

    async def chunk(self, data: bytes) -> None:
        """Send one piece of a streaming body.

        Cancellation:
            As ``send``.
        """
        await self.send({"type": "http.response.body", "body": data, "more_body": True})

    async def end(self) -> None:
        """Send the end of a streaming body: the answer is complete.

        Cancellation:
            As ``send``.
        """
        self.is_finished = True
        await self.send({"type": "http.response.body", "body": b"", "more_body": False})
