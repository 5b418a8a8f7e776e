"""``GET /v1/files/{key}``: an output kept as a URL (L97), streamed from the output store.

The URL is its own credential: its signature (``_output_urls``) is checked first,
in constant time, and no API key is asked (a browser or another service fetches it
as it is). A forged URL is a 403 ``invalid_signature``; a genuine one past its
expiry a 404 ``url_expired`` (its object is deleted then); one whose object is gone
(deleted with its video job, swept) a 404 ``file_not_found``; all OpenAI-style JSON.

The object is streamed in chunks, each read in a worker thread (a file's, or an S3
object's body): a large MP4 is never held whole, and the event loop never waits on
the disk or the network. ``HEAD`` answers the headers alone.
"""

from __future__ import annotations

import logging
import math
import urllib.parse
from typing import TYPE_CHECKING

import anyio
import anyio.to_thread

from ._asgi import Receive, Scope, Send, send_error
from ._errors import ApiError
from ._output_store import content_type

if TYPE_CHECKING:
    from ._output_urls import OutputUrls

__all__ = ["CHUNK_BYTES", "FilesEndpoint"]

_log = logging.getLogger("omni_trio.serve")

#: Bytes read and sent at a time (picked without measurement: large enough that a
#: thread hop per chunk costs little, small enough to hold a few per download).
CHUNK_BYTES = 1 << 20


class FilesEndpoint:
    """The ASGI app of ``GET /v1/files/{key}``.

    Args:
        outputs: the service's output store and its signer.
    """

    def __init__(self, outputs: OutputUrls) -> None:
        self._outputs = outputs

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Check the URL, then stream its object (see the module docstring).

        Cancellation:
            Stops the stream; the object's reader is closed.
        """
        outputs = self._outputs
        key: str = scope["path_params"]["key"]
        query = urllib.parse.parse_qs(bytes(scope.get("query_string", b"")).decode("latin-1"))
        try:
            expires = outputs.check(key, _one(query.get("expires")), _one(query.get("signature")))
            found = await outputs.read(key, expires)
        except ApiError as error:
            await send_error(send, error)
            return
        try:
            left = max(0, math.floor(expires - outputs.config.clock()))
            headers = [
                (b"content-type", content_type(key).encode("latin-1")),
                (b"content-length", str(found.size).encode("latin-1")),
                (b"cache-control", f"private, max-age={left}".encode("latin-1")),
                (b"x-content-type-options", b"nosniff"),
            ]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            if scope.get("method") == "HEAD":
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                return
            while True:
                try:
                    chunk = await anyio.to_thread.run_sync(found.reader.read, CHUNK_BYTES)
                except Exception:
                    # The answer began: it ends short, which the client sees by its length.
                    _log.exception("the output %s failed to read after its answer began", key)
                    return
                await send({"type": "http.response.body", "body": chunk, "more_body": bool(chunk)})
                if not chunk:
                    return
        except OSError:
            return  # the client went away (ASGI 2.4 servers raise on a closed connection)
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(found.reader.close)


def _one(values: list[str] | None) -> str | None:
    """A query parameter given once; ``None`` when absent or repeated."""
    return values[0] if values is not None and len(values) == 1 else None
