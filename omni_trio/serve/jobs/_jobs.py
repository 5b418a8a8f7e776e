"""Video jobs (L73): each a task in the service's task group, their MP4s in a bounded store.

A job is one engine request that outlives the HTTP request that made it: ``POST
/v1/videos`` submits it and answers at once; the job's task (started in the task
group the service's lifespan holds) follows its step events (``progress``),
takes the output, encodes the MP4 in a worker thread and drops the output, so a
finished job holds its frames once, as MP4 bytes. Deleting a job aborts its
request (the engine's abort, reason ``deleted``) and cancels its task; the HTTP
answer does not wait for the release. Shutdown drains the engine (every job
still live ends: completed within the grace period, or failed) and then cancels
the task group: no job's task outlives the lifespan.

The store is bounded: at most ``VideoConfig.max_jobs`` jobs of any status and
``max_bytes`` bytes of MP4s; a finished job expires ``ttl_s`` after it finished
(checked on every use of the store, and by a sweeper task that wakes at the next
expiry). A full store refuses a new job with 429 ``video_jobs_full``.

Durable jobs (L77, L78), with ``VideoConfig.jobs_dir`` (or ``store``): every job is
also a row of a ``JobStore`` (``_store``'s protocol; ``_sqlite``'s SQLite and files
with ``jobs_dir``; called off the loop), written before its ``POST`` is answered;
its MP4 is kept whole before the row says ``completed``; a running job is
checkpointed every ``checkpoint_every_s`` (the engine's ``CheckpointPolicy``, whose
sink is the store's ``CheckpointWriter`` thread, ``_writer``). On start, ``serve``
reads the rows back: finished jobs are kept until they expire, the others are
submitted again in their order, each from its last checkpoint (L78). A job that
shutdown cuts (its request aborted with reason ``shutdown``) is left as the store
has it, so it runs again after the restart. Without a store the jobs live in memory
only: a restart loses them.

A shared store (L79), with ``VideoConfig.lease_s`` too: several servers on one host
(Ray Serve's replicas) keep their jobs in one folder. Each job has an owner, the
server that runs it, which renews its lease every ``lease_s / 3`` seconds; any
server reads, lists, downloads and deletes any job from the store; a server takes
over (``SharedJobStore.claim``, by its ``_leases.LeaseKeeper``) a job whose lease
lapsed (its owner died) or that its owner let go at shutdown, and resumes it from its
last checkpoint. An owner learns that its job was deleted or taken over from its next
write or renewal, and aborts its request then.

Everything here runs in the event loop's thread (the store's calls in worker
threads, through ``anyio.to_thread``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import secrets
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread

from .._errors import ApiError, invalid
from .._video_body import VideoSpec
from ._job import (
    DELETED,
    TAKEN_OVER,
    VideoJob,
    id_seq,
    is_durable,
    not_found,
    shown_id,
    store_of,
    view,
)
from ._leases import LeaseKeeper
from ._record import spec_record
from ._runs import JobRuns
from ._store import JobRow, SharedJobStore
from ._writer import CheckpointWriter

if TYPE_CHECKING:
    from anyio.abc import TaskStatus

    from ..._engine import Engine

__all__ = ["SHARED_POLL_S", "SWEEP_RETRY_S", "VideoJobs"]

_log = logging.getLogger("omni_trio.serve")

#: Seconds between two reads of another server's job for its event stream (L79).
SHARED_POLL_S = 0.5

#: Seconds before the sweeper tries again to delete an expired job the store failed to.
SWEEP_RETRY_S = 30.0


class VideoJobs(JobRuns):
    """The jobs of one service: created, run in its task group, listed, deleted, expired.

    Three layers, one object (as asyncio's event loops): ``JobTable`` (``_table``, the
    jobs held in memory), ``JobRuns`` (``_runs``, each job's run, written through to
    the store) and this one: the lifespan, admission, deletion, the reads.

    Takes ``JobRuns``' arguments.
    """

    _sweeper: anyio.CancelScope | None = None  # made in serve(): a loop's object
    # The rows the store held when it opened, until ``serve`` takes them back.
    _rows: Sequence[JobRow] = ()
    #: Called with a job's id once ``delete`` dropped it (the service's output store
    #: deletes the job's URL outputs there, L97); it handles its own failures.
    on_delete: Callable[[str], Awaitable[None]] | None = None

    # -- the lifespan ---------------------------------------------------------

    async def serve(
        self,
        engine: Engine | None = None,
        *,
        task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Run the jobs' task group and the sweeper until ``close()``, then the jobs' ends.

        With ``config.jobs_dir`` and ``engine`` (a video model's), the store opens
        first and its jobs come back: the finished ones as they were, the others
        submitted again in their order (from their last checkpoint).

        The service closes it after the engine's drain, when every job's request
        is terminal: each job's task then ends within one MP4 encode, so a job
        that completed before the drain is completed, not lost.

        Cancellation:
            Cancels every job's task (each leaves its handle's block, which aborts
            a live request and waits for its release); returns when they all ended.
        """
        rows: list[JobRow] = []
        if is_durable(self.config) and engine is not None:
            self._limiter = anyio.CapacityLimiter(1)
            if self.store is None:
                await anyio.to_thread.run_sync(self.open_store, limiter=self._limiter)
            rows, self._rows = list(self._rows), ()
            self._writer = CheckpointWriter(self._store())
            self._writer.start()
            if self.owner is not None:
                rows = []  # each is read when asked for; the lapsed ones are taken over
        try:
            async with anyio.create_task_group() as tasks:
                self._tasks = tasks
                self._wake = anyio.Event()
                self._sweeper = anyio.CancelScope()
                if self._closed:
                    self._sweeper.cancel()
                if engine is not None:
                    await self._restore(rows, engine)
                del rows
                with self._sweeper:
                    async with anyio.create_task_group() as keepers:
                        lease = self.config.lease_s
                        if self.owner is not None and engine is not None and lease is not None:
                            self._engine = engine  # where the jobs it takes over run
                            keeper = LeaseKeeper(
                                self._shared_store(), lease_s=lease, stored=self._stored
                            )
                            keepers.start_soon(keeper.keep, self, name="video jobs' leases")
                        task_status.started()
                        await self._sweep()
                # Closed: the jobs' tasks end by themselves (their requests are terminal
                # after the drain), each within one MP4 encode.
        finally:
            self._tasks = self._engine = None
            # A task cancelled before it first ran (asyncio) never left its handle's
            # block: close those handles here, so no request or handle is left open.
            with anyio.CancelScope(shield=True):
                for job in list(self._jobs.values()):
                    if job.handle is not None and not job.handle.is_closed:
                        await job.handle.aclose()
                await self._close_store()

    def open_store(self) -> None:
        """Open the durable store (``config.jobs_dir``, ``store``: L77) now, and read its
        jobs back.

        Blocks on the disk: the command line calls it before the server listens, so a
        store that cannot be opened is one line and no server; ``serve`` calls it in
        a worker thread when nobody did. A store open already is left as it is.

        Raises:
            StoreOpenError: the folder, its database or its lock cannot be had (the
                message says which); nothing is held then.
            TypeError: ``lease_s`` with a ``store`` that cannot be shared.
        """
        store = None if self.store is not None else store_of(self.config, self.owner)
        if store is None:
            return
        self._rows = store.open()
        self.store = store
        if self.owner is not None:
            assert isinstance(store, SharedJobStore)  # store_of checked it
            self._shared = store
        folder = self.config.jobs_dir if self.config.jobs_dir is not None else type(store).__name__
        if self.owner is not None:
            _log.info(
                "video jobs are kept in %s, shared (%d there; this server is %s)",
                folder,
                len(self._rows),
                self.owner,
            )
        else:
            _log.info("video jobs are kept in %s (%d there)", folder, len(self._rows))

    def close_store(self) -> None:
        """Write the checkpoints queued, close the store and let go of its folder (blocks;
        idempotent: ``serve`` closes it as it returns, the command line once more in case
        the server never ran)."""
        writer, store = self._writer, self.store
        self._writer = self.store = self._shared = None
        self._rows = ()
        if writer is not None:
            writer.stop()
        if store is not None:
            store.close()

    async def _close_store(self) -> None:
        await anyio.to_thread.run_sync(self.close_store)

    async def _sweep(self) -> None:
        """Drop expired jobs when they expire (also checked on every use of the store)."""
        while True:
            self.purge()
            failed = await self._delete_doomed()
            wake = self._wake = anyio.Event()
            if self._expiries or failed:
                delay = min(self._expiries.values(), default=math.inf) - self.config.clock()
                if failed:
                    delay = min(delay, SWEEP_RETRY_S)  # the store's deletes again then
                with anyio.move_on_after(max(delay, 0.0)):
                    await wake.wait()
            else:
                await wake.wait()

    async def _delete_doomed(self) -> bool:
        """Delete the expired jobs from the store; whether a delete failed (its job is kept
        to delete on the next pass, one warning each: a store down a while costs no
        server, L77, and the row, expired, is dropped again if a restart reads it)."""
        if not self._doomed:
            return False
        store = self._store()
        kept: list[str] = []
        while self._doomed:
            job_id = self._doomed.pop()
            try:
                await self._stored(store.delete, job_id)
            except store.failures as exc:
                _log.warning(
                    "video job %s: expired, but not deleted from the store (%s); tried again"
                    " in %.0f s",
                    job_id,
                    exc,
                    SWEEP_RETRY_S,
                    extra={"request_id": job_id},
                )
                kept.append(job_id)
        self._doomed.extend(kept)
        return bool(kept)

    def close(self) -> None:
        """Admit no more jobs and stop the sweeper; ``serve`` returns once the jobs ended."""
        self._closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()

    # -- admission and reads ---------------------------------------------------

    async def check_room(self) -> None:
        """Raise unless a new job fits (in a shared store, counting every server's jobs).

        Raises:
            ApiError: 429 ``video_jobs_full`` when ``max_jobs`` jobs or ``max_bytes``
                bytes of MP4s are held; 503 ``shutting_down`` once the task group is gone.

        Cancellation:
            Safe.
        """
        self.purge()
        if self._tasks is None or self._closed:
            raise ApiError(
                503,
                "the server is shutting down",
                type="server_error",
                code="shutting_down",
                headers={"Retry-After": str(self._retry_after_s)},
            )
        full = None
        count, size = len(self._jobs), self.held_bytes()
        if self._shared is not None:
            count, size = await self._stored(self._shared.totals)
            count += len(self._creating)
        if count >= self.config.max_jobs:
            full = f"the server holds {self.config.max_jobs} video jobs already (the most it keeps)"
        elif self.config.max_bytes is not None and size >= self.config.max_bytes:
            full = (
                f"the server holds {size} bytes of videos already (the most it"
                f" keeps is {self.config.max_bytes})"
            )
        if full is not None:
            raise ApiError(
                429,
                f"{full}; delete finished ones, or retry once they expire",
                type="rate_limit_error",
                code="video_jobs_full",
                headers={"Retry-After": str(self._retry_after_s)},
            )

    async def create(
        self,
        engine: Engine,
        spec: VideoSpec,
        model: str,
        *,
        tenant: str | None = None,
        trace: Any = None,
    ) -> VideoJob:
        """Make a job of ``spec``: hold it (durably first, with a store), submit it, start it.

        Raises:
            ApiError: as ``check_room``.
            OmniTrioError: the engine refused the request (the job is forgotten).

        Cancellation:
            Shielded: a job whose record is written is submitted, or forgotten.
        """
        await self.check_room()
        if self._shared is not None:
            # Sequence numbers from the store: every server's ids keep one order.
            self._seq = await self._stored(self._shared.next_seq) - 1
        job_id = self.new_id()
        if self.store is not None and spec.request.seed is None:
            # A resumed run must draw what the first run drew (L78): fix the seed now.
            request = dataclasses.replace(spec.request, seed=secrets.randbits(32))
            spec = dataclasses.replace(spec, request=request)
        job = VideoJob(job_id=job_id, seq=int(job_id[6:14], 16), model=model, spec=spec)
        job.tenant = tenant
        job.trace = trace
        self._jobs[job_id] = job  # its place is taken from now on
        self._creating.add(job_id)
        try:
            if self.store is not None:
                lease = self.config.lease_s
                row = JobRow(
                    id=job_id,
                    seq=job.seq,
                    model=model,
                    spec=spec_record(spec),
                    status="queued",
                    created_at=job.created_at,
                    tenant=tenant,
                    lease=None if lease is None else time.time() + lease,
                )
                await self._stored(self._store().insert, row)
            handle = self._submit(engine, job)
        except BaseException:
            self._jobs.pop(job_id, None)
            if self.store is not None:
                await self._stored(self._store().delete, job_id)
            raise
        finally:
            self._creating.discard(job_id)
        self._start(job, handle)
        return job

    async def delete(self, job_id: str, *, tenant: str | None = None) -> VideoJob:
        """Drop the job now; abort its request (reason ``deleted``) and cancel its task.

        With a store, the answer waits for the record's deletion (durable).

        Raises:
            ApiError: 404, as ``get`` (``tenant`` as there).

        Cancellation:
            Shielded once the job is dropped.
        """
        job = await self.find(job_id, tenant=tenant)
        if self._jobs.get(job_id) is not job:
            # Another server's (L79): it aborts the request when it learns of it.
            if self.store is None or not await self._stored(self.store.delete, job_id):
                raise not_found(job_id)
            job.removed = True
            await self._deleted(job_id)
            return job
        handle = job.handle
        if handle is not None:
            handle.abort_nowait(reason=DELETED)
        job.scope.cancel()
        dropped = self._drop(job_id)
        if self._writer is not None:
            self._writer.forget(job_id)
        if self.store is not None:
            await self._stored(self._store().delete, job_id)
        await self._deleted(job_id)
        return dropped

    async def _deleted(self, job_id: str) -> None:
        if self.on_delete is not None:
            with anyio.CancelScope(shield=True):
                await self.on_delete(job_id)

    async def find(self, job_id: str, *, tenant: str | None = None) -> VideoJob:
        """The job ``job_id``, as ``get``; in a shared store (L79), as the store has it
        now, whichever server runs it (this server's own live job is its own object).

        Raises:
            ApiError: 404 ``video_not_found``, as ``get``.

        Cancellation:
            Safe.
        """
        if self._shared is None:
            return self.get(job_id, tenant=tenant)
        self.purge()
        row = await self._stored(self._shared.row, job_id)
        job = self._jobs.get(job_id)
        if job is not None and (row is None or row.owner != self.owner):
            self._lost(job, DELETED if row is None else TAKEN_OVER)
            job = None
        if row is None or (tenant is not None and row.tenant != tenant):
            raise not_found(job_id)
        if job is not None:
            return job
        seen = view(row)
        if seen is None:
            raise not_found(job_id)
        return seen

    async def next_change(self, job: VideoJob, *, tenant: str | None = None) -> VideoJob:
        """Wait until ``job`` changes; return it as it is then (``removed`` once it is gone).

        This server's own job wakes its waiters; another server's (a shared store's,
        L79) is read again from the store every ``SHARED_POLL_S``.

        Cancellation:
            Safe.
        """
        if self._jobs.get(job.id) is job:
            await job.wait_changed()
            return job
        await anyio.sleep(SHARED_POLL_S)
        try:
            return await self.find(job.id, tenant=tenant)
        except ApiError:
            job.removed = True
            return job

    async def content(self, job: VideoJob) -> bytes | None:
        """A completed job's MP4 (from memory, or its file); ``None`` if it is gone.

        Cancellation:
            Safe.
        """
        if job.mp4 is not None or self.store is None or job.status != "completed":
            return job.mp4
        return await anyio.to_thread.run_sync(self._store().video, job.id)

    async def page(
        self, *, limit: int, after: str | None, order: str, tenant: str | None = None
    ) -> tuple[list[VideoJob], bool]:
        """Up to ``limit`` jobs after the cursor, newest first (``desc``) or oldest first;
        with ``tenant``, only that tenant's (as ``get``).

        Returns:
            The jobs and whether more follow.

        Raises:
            ApiError: 400 naming ``after`` if it is not a video id.

        Cancellation:
            Safe.
        """
        self.purge()
        cursor = None
        if after is not None:
            cursor = id_seq(after)
            if cursor is None:
                raise invalid(f"after: must be a video id, got {shown_id(after)}", "after")
        if self._shared is not None:
            return await self._shared_page(limit, cursor, order == "desc", tenant)
        return self._page_here(limit, cursor, order, tenant)

    async def _shared_page(
        self, limit: int, cursor: int | None, descending: bool, tenant: str | None
    ) -> tuple[list[VideoJob], bool]:
        """``page`` from a shared store: every server's jobs, as the store has them now."""
        store = self._shared_store()
        rows = await self._stored(
            store.rows, limit=limit + 1, after=cursor, descending=descending, tenant=tenant
        )
        chosen: list[VideoJob] = []
        for row in rows[:limit]:
            job = self._jobs.get(row.id)
            if job is None or row.owner != self.owner:
                job = view(row)
                if job is None:
                    continue
            chosen.append(job)
        return chosen, len(rows) > limit
