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

Durable jobs (L77, L78), with ``VideoConfig.jobs_dir``: every job is also a row of a
``JobStore`` (``_jobstore``: SQLite and files, written off the loop), written before
its ``POST`` is answered; its MP4 is a file, written atomically before the row says
``completed``; a running job is checkpointed every ``checkpoint_every_s`` (the
engine's ``CheckpointPolicy``, whose sink is the store's ``CheckpointWriter``
thread). On start, ``serve`` reads the rows back: finished jobs are kept until
they expire, the others are submitted again in their order, each from its last
checkpoint (L78). A job that shutdown cuts (its request aborted with reason
``shutdown``) is left as the store has it, so it runs again after the restart.
Without ``jobs_dir`` the jobs live in memory only: a restart loses them.

A shared store (L79), with ``VideoConfig.lease_s`` too: several servers on one host
(Ray Serve's replicas) keep their jobs in one folder. Each job has an owner, the
server that runs it, which renews its lease every ``lease_s / 3`` seconds; any
server reads, lists, downloads and deletes any job from the store; a server takes
over (``JobStore.claim``) a job whose lease lapsed (its owner died) or that its
owner let go at shutdown, and resumes it from its last checkpoint. An owner learns
that its job was deleted or taken over from its next write or renewal, and aborts
its request then.

Everything here runs in the event loop's thread (the store's calls in worker
threads, through ``anyio.to_thread``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import math
import os
import re
import secrets
import socket
import sqlite3
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import anyio.to_thread

from .._checkpoint import CheckpointPolicy
from .._codec import request_from_record, request_record
from .._errors import EngineClosedError, OmniTrioError, RequestAbortedError
from .._outputs import RequestStatus
from .._reasons import AbortReason
from ._errors import ApiError, api_error_from, invalid, unexpected_error
from ._jobstore import CheckpointWriter, JobRow, JobStore, hold
from ._video_body import VideoSpec

if TYPE_CHECKING:
    from anyio.abc import TaskGroup, TaskStatus

    from .._engine import Engine
    from .._handle import RequestHandle
    from .._outputs import GenerationOutput
    from ._metrics import ServeMetrics

_T = TypeVar("_T")

__all__ = ["DEFAULT_JOBS_LEASE_S", "STATUSES", "VideoConfig", "VideoJob", "VideoJobs"]

_log = logging.getLogger("omni_trio.serve")

#: A job's statuses, as OpenAI's ``Video.status`` names them.
STATUSES = ("queued", "in_progress", "completed", "failed")

#: The abort reason of a deleted job's request.
DELETED = "deleted"
#: Seconds a server of a shared store holds a job without renewing it (``--ray``'s
#: default): then another takes it over from its last checkpoint (L79).
DEFAULT_JOBS_LEASE_S = 10.0

#: Seconds between two reads of another server's job for its event stream (L79).
SHARED_POLL_S = 0.5

#: The abort reason of a job's request on a server whose lease of it lapsed (L79).
TAKEN_OVER = "taken_over"

#: ``video_`` + the job's sequence number (8 hex digits) + 24 random hex digits, so
#: that a list's ``after`` cursor keeps its place even once its job is gone.
_ID = re.compile(r"video_([0-9a-f]{8})[0-9a-f]{24}")


@dataclass(frozen=True, slots=True, kw_only=True)
class VideoConfig:
    """How ``/v1/videos`` turns seconds into frames and how many jobs it keeps, how long.

    Args:
        fps: frames per second of the MP4s, which turns ``seconds`` into frames.
        default_seconds: the length of a job that gives neither ``seconds`` nor
            ``num_frames`` (OpenAI's default: 4).
        max_jobs: the most jobs held at once, of any status; a new one beyond
            gets 429 (after the expired ones are dropped).
        ttl_s: seconds a finished (completed or failed) job is kept after it
            finished; then it and its MP4 are dropped.
        clock: monotonic seconds for the expiries (tests pass a fake one).
        jobs_dir: the folder of the durable store (L77): jobs and MP4s survive a
            restart or a crash; ``None``: in memory only.
        max_bytes: the most MP4 bytes held at once; a new job gets 429 while
            they are reached; ``None``: no bound but ``max_jobs``.
        checkpoint_every_s: with ``jobs_dir`` and a runner that takes
            checkpoints, a running job is checkpointed at the first step boundary
            this many seconds after the last checkpoint (0: at every boundary;
            ``None``: never, a crashed job then starts again from step 0).
        lease_s: with ``jobs_dir``, share the folder with the other servers on this
            host that share it (L79): a job whose owner has not renewed its lease for
            this many seconds is taken over by another; ``None``: the folder is this
            server's alone (a second server on it is refused).

    Raises:
        ValueError: a field is out of range; the message names it.
    """

    fps: float = 16.0
    default_seconds: float = 4.0
    max_jobs: int = 64
    ttl_s: float = 3600.0
    clock: Callable[[], float] = field(default=time.monotonic, compare=False)
    jobs_dir: str | os.PathLike[str] | None = None
    max_bytes: int | None = None
    checkpoint_every_s: float | None = 30.0
    lease_s: float | None = None

    def __post_init__(self) -> None:
        lease = self.lease_s
        if lease is not None and (
            not isinstance(lease, int | float)
            or isinstance(lease, bool)
            or not math.isfinite(lease)
            or lease <= 0
        ):
            raise ValueError(f"lease_s: must be a finite number > 0, got {lease!r}")
        every = self.checkpoint_every_s
        if every is not None and (
            not isinstance(every, int | float)
            or isinstance(every, bool)
            or not math.isfinite(every)
            or every < 0
        ):
            raise ValueError(f"checkpoint_every_s: must be a finite number >= 0, got {every!r}")
        most = self.max_bytes
        if most is not None and (not isinstance(most, int) or isinstance(most, bool) or most < 1):
            raise ValueError(f"max_bytes: must be an int >= 1, got {most!r}")
        for name in ("fps", "default_seconds", "ttl_s"):
            value = getattr(self, name)
            if (
                not isinstance(value, int | float)
                or isinstance(value, bool)
                or not math.isfinite(value)
                or value <= 0
            ):
                raise ValueError(f"{name}: must be a finite number > 0, got {value!r}")
        jobs = self.max_jobs
        if not isinstance(jobs, int) or isinstance(jobs, bool) or jobs < 1:
            raise ValueError(f"max_jobs: must be an int >= 1, got {jobs!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class Resumes:
    """A job's runs after a restart or a takeover (L77).

    Args:
        count: how many times it was run again.
        from_step: the step its last run again started from (its checkpoint's;
            ``None``: never run again).
        steps_lost: the steps it had done that a run again did again, in all.
    """

    count: int = 0
    from_step: int | None = None
    steps_lost: int = 0


class VideoJob:
    """One video job, as the loop sees it.

    ``status`` is ``queued`` until the worker takes the request (or a step is
    done), ``in_progress`` until the MP4 is encoded, then ``completed`` or
    ``failed`` (with ``error``: a code and a message that carry none of a
    model's exception text). ``progress`` is the percentage of denoise steps
    done, 100 only once completed. ``mp4`` is the encoded video, once completed.

    Both only move forward (L73): once started, a job reads ``in_progress`` even
    while a higher-priority request has it suspended (its handle then reads
    WAITING again), and ``progress`` never decreases.
    """

    __slots__ = (
        "_changed",
        "_ended",
        "_started",
        "completed_at",
        "created_at",
        "error",
        "expires_at",
        "handle",
        "id",
        "model",
        "mp4",
        "progress",
        "removed",
        "resumes",
        "scope",
        "seq",
        "size",
        "spec",
        "tenant",
    )

    def __init__(self, *, job_id: str, seq: int, model: str, spec: VideoSpec) -> None:
        self.id = job_id
        self.seq = seq
        self.model = model
        self.spec = spec
        self.created_at = int(time.time())
        self.completed_at: int | None = None
        self.expires_at: int | None = None
        self.progress = 0
        self.error: dict[str, str] | None = None
        self.mp4: bytes | None = None
        # The MP4's size: of ``mp4`` in memory, or of its file in a durable store.
        self.size = 0
        #: The tenant it belongs to, where tenants are set (``None``: none).
        self.tenant: str | None = None
        self.handle: RequestHandle | None = None
        self.scope = anyio.CancelScope()
        self.removed = False
        #: Its runs after a restart or a takeover (L77): how many, the step the last
        #: one started from, the steps done before and done again, in all.
        self.resumes = Resumes()
        self._ended: str | None = None  # "completed" or "failed"
        # Latched: a suspended (L61) request reads WAITING again, and its first
        # steps may round to 0 %, so neither the handle nor ``progress`` says it.
        self._started = False
        self._changed = anyio.Event()

    @property
    def status(self) -> str:
        """``queued``, ``in_progress``, ``completed`` or ``failed``."""
        if self._ended is not None:
            return self._ended
        if not self._started:
            handle = self.handle
            if handle is not None and handle.status is not RequestStatus.WAITING:
                # Latched by whoever reads it first: wake the others, whose next read
                # says so (an event stream waits for a change, L73).
                self._started = True
                self.changed()
        return "in_progress" if self._started else "queued"

    @property
    def is_finished(self) -> bool:
        """Whether the job completed or failed."""
        return self._ended is not None

    def body(self) -> dict[str, object]:
        """The job as OpenAI's ``Video`` object, with the engine's side under ``omni_trio``."""
        request = self.spec.request
        return {
            "id": self.id,
            "object": "video",
            "created_at": self.created_at,
            "completed_at": self.completed_at,
            "expires_at": self.expires_at,
            "error": self.error,
            "model": self.model,
            "progress": self.progress,
            "prompt": request.prompt,
            "remixed_from_video_id": None,
            "seconds": self.spec.seconds,
            "size": self.spec.size,
            "status": self.status,
            "omni_trio": {
                "num_frames": request.num_frames,
                "fps": self.spec.fps,
                "steps": request.num_steps,
                "seed": request.seed,
                "priority": request.priority,
                "bytes": self.size,
                "resumes": self.resumes.count,
                "resumed_from_step": self.resumes.from_step,
                "steps_lost": self.resumes.steps_lost,
            },
        }

    def changed(self) -> None:
        """Wake whoever waits for this job to change."""
        self._changed.set()
        self._changed = anyio.Event()

    async def wait_changed(self) -> None:
        """Wait until the job changes (a step, its end, its removal).

        Cancellation:
            Safe.
        """
        await self._changed.wait()

    def stepped(self, step: int, total: int) -> None:
        """A denoise step is done: the job started; ``progress`` from it, < 100 until encoded."""
        progress = max(self.progress, min(99, 100 * step // max(total, 1)))
        if progress != self.progress or not self._started:
            self._started = True
            self.progress = progress
            self.changed()

    def end(
        self,
        mp4: bytes | None,
        error: dict[str, str] | None,
        expires_at: int,
        *,
        size: int,
        completed_at: int | None = None,
    ) -> None:
        """The job completed (``size`` bytes of MP4: ``mp4``, or a file) or failed (``error``).

        ``completed_at``: the time the store recorded, so that a restart shows the same.
        """
        self.mp4 = mp4
        self.size = size
        if error is not None:
            self.error = error
        else:
            self.progress = 100
        self._ended = "failed" if error is not None else "completed"
        if completed_at is not None:
            self.completed_at = completed_at
        elif self.completed_at is None:
            self.completed_at = int(time.time())
        self.expires_at = expires_at
        self.handle = None
        self.changed()

    def restored(self, row: JobRow) -> None:
        """Take what the store kept of it: its times, progress and, if it ended, its end."""
        self.created_at = row.created_at
        self.progress = row.progress
        self._started = row.started
        self.tenant = row.tenant
        self.resumes = Resumes(
            count=row.resumes, from_step=row.resumed_from, steps_lost=row.steps_lost
        )
        if row.status in ("completed", "failed"):
            self.completed_at = row.completed_at
            error = dict(row.error) if row.error is not None else None
            if row.status == "failed" and error is None:
                error = {"code": "failed", "message": "the video job failed"}
            expires = int(row.expires_at) if row.expires_at is not None else 0
            self.end(None, error, expires, size=row.bytes)


def error_record(error: ApiError) -> dict[str, str]:
    """A failed job's ``error``: the API error's code and message."""
    return {"code": error.code or "failed", "message": error.message}


def spec_record(spec: VideoSpec) -> dict[str, Any]:
    """What the store keeps of a job's parameters (JSON data): the request, every field
    (``_codec``), and the video's own; ``spec_from_record`` reads it."""
    return {
        "size": spec.size,
        "seconds": spec.seconds,
        "fps": spec.fps,
        "request": request_record(spec.request),
    }


def spec_from_record(data: Any) -> VideoSpec:
    """The ``VideoSpec`` the store kept (``spec_record``); a deadline does not survive.

    Raises:
        Exception: the record is not one ``spec_record`` wrote (a ``KeyError``, a
            ``TypeError``, a ``ValueError``, an ``InvalidRequestError``).
    """
    request = request_from_record(data["request"])
    return VideoSpec(
        request=dataclasses.replace(request, deadline_s=None),
        size=str(data["size"]),
        seconds=str(data["seconds"]),
        fps=float(data["fps"]),
    )


def encode_mp4(output: GenerationOutput, fps: float, folder: Path | None = None) -> bytes:
    """The output's first video as MP4 bytes (H.264, ``yuv420p``; a worker thread's work).

    ``folder``: a durable store's, where the test hook ``encode`` may hold.
    """
    if folder is not None:
        hold("encode", folder)
    data = io.BytesIO()
    output.save_video(data, fps)
    return data.getvalue()


class VideoJobs:
    """The jobs of one service: created, run in its task group, listed, deleted, expired.

    Args:
        config: the fps, the bounds, the time-to-live and the durable store's folder.
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
        self.config = config
        self._metrics = metrics
        self._retry_after_s = retry_after_s
        self._checkpoints = checkpoints
        self._jobs: dict[str, VideoJob] = {}  # by creation, oldest first
        self._expiries: dict[str, float] = {}  # finished jobs: when they expire (clock)
        self._seq = 0
        self._tasks: TaskGroup | None = None
        self._wake: anyio.Event | None = None
        self._sweeper: anyio.CancelScope | None = None  # made in serve(): a loop's object
        self._closed = False
        # The durable store (L77), open while ``serve`` runs with a video engine, and
        # the rows it held when it opened, until ``serve`` takes them back.
        self.store: JobStore | None = None
        self._rows: list[JobRow] = []
        self._writer: CheckpointWriter | None = None
        self._limiter: anyio.CapacityLimiter | None = None
        self._doomed: list[str] = []  # expired jobs the store still has
        # This server's id in a shared store (L79); ``None``: the store is its alone.
        self.owner: str | None = None
        self._creating: set[str] = set()  # jobs whose rows are being written
        if config.jobs_dir is not None and config.lease_s is not None:
            self.owner = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"

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
        if self.config.jobs_dir is not None and engine is not None:
            self._limiter = anyio.CapacityLimiter(1)
            if self.store is None:
                await anyio.to_thread.run_sync(self.open_store, limiter=self._limiter)
            rows, self._rows = self._rows, []
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
                        if self.owner is not None and engine is not None:
                            keepers.start_soon(self._keep, engine, name="video jobs' leases")
                        task_status.started()
                        await self._sweep()
                # Closed: the jobs' tasks end by themselves (their requests are terminal
                # after the drain), each within one MP4 encode.
        finally:
            self._tasks = None
            # A task cancelled before it first ran (asyncio) never left its handle's
            # block: close those handles here, so no request or handle is left open.
            with anyio.CancelScope(shield=True):
                for job in list(self._jobs.values()):
                    if job.handle is not None and not job.handle.is_closed:
                        await job.handle.aclose()
                await self._close_store()

    def open_store(self) -> None:
        """Open the durable store (``config.jobs_dir``, L77) now, and read its jobs back.

        Blocks on the disk: the command line calls it before the server listens, so a
        store that cannot be opened is one line and no server; ``serve`` calls it in
        a worker thread when nobody did. A store open already is left as it is.

        Raises:
            StoreOpenError: the folder, its database or its lock cannot be had (the
                message says which); nothing is held then.
        """
        folder = self.config.jobs_dir
        if folder is None or self.store is not None:
            return
        store = JobStore(Path(folder), owner=self.owner)
        self._rows = store.open()
        self.store = store
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
        self._writer = self.store = None
        self._rows = []
        if writer is not None:
            writer.stop()
        if store is not None:
            store.close()

    async def _close_store(self) -> None:
        await anyio.to_thread.run_sync(self.close_store)

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
            match = _ID.fullmatch(row.id)
            self._seq = max(self._seq, int(match[1], 16) if match else row.seq)
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
        job = _view(row)
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
            if self.owner is not None:
                self._jobs.pop(job.id, None)
                await self._stored(self._store().release, job.id)
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

    async def _keep(self, engine: Engine) -> None:
        """A shared store's leases (L79), every ``lease_s / 3``: renew this server's, drop
        the jobs it lost, delete the expired ones, take over the lapsed ones."""
        lease = self.config.lease_s
        assert lease is not None
        while True:
            await self._keep_once(engine, lease)
            await anyio.sleep(lease / 3)

    async def _keep_once(self, engine: Engine, lease: float) -> None:
        store = self._store()
        # The jobs whose rows are written: a job being created is not yet in the store.
        known = [job for job in self._jobs.values() if job.id not in self._creating]
        ours = await self._stored(store.renew, time.time() + lease)
        for job in known:
            if job.id not in ours:
                self._lost(job, DELETED if job.is_finished else TAKEN_OVER)
        await self._stored(store.expired, time.time())
        while not self._closed:
            row = await self._stored(store.claim, time.time(), time.time() + lease)
            if row is None:
                return
            taken = await self._job_of(row)
            if taken is None:
                continue
            _log.info(
                "video job %s: taken over from %s",
                row.id,
                row.owner or "a server that stopped",
                extra={"request_id": row.id},
            )
            self._jobs[row.id] = taken
            if not await self._resume(taken, row, engine):
                return  # the engine is full: the next pass tries again

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

    async def _sweep(self) -> None:
        """Drop expired jobs when they expire (also checked on every use of the store)."""
        while True:
            self.purge()
            while self._doomed:
                await self._stored(self._store().delete, self._doomed.pop())
            wake = self._wake = anyio.Event()
            if self._expiries:
                delay = min(self._expiries.values()) - self.config.clock()
                with anyio.move_on_after(max(delay, 0.0)):
                    await wake.wait()
            else:
                await wake.wait()

    def close(self) -> None:
        """Admit no more jobs and stop the sweeper; ``serve`` returns once the jobs ended."""
        self._closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()

    def _nudge(self) -> None:
        if self._wake is not None:
            self._wake.set()

    def _store(self) -> JobStore:
        assert self.store is not None
        return self.store

    # -- the store ------------------------------------------------------------

    def purge(self) -> None:
        """Drop the finished jobs whose time-to-live has passed."""
        now = self.config.clock()
        for job_id in [i for i, when in self._expiries.items() if when <= now]:
            self._drop(job_id)
            if self.store is not None:
                self._doomed.append(job_id)  # the sweeper deletes it from the store
                self._nudge()

    def _drop(self, job_id: str) -> VideoJob:
        job = self._jobs.pop(job_id)
        self._expiries.pop(job_id, None)
        job.removed = True
        job.mp4 = None  # the bytes go now, whoever still holds the job
        job.changed()
        return job

    def get(self, job_id: str, *, tenant: str | None = None) -> VideoJob:
        """The job ``job_id``.

        Args:
            tenant: with a name, only that tenant's jobs are seen (a key that is not an
                admin key, L55); ``None``: every job.

        Raises:
            ApiError: 404 ``video_not_found``: no such job (never made, deleted,
                expired), or another tenant's, which reads the same.
        """
        self.purge()
        job = self._jobs.get(job_id)
        if job is None or (tenant is not None and job.tenant != tenant):
            raise _not_found(job_id)
        return job

    async def find(self, job_id: str, *, tenant: str | None = None) -> VideoJob:
        """The job ``job_id``, as ``get``; in a shared store (L79), as the store has it
        now, whichever server runs it (this server's own live job is its own object).

        Raises:
            ApiError: 404 ``video_not_found``, as ``get``.

        Cancellation:
            Safe.
        """
        if self.owner is None or self.store is None:
            return self.get(job_id, tenant=tenant)
        self.purge()
        row = await self._stored(self.store.row, job_id)
        job = self._jobs.get(job_id)
        if job is not None and (row is None or row.owner != self.owner):
            self._lost(job, DELETED if row is None else TAKEN_OVER)
            job = None
        if row is None or (tenant is not None and row.tenant != tenant):
            raise _not_found(job_id)
        if job is not None:
            return job
        view = _view(row)
        if view is None:
            raise _not_found(job_id)
        return view

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
        if self.owner is not None and self.store is not None:
            count, size = await self._stored(self.store.totals)
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
        self, engine: Engine, spec: VideoSpec, model: str, *, tenant: str | None = None
    ) -> VideoJob:
        """Make a job of ``spec``: hold it (durably first, with a store), submit it, start it.

        Raises:
            ApiError: as ``check_room``.
            OmniTrioError: the engine refused the request (the job is forgotten).

        Cancellation:
            Shielded: a job whose record is written is submitted, or forgotten.
        """
        await self.check_room()
        if self.owner is not None and self.store is not None:
            # Sequence numbers from the store: every server's ids keep one order.
            self._seq = await self._stored(self.store.next_seq) - 1
        job_id = self.new_id()
        if self.store is not None and spec.request.seed is None:
            # A resumed run must draw what the first run drew (L78): fix the seed now.
            request = dataclasses.replace(spec.request, seed=secrets.randbits(32))
            spec = dataclasses.replace(spec, request=request)
        job = VideoJob(job_id=job_id, seq=int(job_id[6:14], 16), model=model, spec=spec)
        job.tenant = tenant
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

    def running_of(self, tenant: str) -> int:
        """How many of ``tenant``'s jobs are not finished (L56); O(jobs held)."""
        return sum(1 for job in self._jobs.values() if not job.is_finished and job.tenant == tenant)

    def new_id(self) -> str:
        """A fresh job id: ``video_`` + its sequence number + random hex."""
        self._seq += 1
        return f"video_{self._seq:08x}{uuid.uuid4().hex[:24]}"

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
                raise _not_found(job_id)
            job.removed = True
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
        return dropped

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
            match = _ID.fullmatch(after)
            if match is None:
                raise invalid(f"after: must be a video id, got {shown_id(after)}", "after")
            cursor = int(match[1], 16)
        if self.owner is not None and self.store is not None:
            return await self._shared_page(limit, cursor, order == "desc", tenant)
        jobs: Iterator[VideoJob] = iter(self._jobs.values())
        if order == "desc":
            jobs = reversed(self._jobs.values())
        if cursor is not None:
            after_seq = cursor
            jobs = (
                j for j in jobs if (j.seq < after_seq if order == "desc" else j.seq > after_seq)
            )
        if tenant is not None:
            jobs = (j for j in jobs if j.tenant == tenant)
        chosen: list[VideoJob] = []
        for job in jobs:
            if len(chosen) == limit:
                return chosen, True
            chosen.append(job)
        return chosen, False

    async def _shared_page(
        self, limit: int, cursor: int | None, descending: bool, tenant: str | None
    ) -> tuple[list[VideoJob], bool]:
        """``page`` from a shared store: every server's jobs, as the store has them now."""
        store = self._store()
        rows = await self._stored(
            store.rows, limit=limit + 1, after=cursor, descending=descending, tenant=tenant
        )
        chosen: list[VideoJob] = []
        for row in rows[:limit]:
            job = self._jobs.get(row.id)
            if job is None or row.owner != self.owner:
                job = _view(row)
                if job is None:
                    continue
            chosen.append(job)
        return chosen, len(rows) > limit

    def counts(self) -> dict[str, int]:
        """Jobs held now, by status."""
        self.purge()
        counts = dict.fromkeys(STATUSES, 0)
        for job in self._jobs.values():
            counts[job.status] += 1
        return counts

    def held_bytes(self) -> int:
        """The MP4 bytes the store holds now."""
        self.purge()
        return sum(job.size for job in self._jobs.values())

    def __len__(self) -> int:
        """The jobs held now (expired ones dropped first)."""
        self.purge()
        return len(self._jobs)

    # -- a job's task ---------------------------------------------------------

    async def _run(self, job: VideoJob, handle: RequestHandle) -> None:
        """Follow the job's request to its end, encode its MP4, record the outcome."""
        mp4: bytes | None = None
        error: ApiError | None = None
        cut = False  # by shutdown: a durable job stays as the store has it, to run again
        folder = None if self.store is None else self.store.folder
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
                            and not await self._stored(
                                self.store.progressed, job.id, job.progress, event.step
                            )
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
                        mp4 = await anyio.to_thread.run_sync(
                            encode_mp4, output, job.spec.fps, folder
                        )
                    finally:
                        # The frames are held once, as MP4 bytes: the tensors go now.
                        del output
        except Exception:
            _log.exception("video job %s failed", job.id, extra={"request_id": job.id})
            mp4, error = None, unexpected_error()
        finally:
            if handle.status.is_terminal:  # cancelled from outside: the fallback closes it
                self._metrics.account(handle)
        if job.removed:
            return  # deleted: its request was aborted, nothing is kept
        if cut and self.store is not None:
            job.handle = None
            if self.owner is not None:
                # L79: another server takes it over now, from its last checkpoint.
                await self._stored(self.store.release, job.id)
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
            try:
                kept = await self._stored_end(job, mp4, error, finished, expires)
            except (OSError, sqlite3.Error) as exc:
                _log.error(
                    "video job %s fails: the store cannot keep its %s (%s)",
                    job.id,
                    "video" if mp4 is not None else "end",
                    exc.strerror if isinstance(exc, OSError) and exc.strerror else exc,
                    extra={"request_id": job.id},
                )
                written, mp4, error = mp4 is not None, None, _storage_error()
                kept = not job.removed
                if written:  # the MP4 failed: the row may still take the failure
                    with contextlib.suppress(OSError, sqlite3.Error):
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


def _storage_error() -> ApiError:
    """A job's error when the store could not keep its video (the server's log says why)."""
    return ApiError(
        500,
        "the video could not be stored (the server's disk or store failed); create the job again",
        type="server_error",
        code="storage_error",
    )


def _view(row: JobRow) -> VideoJob | None:
    """The job a stored row keeps, with its tenant's request again (L57: fair share,
    bounds, /metrics); ``None`` if its record is unreadable."""
    try:
        spec = spec_from_record(row.spec)
        if row.tenant is not None:
            request = dataclasses.replace(spec.request, tenant=row.tenant)
            spec = dataclasses.replace(spec, request=request)
    except Exception:
        _log.exception("video job %s: its record is unreadable", row.id)
        return None
    job = VideoJob(job_id=row.id, seq=row.seq, model=row.model, spec=spec)
    job.restored(row)
    return job


def _not_found(job_id: str) -> ApiError:
    return ApiError(
        404,
        f"no video {shown_id(job_id)}: never made, deleted, or expired",
        param="video_id",
        code="video_not_found",
    )


def shown_id(text: str) -> str:
    """A video id for a message: ASCII, at most 40 characters."""
    shown = ascii(text[:40])
    return shown if len(text) <= 40 else f"{shown[:-1]}...{shown[-1]}"
