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

The store is bounded: at most ``VideoConfig.max_jobs`` jobs of any status; a
finished job expires ``ttl_s`` after it finished (checked on every use of the
store, and by a sweeper task that wakes at the next expiry). A full store
refuses a new job with 429. Jobs live in memory only: a restart loses them.

Everything here runs in the event loop's thread.
"""

from __future__ import annotations

import io
import logging
import math
import re
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import anyio
import anyio.to_thread

from .._errors import OmniTrioError
from .._outputs import RequestStatus
from ._errors import ApiError, api_error_from, invalid, unexpected_error

if TYPE_CHECKING:
    from anyio.abc import TaskGroup, TaskStatus

    from .._handle import RequestHandle
    from .._outputs import GenerationOutput
    from ._metrics import ServeMetrics
    from ._video_body import VideoSpec

__all__ = ["STATUSES", "VideoConfig", "VideoJob", "VideoJobs"]

_log = logging.getLogger("omni_trio.serve")

#: A job's statuses, as OpenAI's ``Video.status`` names them.
STATUSES = ("queued", "in_progress", "completed", "failed")

#: The abort reason of a deleted job's request.
DELETED = "deleted"

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

    Raises:
        ValueError: a field is out of range; the message names it.
    """

    fps: float = 16.0
    default_seconds: float = 4.0
    max_jobs: int = 64
    ttl_s: float = 3600.0
    clock: Callable[[], float] = field(default=time.monotonic, compare=False)

    def __post_init__(self) -> None:
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
        "scope",
        "seq",
        "spec",
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
        self.handle: RequestHandle | None = None
        self.scope = anyio.CancelScope()
        self.removed = False
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
            self._started = handle is not None and handle.status is not RequestStatus.WAITING
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
                "bytes": len(self.mp4) if self.mp4 is not None else 0,
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

    def end(self, mp4: bytes | None, error: ApiError | None, expires_at: int) -> None:
        """The job completed (``mp4``) or failed (``error``)."""
        self.mp4 = mp4
        if error is not None:
            self.error = {"code": error.code or "failed", "message": error.message}
        else:
            self.progress = 100
        self._ended = "failed" if mp4 is None else "completed"
        self.completed_at = int(time.time())
        self.expires_at = expires_at
        self.handle = None
        self.changed()


def encode_mp4(output: GenerationOutput, fps: float) -> bytes:
    """The output's first video as MP4 bytes (H.264, ``yuv420p``; a worker thread's work)."""
    data = io.BytesIO()
    output.save_video(data, fps)
    return data.getvalue()


