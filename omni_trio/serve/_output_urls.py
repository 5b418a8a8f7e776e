"""Outputs as signed URLs (L97): ``OutputUrls``, the store's side the endpoints share.

The images endpoint (``response_format: "url"``) and the video content route
(``?response_format=url``) write outputs with ``keep``; ``_files``
(``GET /v1/files/{key}``) reads them back with ``check`` and ``read``. A URL is::

    {base}/v1/files/{key}?expires={second}&signature={HMAC-SHA256(secret, key + "\\n" + second)}

base64url, unpadded. The signature is checked in constant time
(``hmac.compare_digest``) before anything else: a forged or altered URL (another key,
a later expiry, no signature) is a 403 whatever its key; a genuine one past its
expiry is a 404 and its object is deleted then; a genuine one whose object was
deleted (with its video job) or swept is a 404 too. An object expires with its URL:
its key carries the second (``_output_store``), and a sweeper, one task in the
service's lifespan, deletes the expired ones every ``sweep_every_s``. Every replica
that shares the store and the secret serves every URL, and sweeps.

The store blocks: every call here runs it in a worker thread (``anyio.to_thread``),
never in the event loop.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import re
import secrets
import urllib.parse
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import anyio
import anyio.to_thread
from starlette.requests import Request

from ._errors import ApiError, server_error
from ._output_store import (
    KEY,
    OutputStore,
    OutputStoreError,
    StoredFile,
    expiry_of,
    output_store,
)

if TYPE_CHECKING:
    from anyio.abc import TaskStatus

    from ._asgi import Scope
    from ._config import OutputConfig

__all__ = ["FILES_PATH", "OutputUrls", "storage_failed"]

_log = logging.getLogger("omni_trio.serve")

#: The route that serves the outputs (``_files``); a URL is this plus a key.
FILES_PATH = "/v1/files/"

_SECOND = re.compile(r"[0-9]{1,12}")


def storage_failed(exc: OutputStoreError, about: str) -> ApiError:
    """The 500 of an output the store could not keep or read: logged here with its cause;
    the client learns only that it failed, and for what (``about``: ``request img-…``)."""
    _log.error("the output store failed for %s: %s", about, exc, exc_info=exc)
    return server_error(
        f"the output store failed for {about}; the server's log has the details", "storage_error"
    )


class OutputUrls:
    """The output store of one service, and its signed URLs (L97).

    Args:
        config: the store, the time-to-live, the secret, the public address, the clock.
    """

    def __init__(self, config: OutputConfig) -> None:
        self.config = config
        store = config.store
        self.store: OutputStore = store if isinstance(store, OutputStore) else output_store(store)
        self._random_secret = config.secret is None
        self._secret = config.secret if config.secret is not None else secrets.token_bytes(32)
        self._sweeper: anyio.CancelScope | None = None
        self._closed = False

    # -- the lifespan ---------------------------------------------------------

    async def open(self) -> None:
        """Check the store can be used (in a worker thread), and say where outputs go.

        Raises:
            OutputStoreError: the folder or the bucket cannot be used (one line).

        Cancellation:
            Safe: a check that began ends in its thread.
        """
        await anyio.to_thread.run_sync(self.store.open)
        _log.info(
            "outputs asked for as URLs are kept in %r for %g s", self.store, self.config.ttl_s
        )
        if self._random_secret:
            _log.warning(
                "output URLs are signed with a secret made at start (set OutputConfig.secret):"
                " they stop working when this server restarts, and no other replica serves them"
            )

    async def aclose(self) -> None:
        """Let go of the store (its connections), in a worker thread; idempotent.

        Cancellation:
            Shielded: the store is closed.
        """
        self.close()
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(self.store.close)

    async def serve(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Sweep the store's expired objects now and every ``sweep_every_s``, until ``close()``.

        A sweep that fails (the store unreachable a while) is logged, and the next one
        tries again.

        Cancellation:
            Stops the sweeper (a sweep that began ends in its thread).
        """
        self._sweeper = anyio.CancelScope()
        if self._closed:
            self._sweeper.cancel()
        task_status.started()
        with self._sweeper:
            while True:
                try:
                    await self.sweep()
                except OutputStoreError as exc:
                    _log.warning("the output store's sweep failed: %s", exc)
                await anyio.sleep(self.config.sweep_every_s)

    def close(self) -> None:
        """Stop the sweeper; ``serve`` returns at once."""
        self._closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()

    async def sweep(self) -> int:
        """Delete every expired object of the store (any replica's); return how many.

        Raises:
            OutputStoreError: the store cannot be listed or an object deleted.

        Cancellation:
            Safe: a listing or deletion that began ends in its thread.
        """
        now = self.config.clock()

        def expired() -> list[str]:
            found = [
                k for k in self.store.list_keys() if (e := expiry_of(k)) is not None and e <= now
            ]
            if found:
                self.store.delete(found)
            return found

        gone = await anyio.to_thread.run_sync(expired)
        if gone:
            _log.debug("the output store's sweep deleted %d expired objects", len(gone))
        return len(gone)

    # -- writing --------------------------------------------------------------

    def expiry(self, limit: int | None = None) -> int:
        """The second a URL made now expires: ``ttl_s`` from now, or ``limit`` if sooner."""
        expires = int(self.config.clock() + self.config.ttl_s)
        return expires if limit is None else min(expires, limit)

    async def keep(
        self, group: str, files: Sequence[tuple[str, bytes]], *, expires: int
    ) -> list[str]:
        """Write each ``(name, data)`` as ``{group}/{expires}-{name}``; return their keys.

        Raises:
            OutputStoreError: the store could not keep one (those written before stay,
                until they expire).

        Cancellation:
            Shielded: the writes end, so no object is half-made or unknown.
        """
        keys = [f"{group}/{expires}-{name}" for name, _ in files]
        if not all(KEY.fullmatch(key) for key in keys):
            raise ValueError(f"not output keys: {keys!r}")

        def write() -> None:
            for key, (_, data) in zip(keys, files, strict=True):
                self.store.put(key, data)

        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(write)
        return keys

    async def kept(self, group: str, *, expires: int) -> tuple[str, int] | None:
        """An object of ``group`` that a URL expiring at ``expires`` may give instead of a
        new one: the longest-lived whose expiry is at most half a time-to-live sooner,
        and not past; its key and expiry, or ``None``.

        Raises:
            OutputStoreError: the store cannot be listed.

        Cancellation:
            Safe.
        """
        keys = await anyio.to_thread.run_sync(self.store.list_keys, f"{group}/")
        at_least = max(expires - int(self.config.ttl_s / 2), int(self.config.clock()) + 1)
        dated = [(e, k) for k in keys if (e := expiry_of(k)) is not None and e >= at_least]
        if not dated:
            return None
        most, key = max(dated)
        return key, most

    async def forget(self, group: str) -> None:
        """Delete every object of ``group`` (a video job's, as the job is deleted); a store
        that fails is logged, and its objects left to their expiry.

        Cancellation:
            Shielded: the deletion ends.
        """
        await self._delete(lambda: self.store.list_keys(f"{group}/"), group)

    async def _delete(self, keys: Callable[[], list[str]], what: str) -> None:
        with anyio.CancelScope(shield=True):
            try:
                await anyio.to_thread.run_sync(lambda: self.store.delete(keys()))
            except OutputStoreError as exc:
                _log.warning("the outputs of %s are left until a sweep: %s", what, exc)

    # -- URLs -----------------------------------------------------------------

    def signature(self, key: str, expires: int) -> str:
        """HMAC-SHA256 of ``key`` and ``expires`` with the secret, base64url, unpadded."""
        digest = hmac.new(self._secret, f"{key}\n{expires}".encode(), hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest).rstrip(b"=").decode("ascii")

    def url(self, scope: Scope, key: str, expires: int) -> str:
        """The signed URL of ``key``, at ``public_url`` or the request's own address."""
        base = self.config.public_url
        if base is None:
            base = str(Request(dict(scope)).base_url)
        query = urllib.parse.urlencode(
            {"expires": expires, "signature": self.signature(key, expires)}
        )
        return f"{base.rstrip('/')}{FILES_PATH}{key}?{query}"

    def check(self, key: str, expires: str | None, signature: str | None) -> int:
        """The expiry of a URL whose signature is this server's (any time, expired too).

        Raises:
            ApiError: 403 ``invalid_signature``: no signature or expiry, or not these.
        """
        if (
            expires is not None
            and signature is not None
            and _SECOND.fullmatch(expires)
            and KEY.fullmatch(key)
        ):
            expected = self.signature(key, int(expires)).encode("ascii")
            if hmac.compare_digest(expected, signature.encode("utf-8", "replace")):
                return int(expires)
        raise ApiError(
            403,
            "the URL's signature is not valid: use a URL as this server made it",
            type="invalid_request_error",
            param="signature",
            code="invalid_signature",
        )

    async def read(self, key: str, expires: int) -> StoredFile:
        """Open a checked URL's object; one past its expiry is deleted now.

        Raises:
            ApiError: 404 ``url_expired`` (past its expiry) or ``file_not_found``
                (deleted with its job, or swept); 500 ``storage_error``.

        Cancellation:
            The open is shielded: the caller gets the file, and closes it, or it was
            never opened.
        """
        if expires <= self.config.clock():
            await self._delete(lambda: [key], key)
            raise ApiError(
                404,
                "this URL expired, and its file is deleted: ask for the output again",
                code="url_expired",
            )
        try:
            # Shielded: a file opened as the caller is cancelled reaches its ``finally``.
            with anyio.CancelScope(shield=True):
                found = await anyio.to_thread.run_sync(self.store.get, key)
        except OutputStoreError as exc:
            raise storage_failed(exc, "this URL's file") from None
        if found is None:
            raise ApiError(
                404,
                "this URL's file is deleted (with its video job, or expired)",
                code="file_not_found",
            )
        return found
