"""A video job (L73) and its configuration: ``VideoConfig``, ``VideoJob``, ids, the store.

``VideoConfig`` says how ``/v1/videos`` turns seconds into frames, how many jobs it
keeps and where (``store_of``: a ``SqliteJobStore`` of ``jobs_dir``, the ``store``
factory's, or memory only); ``VideoJob`` is one job as the event loop sees it, its
status and progress only moving forward; ``view`` makes one of a store's row.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio

from ..._outputs import RequestStatus
from .._errors import ApiError
from .._video_body import VideoSpec
from ._record import spec_from_record
from ._sqlite import SqliteJobStore
from ._store import JobRow, JobStore, SharedJobStore

if TYPE_CHECKING:
    from ..._handle import RequestHandle

__all__ = [
    "DEFAULT_JOBS_LEASE_S",
    "DELETED",
    "STATUSES",
    "TAKEN_OVER",
    "Resumes",
    "VideoConfig",
    "VideoJob",
    "id_seq",
    "is_durable",
    "make_id",
    "not_found",
    "shown_id",
    "store_of",
    "view",
]

_log = logging.getLogger("omni_trio.serve")

#: A job's statuses, as OpenAI's ``Video.status`` names them.
STATUSES = ("queued", "in_progress", "completed", "failed")

#: The abort reason of a deleted job's request.
DELETED = "deleted"
#: Seconds a server of a shared store holds a job without renewing it (``--ray``'s
#: default): then another takes it over from its last checkpoint (L79).
DEFAULT_JOBS_LEASE_S = 10.0

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
        checkpoint_every_s: with a store (``jobs_dir``, ``store``) and a runner that takes
            checkpoints, a running job is checkpointed at the first step boundary
            this many seconds after the last checkpoint (0: at every boundary;
            ``None``: never, a crashed job then starts again from step 0).
        lease_s: share the store (``jobs_dir``) with the other servers on this
            host that share it (L79): a job whose owner has not renewed its lease for
            this many seconds is taken over by another; ``None``: the folder is this
            server's alone (a second server on it is refused).
        store: makes the durable store instead of ``jobs_dir``, when the service
            opens it: called with this server's id (with ``lease_s``; it must make a
            ``SharedJobStore`` then), else ``None``; any class with the methods of
            ``omni_trio.serve.jobs.JobStore`` (``MemoryTables().store`` keeps the
            jobs in memory, for tests); ``None``: ``jobs_dir``'s SQLite store, if any.

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
    store: Callable[[str | None], JobStore] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.store is not None and not callable(self.store):
            raise ValueError(f"store: must make a job store (a callable), got {self.store!r}")
        if self.store is not None and self.jobs_dir is not None:
            raise ValueError("store: give jobs_dir or store, not both")
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
        "trace",
    )

    def __init__(self, *, job_id: str, seq: int, model: str, spec: VideoSpec) -> None:
        self.id = job_id
        self.seq = seq
        self.model = model
        #: The span of the route that made it (L99), the parent of its request's span.
        self.trace: Any = None
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


def is_durable(config: VideoConfig) -> bool:
    """Whether ``config`` keeps its jobs in a store (``jobs_dir`` or ``store``), not in
    memory only."""
    return config.jobs_dir is not None or config.store is not None


def store_of(config: VideoConfig, owner: str | None) -> JobStore | None:
    """The durable store ``config`` names, for the server ``owner`` (``None``: its alone):
    its ``store`` factory's, a ``SqliteJobStore`` of ``jobs_dir``, or ``None``.

    Raises:
        TypeError: ``owner`` is set (``lease_s``) and the store is no ``SharedJobStore``.
    """
    if config.store is not None:
        store = config.store(owner)
    elif config.jobs_dir is not None:
        store = SqliteJobStore(Path(config.jobs_dir), owner=owner)
    else:
        return None
    if owner is not None and not isinstance(store, SharedJobStore):
        raise TypeError(
            f"lease_s: the store {type(store).__name__} cannot be shared (it keeps no"
            " leases): leave lease_s unset"
        )
    return store


def view(row: JobRow) -> VideoJob | None:
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


def make_id(seq: int) -> str:
    """A job id of sequence number ``seq``: ``video_`` + its 8 hex digits + random hex."""
    return f"video_{seq:08x}{uuid.uuid4().hex[:24]}"


def id_seq(job_id: str) -> int | None:
    """The sequence number a job id carries; ``None`` if it is no video id."""
    match = _ID.fullmatch(job_id)
    return None if match is None else int(match[1], 16)


def not_found(job_id: str) -> ApiError:
    """The 404 of a job that is not there (never made, deleted, expired, another's)."""
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