class VideoJobs:
    """The jobs of one service: created, run in its task group, listed, deleted, expired.

    Args:
        config: the fps, the bound and the time-to-live.
        metrics: where each job's outcome and timings are counted.
        retry_after_s: the ``Retry-After`` of a 429.
    """

    def __init__(self, config: VideoConfig, metrics: ServeMetrics, *, retry_after_s: int) -> None:
        self.config = config
        self._metrics = metrics
        self._retry_after_s = retry_after_s
        self._jobs: dict[str, VideoJob] = {}  # by creation, oldest first
        self._expiries: dict[str, float] = {}  # finished jobs: when they expire (clock)
        self._seq = 0
        self._tasks: TaskGroup | None = None
        self._wake: anyio.Event | None = None
        self._sweeper: anyio.CancelScope | None = None  # made in serve(): a loop's object
        self._closed = False

    # -- the lifespan ---------------------------------------------------------

    async def serve(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Run the jobs' task group and the sweeper until ``close()``, then the jobs' ends.

        The service closes it after the engine's drain, when every job's request
        is terminal: each job's task then ends within one MP4 encode, so a job
        that completed before the drain is completed, not lost.

        Cancellation:
            Cancels every job's task (each leaves its handle's block, which aborts
            a live request and waits for its release); returns when they all ended.
        """
        try:
            async with anyio.create_task_group() as tasks:
                self._tasks = tasks
                self._wake = anyio.Event()
                self._sweeper = anyio.CancelScope()
                if self._closed:
                    self._sweeper.cancel()
                with self._sweeper:
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

    async def _sweep(self) -> None:
        """Drop expired jobs when they expire (also checked on every use of the store)."""
        while True:
            self.purge()
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

    # -- the store ------------------------------------------------------------

    def purge(self) -> None:
        """Drop the finished jobs whose time-to-live has passed."""
        now = self.config.clock()
        for job_id in [i for i, when in self._expiries.items() if when <= now]:
            self._drop(job_id)

    def _drop(self, job_id: str) -> VideoJob:
        job = self._jobs.pop(job_id)
        self._expiries.pop(job_id, None)
        job.removed = True
        job.mp4 = None  # the bytes go now, whoever still holds the job
        job.changed()
        return job

    def get(self, job_id: str) -> VideoJob:
        """The job ``job_id``.

        Raises:
            ApiError: 404 ``video_not_found``: no such job (never made, deleted, expired).
        """
        self.purge()
        job = self._jobs.get(job_id)
        if job is None:
            raise ApiError(
                404,
                f"no video {shown_id(job_id)}: never made, deleted, or expired",
                param="video_id",
                code="video_not_found",
            )
        return job

    def check_room(self) -> None:
        """Raise unless a new job fits.

        Raises:
            ApiError: 429 ``video_jobs_full`` when ``max_jobs`` jobs are held;
                503 ``shutting_down`` once the task group is gone.
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
        if len(self._jobs) >= self.config.max_jobs:
            raise ApiError(
                429,
                f"the server holds {self.config.max_jobs} video jobs already (the most it"
                " keeps); delete finished ones, or retry once they expire",
                type="rate_limit_error",
                code="video_jobs_full",
                headers={"Retry-After": str(self._retry_after_s)},
            )

    def start(self, job_id: str, spec: VideoSpec, handle: RequestHandle, model: str) -> VideoJob:
        """Hold a job for the admitted ``handle`` and start its task (``check_room`` first)."""
        assert self._tasks is not None, "check_room() first"
        seq = int(job_id[6:14], 16)
        job = VideoJob(job_id=job_id, seq=seq, model=model, spec=spec)
        job.handle = handle
        self._jobs[job_id] = job
        self._tasks.start_soon(self._run, job, handle, name=f"video job {job_id}")
        return job

    def running_of(self, tenant: str) -> int:
        """How many of ``tenant``'s jobs are not finished (L56); O(jobs held)."""
        return sum(
            1
            for job in self._jobs.values()
            if not job.is_finished and job.handle is not None and job.handle.tenant == tenant
        )

    def new_id(self) -> str:
        """A fresh job id: ``video_`` + its sequence number + random hex."""
        self._seq += 1
        return f"video_{self._seq:08x}{uuid.uuid4().hex[:24]}"

    def delete(self, job_id: str) -> VideoJob:
        """Drop the job now; abort its request (reason ``deleted``) and cancel its task.

        Raises:
            ApiError: 404, as ``get``.
        """
        job = self.get(job_id)
        handle = job.handle
        if handle is not None:
            handle.abort_nowait(reason=DELETED)
        job.scope.cancel()
        return self._drop(job_id)

    def page(self, *, limit: int, after: str | None, order: str) -> tuple[list[VideoJob], bool]:
        """Up to ``limit`` jobs after the cursor, newest first (``desc``) or oldest first.

        Returns:
            The jobs and whether more follow.

        Raises:
            ApiError: 400 naming ``after`` if it is not a video id.
        """
        self.purge()
        jobs: Iterator[VideoJob] = iter(self._jobs.values())
        if order == "desc":
            jobs = reversed(self._jobs.values())
        if after is not None:
            match = _ID.fullmatch(after)
            if match is None:
                raise invalid(f"after: must be a video id, got {shown_id(after)}", "after")
            cursor = int(match[1], 16)
            jobs = (j for j in jobs if (j.seq < cursor if order == "desc" else j.seq > cursor))
        chosen: list[VideoJob] = []
        for job in jobs:
            if len(chosen) == limit:
                return chosen, True
            chosen.append(job)
        return chosen, False

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
        return sum(len(job.mp4) for job in self._jobs.values() if job.mp4 is not None)

    def __len__(self) -> int:
        """The jobs held now (expired ones dropped first)."""
        self.purge()
        return len(self._jobs)

    # -- a job's task ---------------------------------------------------------

    async def _run(self, job: VideoJob, handle: RequestHandle) -> None:
        """Follow the job's request to its end, encode its MP4, record the outcome."""
        mp4: bytes | None = None
        error: ApiError | None = None
        try:
            with job.scope:
                output: GenerationOutput | None = None
                async with handle:
                    async for event in handle:
                        job.stepped(event.step, event.total)
                    try:
                        output = await handle.result()
                    except OmniTrioError as exc:
                        error = api_error_from(
                            exc, retry_after_s=self._retry_after_s, request_id=job.id
                        )
                if output is not None:
                    try:
                        mp4 = await anyio.to_thread.run_sync(encode_mp4, output, job.spec.fps)
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
        if mp4 is None and error is None:
            error = unexpected_error()  # cancelled without a delete: not expected
        self._expiries[job.id] = self.config.clock() + self.config.ttl_s
        job.end(mp4, error, int(time.time() + self.config.ttl_s))
        self._nudge()


def shown_id(text: str) -> str:
    """A video id for a message: ASCII, at most 40 characters."""
    shown = ascii(text[:40])
    return shown if len(text) <= 40 else f"{shown[:-1]}...{shown[-1]}"
