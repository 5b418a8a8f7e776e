"""What the video jobs' lifecycle asks of a store (L77, L79): ``JobStore``, ``SharedJobStore``.

The lifecycle (``_jobs``) talks to these protocols only; a store is a class that has
their methods (``_sqlite.SqliteJobStore``, ``_memory.MemoryJobStore``), and the
conformance tests (tests/serve/test_job_stores.py) run one set of tests over each.

Every method blocks (a disk, a database): the lifecycle calls them through
``anyio.to_thread``, one at a time, and the checkpoint writer (``_writer``) from its
own thread, so a store is thread-safe.

A store made without an ``owner`` is one server's: opening it takes every
unfinished job, and a second server on it is refused (``StoreBusyError``). A store
made with an ``owner`` (a server's id) is shared with the other servers that do
(L79): each job row names its owner and a lease (Unix seconds) that the owner
renews; a server takes over a job whose lease lapsed (its owner died or stalled) in
one atomic step (``claim``), and every write about a running job is fenced by its
owner (the job must be live and this store's), so a server that lost a job's lease
changes nothing of it. What only a shared store does is ``SharedJobStore``'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from ..._checkpoint import Checkpoint

__all__ = [
    "LIVE",
    "ErrorBody",
    "JobRow",
    "JobStore",
    "SharedJobStore",
    "StoreBusyError",
    "StoreOpenError",
    "rows_query",
]

#: A failed job's error, as its record keeps it: ``code`` and ``message``.
ErrorBody = Mapping[str, str]

#: The statuses of a job still to run.
LIVE = ("queued", "in_progress")


@dataclass(frozen=True, slots=True, kw_only=True)
class JobRow:
    """One job as the store keeps it.

    Args:
        id: the job's id.
        seq: its sequence number (admission order).
        model: the served model's name.
        spec: its parameters (``_record.spec_record``), as JSON data.
        status: ``queued``, ``in_progress``, ``completed`` or ``failed``.
        started: whether it ever started (its status never goes back, L73).
        progress: the percentage it reached.
        created_at: Unix seconds.
        completed_at: Unix seconds, once finished.
        expires_at: Unix seconds (a float), once finished.
        error: a failed job's error (``code``, ``message``).
        bytes: a completed job's MP4 size.
        checkpoint_step: the step of its checkpoint on disk, if any.
        tenant: the tenant it belongs to, where tenants are set.
        owner: the server that runs it, in a shared store (``None``: one server's).
        lease: until when (Unix seconds) its owner holds it, in a shared store.
        step: the last denoise step it is known to have done (its progress's step).
        resumes: the times it was run again after a restart or a takeover (L77).
        resumed_from: the step its last resume started from (its checkpoint's).
        steps_lost: the steps done before restarts and done again since, in all.
    """

    id: str
    seq: int
    model: str
    spec: Mapping[str, Any]
    status: str
    started: bool = False
    progress: int = 0
    created_at: int = 0
    completed_at: int | None = None
    expires_at: float | None = None
    error: Mapping[str, str] | None = None
    bytes: int = 0
    checkpoint_step: int | None = None
    tenant: str | None = None
    owner: str | None = None
    lease: float | None = None
    step: int = 0
    resumes: int = 0
    resumed_from: int | None = None
    steps_lost: int = 0

    @property
    def is_live(self) -> bool:
        """Whether it is still to run (queued or in progress)."""
        return self.status in LIVE


def rows_query(
    select: str, mark: str, *, limit: int, after: int | None, descending: bool, tenant: str | None
) -> tuple[str, tuple[object, ...]]:
    """The SQL stores' ``rows`` query and its parameters, ``mark`` their placeholder
    (``?`` or ``%s``): up to ``limit`` rows by ``seq`` after ``after``, of ``tenant``."""
    where: list[str] = []
    args: list[object] = []
    if after is not None:
        where.append(f"seq {'<' if descending else '>'} {mark}")
        args.append(after)
    if tenant is not None:
        where.append(f"tenant = {mark}")
        args.append(tenant)
    sql = select + (" WHERE " + " AND ".join(where) if where else "")
    sql += f" ORDER BY seq {'DESC' if descending else 'ASC'} LIMIT {mark}"
    return sql, (*args, limit)


class StoreOpenError(OSError):
    """The store cannot be opened: its folder, its database or its lock; the message
    says which, in one line."""


class StoreBusyError(StoreOpenError):
    """The folder is another server's: held by one that does not share it, or shared while
    this one would hold it alone."""


@runtime_checkable
class JobStore(Protocol):
    """The jobs' records and files, as one server's lifecycle uses them; every method blocks."""

    @property
    def owner(self) -> str | None:
        """This server's id in a shared store (L79); ``None``: the store is its alone."""
        ...

    @property
    def failures(self) -> tuple[type[Exception], ...]:
        """What a write that the store could not make raises (a full disk, a failing
        database): it fails that job alone (L77), never the server."""
        ...

    def open(self) -> list[JobRow]:
        """Open (or make) the store, tidy what a crash left, and return every job by ``seq``.

        Without an ``owner`` every unfinished job becomes this store's (no owner, no
        lease). A failed open holds nothing.

        Raises:
            StoreOpenError: the store cannot be had (``StoreBusyError``: another server
                holds it); the message names it and the cause, in one line.
        """
        ...

    def close(self) -> None:
        """Close the store and let go of it (idempotent)."""
        ...

    def insert(self, row: JobRow) -> None:
        """Write a new job's row, this store's own (durable when this returns)."""
        ...

    def progressed(self, job_id: str, progress: int, step: int = 0) -> bool:
        """The job runs, at ``progress`` percent, its denoise ``step`` done (neither ever
        lower than it was); return whether it is still this store's and live."""
        ...

    def resumed(self, job_id: str, from_step: int, lost: int) -> None:
        """The job runs again after a restart or a takeover (L77), from ``from_step``, with
        ``lost`` steps it had done to do again (if it is this store's)."""
        ...

    def completed(self, job_id: str, mp4: bytes, *, completed_at: int, expires_at: float) -> bool:
        """Keep the job's MP4 (whole, or not at all), then mark it completed and drop its
        checkpoint; return whether it was still this store's and live."""
        ...

    def failed(
        self, job_id: str, error: ErrorBody, *, progress: int, completed_at: int, expires_at: float
    ) -> bool:
        """Mark the job failed with ``error`` at ``progress`` (never lower) and drop its
        checkpoint; return whether it was still this store's and live."""
        ...

    def delete(self, job_id: str) -> bool:
        """Forget the job, its row first (durable), then its files; return whether it was
        there."""
        ...

    def row(self, job_id: str) -> JobRow | None:
        """The job's row as the store has it now, or ``None``."""
        ...

    def video(self, job_id: str) -> bytes | None:
        """A completed job's MP4, or ``None`` if it is gone."""
        ...

    def checkpoint(self, job_id: str) -> bytes | None:
        """The job's last checkpoint, or ``None``: none, or one that cannot be read
        (logged, and refused as a corrupt one is: the job runs from step 0)."""
        ...

    def write_checkpoint(self, checkpoint: Checkpoint) -> None:
        """Keep ``checkpoint`` as its job's last, and its progress, if the job is still
        this store's and live."""
        ...

    def hold(self, point: str) -> None:
        """The test hook at ``point`` (``encode``: a job's output is there, before its
        MP4 is encoded): a store may stop this thread for good there (``_files``)."""
        ...


@runtime_checkable
class SharedJobStore(JobStore, Protocol):
    """A store several servers share (L79): ids, leases and takeovers, every server's jobs."""

    def next_seq(self) -> int:
        """A sequence number no job of the store had or will get from another server."""
        ...

    def rows(
        self, *, limit: int, after: int | None, descending: bool, tenant: str | None
    ) -> list[JobRow]:
        """Up to ``limit`` rows by ``seq`` (after the cursor ``after``), of ``tenant`` if named."""
        ...

    def totals(self) -> tuple[int, int]:
        """The jobs the store holds, of any status, and their MP4 bytes."""
        ...

    def renew(self, until: float) -> set[str]:
        """Hold this store's live jobs until ``until``; return the ids of every job of this
        store, live or finished (one not among them was deleted, or taken over)."""
        ...

    def claim(self, now: float, until: float) -> JobRow | None:
        """Take over the first live job (by ``seq``) whose lease lapsed before ``now``: it is
        this store's until ``until``. Atomic: two servers never take the same."""
        ...

    def release(self, job_id: str) -> None:
        """Let another server take the job now (its lease lapses), if it is this store's."""
        ...

    def expired(self, now: float) -> list[str]:
        """Delete the finished jobs whose time-to-live ended before ``now`` (Unix seconds),
        whoever finished them; return their ids."""
        ...
