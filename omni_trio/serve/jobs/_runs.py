"""Running video jobs (L73, L77-L79): ``JobRuns``, the middle layer of ``VideoJobs``.

A job's run: its request submitted (new, or again from its last checkpoint after a
restart or a takeover), followed in its task to its end, its MP4 encoded in a worker
thread, and its end recorded, in the store first (``_store.JobStore``, its calls off
the loop one at a time) and then here (``_table``). A store that cannot keep a job's
end fails that job alone (L77); a job that another server took over or deleted (L79)
is stopped here, keeping nothing. ``JobRuns`` is also the ``_leases.Holder`` that the
lease keeper tells what it lost or took over.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import anyio.to_thread

from ..._checkpoint import CheckpointPolicy
from ..._errors import EngineClosedError, OmniTrioError, RequestAbortedError
from ..._reasons import AbortReason
from .._errors import ApiError, api_error_from, unexpected_error
from .._tracing import Tracing
from ._job import (
    DELETED,
    TAKEN_OVER,
    Resumes,
    VideoConfig,
    VideoJob,
    id_seq,
    is_durable,
    view,
)
from ._record import encode_mp4, error_record, storage_error
from ._store import JobRow, JobStore, SharedJobStore
from ._table import JobTable
from ._writer import CheckpointWriter

if TYPE_CHECKING:
    from anyio.abc import TaskGroup

    from ..._engine import Engine
    from ..._handle import RequestHandle
    from ..._outputs import GenerationOutput
    from .._metrics import ServeMetrics

_T = TypeVar("_T")

__all__ = ["JobRuns"]

_log = logging.getLogger("omni_trio.serve")


class JobRuns(JobTable):
    """The jobs' runs: submitted, followed, ended, resumed; written through to the store.

    Args:
        config: the fps, the bounds, the time-to-live and the durable store.
        metrics: where each job's outcome and timings are counted.
        retry_after_s: the ``Retry-After`` of a 429.
        checkpoints: whether the runner takes checkpoints (L78).
    """

    def __init__(
        self,
        config: VideoConfig,
        metrics: ServeMetrics,
        *,
        retry_after_s: int,
        checkpoints: bool = False,
    ) -> None:
        super().__init__(config)
        self._metrics = metrics
        #: The server's tracer (L99): each job's request span when it ends; off until set.
        self.tracing = Tracing()
        self._retry_after_s = retry_after_s
        self._checkpoints = checkpoints
        self._tasks: TaskGroup | None = None
        self._shared: SharedJobStore | None = None  # the store, where it is shared (L79)
        self._writer: CheckpointWriter | None = None
        self._limiter: anyio.CapacityLimiter | None = None
        # This server's id in a shared store (L79); ``None``: the store is its alone.
        self.owner: str | None = None
        if is_durable(config) and config.lease_s is not None:
            self.owner = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
        self._engine: Engine | None = None  # where jobs taken over run (L79)

    def _store(self) -> JobStore:
        assert self.store is not None
        return self.store

    def _shared_store(self) -> SharedJobStore:
        assert self._shared is not None
        return self._shared

    async def _stored(self, call: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        """Run a store's call in a worker thread (the store's calls block on the disk).

        Cancellation:
            Shielded: a write that began ends, and the caller learns how.
        """
        with anyio.CancelScope(shield=True):
            result = await anyio.to_thread.run_sync(
                lambda: call(*args, **kwargs), limiter=self._limiter
            )
        return result

    async def _restore(self, rows: list[JobRow], engine: Engine) -> None:
        """Take the store's jobs back: finished ones kept, the others submitted again."""
        now_wall, now = time.time(), self.config.clock()
        for row in rows:
            seq = id_seq(row.id)
            self._seq = max(self._seq, seq if seq is not None else row.seq)
            job = await self._job_of(row)
            if job is None:
                continue
            self._jobs[row.id] = job
            if job.is_finished:
                self._expiries[row.id] = now + (row.expires_at or now_wall) - now_wall
                continue
            await self._resume(job, row, engine)
        self.purge()

    async def _job_of(self, row: JobRow) -> VideoJob | None:
        """The job a row keeps; ``None`` (the row deleted) if it cannot be read."""
        job = view(row)
        if job is None:
            await self._stored(self._store().delete, row.id)
        return job

    async def _resume(self, job: VideoJob, row: JobRow, engine: Engine) -> bool:
        """Submit a stored job again, from its last checkpoint; return whether it runs.

        An accepted job is never refused again by an estimate (L77): it is submitted as
        ``accepted``. Refused all the same (a field this server's model or adapters
        cannot take): in a shared store the job is let go for another server (or a
        later try); else it fails with the engine's reason, said in one line.
        """
        data = None
        if row.checkpoint_step is not None:
            data = await self._stored(self._store().checkpoint, row.id)
        if not self._checkpoints:
            data = None
        from_step = row.checkpoint_step if data is not None and row.checkpoint_step else 0
        try:
            handle = self._submit(engine, job, resume_from=data, accepted=True)
        except OmniTrioError as exc:
            if self._shared is not None:
                self._jobs.pop(job.id, None)
                await self._stored(self._shared.release, job.id)
                return False
            _log.error(
                "video job %s cannot run again after the restart: %s",
                job.id,
                exc,
                extra={"request_id": job.id},
            )
            await self._end(job, None, api_error_from(exc, retry_after_s=self._retry_after_s))
            return False
        lost = max(0, row.step - from_step)
        total = job.spec.request.denoise_steps
        job.resumes = Resumes(
            count=job.resumes.count + 1,
            from_step=from_step,
            steps_lost=job.resumes.steps_lost + lost,
        )
        self._metrics.video_resumed(lost)
        _log.info(
            "video job %s runs again from step %d of %d (%s; %d step%s lost)",
            job.id,
            from_step,
            total,
            "its checkpoint" if data is not None else "no checkpoint",
            lost,
            "" if lost == 1 else "s",
            extra={"request_id": job.id},
        )
        self._start(job, handle)
        await self._stored(self._store().resumed, job.id, from_step, lost)
        return True

    # -- what the lease keeper tells (``_leases.Holder``, L79) -------------------

    def lost(self, job_id: str) -> None:
        """Another server deleted the job, or took it over: stop it here, keep nothing."""
        job = self._jobs.get(job_id)
        if job is not None:
            self._lost(job, DELETED if job.is_finished else TAKEN_OVER)

    async def took_over(self, row: JobRow) -> bool:
        """The job of ``row`` is this server's now: resume it from its last checkpoint;
        return whether another may be taken (``False``: the engine refused it)."""
        assert self._engine is not None, "serve() runs the lease keeper"
        taken = await self._job_of(row)
        if taken is None:
            return True
        _log.info(
            "video job %s: taken over from %s",
            row.id,
            row.owner or "a server that stopped",
            extra={"request_id": row.id},
        )
        self._jobs[row.id] = taken
        return await self._resume(taken, row, self._engine)

    def _lost(self, job: VideoJob, reason: str) -> None:
        """Another server deleted the job, or took it over: stop it here, keep nothing."""
        if job.removed:
            return
        if job.handle is not None:
            job.handle.abort_nowait(reason=reason)
        job.scope.cancel()
        if self._writer is not None:
            self._writer.forget(job.id)
        self._drop(job.id)

    # -- a job's task ---------------------------------------------------------

    def _submit(
        self,
        engine: Engine,
        job: VideoJob,
        *,
        resume_from: bytes | None = None,
        accepted: bool = False,
    ) -> RequestHandle:
        """Submit the job's request, checkpointed where the store and the runner allow."""
        policy = None
        every = self.config.checkpoint_every_s
        writer = self._writer
        if writer is not None and self._checkpoints and every is not None:
            policy = CheckpointPolicy(every_s=every, sink=writer.offer)
        return engine.submit(
            job.spec.request,
            request_id=job.id,
            checkpoint=policy,
            resume_from=resume_from,
            accepted=accepted,
        )

    def _start(self, job: VideoJob, handle: RequestHandle) -> None:
        assert self._tasks is not None, "check_room() first"
        job.handle = handle
        self._tasks.start_soon(self._run, job, handle, name=f"video job {job.id}")

    async def _progressed(self, job: VideoJob, step: int) -> bool:
        """Write the job's progress to the store; return whether the job is still this
        server's. A store that cannot take it now (down a while) costs the job nothing:
        progress is what a restart reads to count the steps lost (L77), so the job runs
        on, and the next write says where it is."""
        store = self.store
        assert store is not None
        try:
            kept: bool = await self._stored(store.progressed, job.id, job.progress, step)
        except store.failures as exc:
            _log.warning(
                "video job %s: its progress is not written (%s); it runs on",
                job.id,
                exc,
                extra={"request_id": job.id},
            )
            return True
        return kept

    async def _run(self, job: VideoJob, handle: RequestHandle) -> None:
        """Follow the job's request to its end, encode its MP4, record the outcome."""
        mp4: bytes | None = None
        error: ApiError | None = None
        cut = False  # by shutdown: a durable job stays as the store has it, to run again
        hold = None if self.store is None else self.store.hold
        try:
            with job.scope:
                output: GenerationOutput | None = None
                async with handle:
                    async for event in handle:
                        started, progress = job.status == "in_progress", job.progress
                        job.stepped(event.step, event.total)
                        # Every server reads a shared store's progress (L79), and a
                        # restart says how many steps it lost (L77): written as the
                        # percentage moves, at most 100 times a job.
                        if (
                            self.store is not None
                            and (not started or job.progress != progress)
                            and not await self._progressed(job, event.step)
                        ):
                            self._lost(job, TAKEN_OVER)
                    try:
                        output = await handle.result()
                    except OmniTrioError as exc:
                        # Shutdown's cut (of a waiting or a running request).
                        cut = isinstance(exc, EngineClosedError) or (
                            isinstance(exc, RequestAbortedError)
                            and exc.reason == AbortReason.SHUTDOWN
                        )
                        error = api_error_from(
                            exc, retry_after_s=self._retry_after_s, request_id=job.id
                        )
                if output is not None:
                    try:
                        mp4 = await anyio.to_thread.run_sync(encode_mp4, output, job.spec.fps, hold)
                    finally:
                        # The frames are held once, as MP4 bytes: the tensors go now.
                        del output
        except Exception:
            _log.exception("video job %s failed", job.id, extra={"request_id": job.id})
            mp4, error = None, unexpected_error()
        finally:
            if handle.status.is_terminal:  # cancelled from outside: the fallback closes it
                outcome = self._metrics.account(handle)
                self.tracing.request(
                    job.trace,
                    request=job.spec.request,
                    request_id=job.id,
                    model=job.model,
                    outcome=outcome,
                    metrics=handle.metrics,
                )
        if job.removed:
            return  # deleted: its request was aborted, nothing is kept
        if cut and self.store is not None:
            job.handle = None
            if self._shared is not None:
                # L79: another server takes it over now, from its last checkpoint.
                await self._stored(self._shared.release, job.id)
            return  # L77: it runs again after the restart, from its last checkpoint
        if mp4 is None and error is None:
            error = unexpected_error()  # cancelled without a delete: not expected
        await self._end(job, mp4, error)

    async def _end(self, job: VideoJob, mp4: bytes | None, error: ApiError | None) -> None:
        """Record the job's end: in the store first (its MP4 as a file), then here.

        A store that cannot take it (a full disk, a failing database) fails this job
        alone (L77): logged in one line, the job failed here with ``storage_error``.
        """
        if self._writer is not None:
            self._writer.forget(job.id)
        expires = time.time() + self.config.ttl_s
        finished = int(time.time())
        if self.store is not None:
            failures = self.store.failures
            try:
                kept = await self._stored_end(job, mp4, error, finished, expires)
            except failures as exc:
                _log.error(
                    "video job %s fails: the store cannot keep its %s (%s)",
                    job.id,
                    "video" if mp4 is not None else "end",
                    exc.strerror if isinstance(exc, OSError) and exc.strerror else exc,
                    extra={"request_id": job.id},
                )
                written, mp4, error = mp4 is not None, None, storage_error()
                kept = not job.removed
                if written:  # the MP4 failed: the row may still take the failure
                    with contextlib.suppress(*failures):
                        kept = await self._stored_end(job, None, error, finished, expires)
            if not kept or job.removed:
                return  # deleted or taken over meanwhile
            if mp4 is not None:
                size, mp4 = len(mp4), None  # served from its file
            else:
                size = 0
        else:
            size = 0 if mp4 is None else len(mp4)
        if job.removed:
            return
        record = None if error is None else error_record(error)
        self._expiries[job.id] = self.config.clock() + self.config.ttl_s
        job.end(mp4, record, int(expires), size=size, completed_at=finished)
        self._nudge()

    async def _stored_end(
        self,
        job: VideoJob,
        mp4: bytes | None,
        error: ApiError | None,
        finished: int,
        expires: float,
    ) -> bool:
        """Write the job's end to the store; return whether it was still this store's."""
        store = self._store()
        if mp4 is not None:
            return await self._stored(
                store.completed, job.id, mp4, completed_at=finished, expires_at=expires
            )
        assert error is not None
        return await self._stored(
            store.failed,
            job.id,
            error_record(error),
            progress=job.progress,
            completed_at=finished,
            expires_at=expires,
        )
