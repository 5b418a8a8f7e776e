"""The service's ASGI app as a Ray Serve replica runs it: cancellation becomes a disconnect.

Ray Serve tells a replica that an HTTP client went away by cancelling the task that
runs the ASGI app (a native asyncio ``Task.cancel()``, milliseconds after the
disconnect), not with an ``http.disconnect`` message. The images endpoint handles a
disconnect (abort at the next step boundary, count it, return once the worker let
go: L51), so ``ReplicaIngress`` turns the one into the other: the app runs in a task
of its own; when the outer task is cancelled, the app's ``receive`` answers
``http.disconnect``, the outer task waits until the app returned (the engine released
the request), then the cancellation propagates.

It also names the replica in every response (``X-Omni-Trio-Replica``), so a client
or a test sees which replica answered.

asyncio only, on purpose: Ray Serve runs replicas on asyncio, and the point is to
outlive a native cancellation, which anyio's shields do not stop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

__all__ = ["REPLICA_HEADER", "ReplicaIngress"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

#: The response header that names the replica that answered.
REPLICA_HEADER = "X-Omni-Trio-Replica"

_DISCONNECT: Message = {"type": "http.disconnect"}


class ReplicaIngress:
    """Wrap ``app`` so a cancelled HTTP request reads as a client disconnect.

    Args:
        app: the ASGI app (``Service.app``).
        replica_id: what ``X-Omni-Trio-Replica`` says.
    """

    def __init__(self, app: App, *, replica_id: str) -> None:
        self._app = app
        self._replica = (REPLICA_HEADER.lower().encode("latin-1"), replica_id.encode("latin-1"))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Run one ASGI connection; an HTTP one survives its task's cancellation.

        Cancellation:
            For an HTTP request, deferred: the app sees ``http.disconnect`` and the
            call returns once the app did (the engine released the request, one
            step at most), then re-raises ``CancelledError``. Lifespan and other
            scopes are passed through unchanged.
        """
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        gone = asyncio.Event()

        async def receive_until_gone() -> Message:
            if gone.is_set():
                return dict(_DISCONNECT)
            message = asyncio.ensure_future(receive())
            waiter = asyncio.ensure_future(gone.wait())
            try:
                await asyncio.wait({message, waiter}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                waiter.cancel()
                if not message.done():
                    message.cancel()
            if message.done() and not message.cancelled() and message.exception() is None:
                return message.result()
            # Cancelled by us, or failed: Ray's receive raises TaskCancelledError
            # once the proxy cancelled the request. Either way the client is gone.
            return dict(_DISCONNECT)

        async def send_named(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [*message.get("headers", ()), self._replica]
                message = {**message, "headers": headers}
            await send(message)

        task = asyncio.ensure_future(self._app(scope, receive_until_gone, send_named))
        cancelled = False
        while not task.done():
            try:
                # wait(), not the task itself: the outer cancellation must not reach it.
                await asyncio.wait({task})
            except asyncio.CancelledError:
                cancelled = True
                gone.set()
        if cancelled:
            raise asyncio.CancelledError
        task.result()
