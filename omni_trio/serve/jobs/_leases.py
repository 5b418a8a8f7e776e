"""A shared store's leases (L79): renew this server's, learn what it lost, take over lapsed ones.

``LeaseKeeper`` runs in the jobs' task group of a server whose store is shared
(``VideoConfig.lease_s``). Every ``lease_s / 3`` seconds it renews the leases of this
server's live jobs, tells the lifecycle which of the jobs it holds are no longer its
own (deleted through another server, or taken over by one), deletes every server's
expired jobs, and takes over, one at a time, the live jobs whose lease lapsed (their
owner died or stalled, or let them go at shutdown), handing each to the lifecycle,
which resumes it from its last checkpoint.

The data flow one way: the keeper reads the lifecycle only through ``Holder`` (the
jobs it holds, whether it closed) and tells it what it lost or took over; it never
touches the lifecycle's jobs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import anyio

from ._store import JobRow, SharedJobStore

_log = logging.getLogger("omni_trio.serve")

__all__ = ["Holder", "LeaseKeeper", "Stored"]

_T = TypeVar("_T")


class Holder(Protocol):
    """The lifecycle, as the lease keeper sees it."""

    @property
    def is_closed(self) -> bool:
        """Whether it admits no more jobs (then it takes none over)."""
        ...

    def held(self) -> list[str]:
        """The ids of the jobs it holds whose rows are written, oldest first."""
        ...

    def lost(self, job_id: str) -> None:
        """The job is no longer this server's (deleted, or taken over): stop it here."""
        ...

    async def took_over(self, row: JobRow) -> bool:
        """The job of ``row`` is this server's now: resume it; return whether to take
        another (``False``: the engine is full, the next pass tries again)."""
        ...


class Stored(Protocol):
    """Runs a store's call off the event loop (the lifecycle's way: one at a time)."""

    async def __call__(self, call: Callable[..., _T], /, *args: Any, **kwargs: Any) -> _T:
        """``call(*args, **kwargs)`` in a worker thread; its result."""
        ...


class LeaseKeeper:
    """The leases of one server in a shared store (L79).

    Args:
        store: the shared store, open.
        lease_s: how long a lease holds; the keeper renews every third of it.
        stored: how the store's calls run off the loop.
    """

    def __init__(self, store: SharedJobStore, *, lease_s: float, stored: Stored) -> None:
        self._store = store
        self._lease_s = lease_s
        self._stored = stored

    async def keep(self, holder: Holder) -> None:
        """Keep the leases every ``lease_s / 3``, for ``holder``, until cancelled.

        Cancellation:
            Stops between two store calls (each call is shielded: one that began ends).
        """
        while True:
            try:
                await self.keep_once(holder)
            except self._store.failures as exc:
                # A store down a while (L98): the leases are kept at the next pass; one
                # that lapsed meanwhile may be another server's by then (told then).
                _log.warning(
                    "video jobs' leases not kept this pass (%s): again in %g s",
                    exc,
                    self._lease_s / 3,
                )
            await anyio.sleep(self._lease_s / 3)

    async def keep_once(self, holder: Holder) -> None:
        """Renew this server's leases, tell ``holder`` what it lost, delete the expired
        jobs, and take over the lapsed ones until none is left or ``holder`` is full.

        Cancellation:
            As ``keep``.
        """
        store, lease = self._store, self._lease_s
        # The jobs whose rows are written, before the renewal: one it misses was lost.
        held = holder.held()
        ours = await self._stored(store.renew, time.time() + lease)
        for job_id in held:
            if job_id not in ours:
                holder.lost(job_id)
        await self._stored(store.expired, time.time())
        while not holder.is_closed:
            row = await self._stored(store.claim, time.time(), time.time() + lease)
            if row is None or not await holder.took_over(row):
                return
