"""A job store in memory (``MemoryJobStore``): the SQLite store's semantics, for tests.

``MemoryTables`` is what the stores made on it share, as the SQLite stores of one
folder share its database and files: the rows, the MP4s, the checkpoints, the next
sequence number, and who holds it (one server alone, or several sharing it: L79).
``MemoryTables().store`` is a ``VideoConfig.store`` factory; each call makes one
server's store. Its semantics are ``SqliteJobStore``'s, checked by the same
conformance tests (tests/serve/test_job_stores.py): owner fencing, leases and
takeovers, ids from ``next_seq``; nothing outlives the process.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from typing import Any

from ..._checkpoint import Checkpoint
from ._store import ErrorBody, JobRow, StoreBusyError

__all__ = ["MemoryJobStore", "MemoryTables"]


class MemoryTables:
    """What the memory stores made on it share: rows, files, sequence, holders."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.rows: dict[str, JobRow] = {}
        self.videos: dict[str, bytes] = {}
        self.checkpoints: dict[str, bytes] = {}
        self.seq = 0  # the last sequence number ``next_seq`` gave
        self.alone = False  # held by one server that does not share it
        self.sharing = 0  # the stores open on it that share it

    def store(self, owner: str | None = None) -> MemoryJobStore:
        """A store on these tables for the server ``owner`` (``None``: its alone)."""
        return MemoryJobStore(self, owner=owner)


class MemoryJobStore:
    """The jobs' records and files in ``tables`` (a ``SharedJobStore``), for one server.

    Args:
        tables: what it shares with the other stores made on them.
        owner: this server's id, to share them (L79); ``None``: this server's alone.
    """

    #: Nothing fails in memory; a test may raise one of these from a write.
    failures: tuple[type[Exception], ...] = (OSError,)

    def __init__(self, tables: MemoryTables, *, owner: str | None = None) -> None:
        self.tables = tables
        self.owner = owner
        self._open = False

    def open(self) -> list[JobRow]:
        """Hold the tables (alone, or shared), tidy them if alone, and return every job."""
        tables = self.tables
        with tables.lock:
            if self.owner is None and (tables.alone or tables.sharing):
                raise StoreBusyError("another server keeps its video jobs in this memory store")
            if self.owner is not None and tables.alone:
                raise StoreBusyError("a server that does not share it keeps its video jobs here")
            alone = not tables.alone and not tables.sharing
            if self.owner is None:
                tables.alone = True
                for job_id, row in tables.rows.items():
                    if row.is_live:
                        tables.rows[job_id] = dataclasses.replace(row, owner=None, lease=None)
            else:
                tables.sharing += 1
            self._open = True
            if alone:
                _tidy(tables)
            return sorted(tables.rows.values(), key=lambda row: row.seq)

    def close(self) -> None:
        """Let go of the tables (idempotent)."""
        with self.tables.lock:
            if self._open:
                self._open = False
                if self.owner is None:
                    self.tables.alone = False
                else:
                    self.tables.sharing -= 1

    def _rows(self) -> dict[str, JobRow]:
        """The rows (under the tables' lock); a closed store refuses, as a closed database."""
        if not self._open:
            raise RuntimeError("the job store is closed")
        return self.tables.rows

    def _mine(self, job_id: str) -> JobRow | None:
        """The job's row if it is this store's and live (the fence of every write)."""
        row = self._rows().get(job_id)
        return row if row is not None and row.is_live and row.owner == self.owner else None

    def _set(self, row: JobRow, **changes: Any) -> None:
        self.tables.rows[row.id] = dataclasses.replace(row, **changes)

    def insert(self, row: JobRow) -> None:
        """Write a new job's row, this store's own."""
        spec = json.loads(json.dumps(row.spec))  # JSON data, as a database keeps it
        with self.tables.lock:
            rows = self._rows()
            if row.id in rows:
                raise ValueError(f"video job {row.id} is there already")
            rows[row.id] = JobRow(
                id=row.id,
                seq=row.seq,
                model=row.model,
                spec=spec,
                status=row.status,
                created_at=row.created_at,
                tenant=row.tenant,
                owner=self.owner,
                lease=row.lease,
            )

    def progressed(self, job_id: str, progress: int, step: int = 0) -> bool:
        """The job runs at ``progress`` percent, ``step`` done; whether it is still this
        store's and live."""
        with self.tables.lock:
            row = self._mine(job_id)
            if row is not None:
                progress, step = max(row.progress, progress), max(row.step, step)
                self._set(row, started=True, status="in_progress", progress=progress, step=step)
        return row is not None

    def resumed(self, job_id: str, from_step: int, lost: int) -> None:
        """The job runs again from ``from_step``, ``lost`` steps to do again (if this
        store's)."""
        with self.tables.lock:
            row = self._rows().get(job_id)
            if row is not None and row.owner == self.owner:
                self._set(
                    row,
                    resumes=row.resumes + 1,
                    resumed_from=from_step,
                    steps_lost=row.steps_lost + lost,
                    step=from_step,
                )

    def completed(self, job_id: str, mp4: bytes, *, completed_at: int, expires_at: float) -> bool:
        """Keep the MP4 and mark the job completed; whether it was this store's and live."""
        return self._end(
            job_id,
            mp4=bytes(mp4),
            status="completed",
            progress=100,
            bytes=len(mp4),
            completed_at=completed_at,
            expires_at=expires_at,
        )

    def failed(
        self, job_id: str, error: ErrorBody, *, progress: int, completed_at: int, expires_at: float
    ) -> bool:
        """Mark the job failed with ``error``; whether it was this store's and live."""
        return self._end(
            job_id,
            status="failed",
            error=dict(error),
            progress=progress,
            completed_at=completed_at,
            expires_at=expires_at,
        )

    def _end(self, job_id: str, *, mp4: bytes | None = None, progress: int, **fields: Any) -> bool:
        """End the job (its MP4 kept first, if any), its checkpoint dropped; whether it
        was this store's and live. ``progress`` never goes down."""
        with self.tables.lock:
            row = self._mine(job_id)
            if row is not None:
                if mp4 is not None:
                    self.tables.videos[job_id] = mp4
                progress = max(row.progress, progress)
                self._set(row, progress=progress, checkpoint_step=None, lease=None, **fields)
                self.tables.checkpoints.pop(job_id, None)
        return row is not None

    def delete(self, job_id: str) -> bool:
        """Forget the job and its files; whether it was there."""
        with self.tables.lock:
            there = self._rows().pop(job_id, None) is not None
            self.tables.videos.pop(job_id, None)
            self.tables.checkpoints.pop(job_id, None)
        return there

    def row(self, job_id: str) -> JobRow | None:
        """The job's row as the tables have it now, or ``None``."""
        with self.tables.lock:
            return self._rows().get(job_id)

    def video(self, job_id: str) -> bytes | None:
        """A completed job's MP4, or ``None`` if it is gone."""
        with self.tables.lock:
            return self.tables.videos.get(job_id)

    def checkpoint(self, job_id: str) -> bytes | None:
        """The job's last checkpoint, or ``None``."""
        with self.tables.lock:
            return self.tables.checkpoints.get(job_id)

    def write_checkpoint(self, checkpoint: Checkpoint) -> None:
        """Keep ``checkpoint`` as its job's last, and its progress, if the job still runs."""
        job_id = checkpoint.request_id
        progress = min(99, 100 * checkpoint.step // max(checkpoint.total, 1))
        with self.tables.lock:
            row = self._mine(job_id)
            if row is not None:
                self.tables.checkpoints[job_id] = checkpoint.data
                self._set(
                    row,
                    checkpoint_step=checkpoint.step,
                    started=True,
                    status="in_progress",
                    progress=max(row.progress, progress),
                    step=max(row.step, checkpoint.step),
                )

    def hold(self, point: str) -> None:
        """The test hook is the SQLite store's (a process stopped for good): none here."""

    # -- a shared store (L79) -----------------------------------------------------

    def next_seq(self) -> int:
        """A sequence number no job of the tables had or will get from another store."""
        with self.tables.lock:
            rows = self._rows()
            self.tables.seq = max(self.tables.seq, *(row.seq for row in rows.values()), 0) + 1
            return self.tables.seq

    def rows(
        self, *, limit: int, after: int | None, descending: bool, tenant: str | None
    ) -> list[JobRow]:
        """Up to ``limit`` rows by ``seq`` (after the cursor ``after``), of ``tenant`` if named."""
        with self.tables.lock:
            found = sorted(self._rows().values(), key=lambda row: row.seq, reverse=descending)
        if after is not None:
            found = [r for r in found if (r.seq < after if descending else r.seq > after)]
        if tenant is not None:
            found = [r for r in found if r.tenant == tenant]
        return found[:limit]

    def totals(self) -> tuple[int, int]:
        """The jobs the tables hold, of any status, and their MP4 bytes."""
        with self.tables.lock:
            rows = self._rows().values()
            return len(rows), sum(row.bytes for row in rows)

    def renew(self, until: float) -> set[str]:
        """Hold this store's live jobs until ``until``; return the ids of all its jobs."""
        with self.tables.lock:
            ours = [row for row in self._rows().values() if row.owner == self.owner]
            for row in ours:
                if row.is_live:
                    self._set(row, lease=until)
        return {row.id for row in ours}

    def claim(self, now: float, until: float) -> JobRow | None:
        """Take over the first live job (by ``seq``) whose lease lapsed before ``now``."""
        with self.tables.lock:
            lapsed = [
                row
                for row in self._rows().values()
                if row.is_live and (row.lease is None or row.lease < now)
            ]
            if not lapsed:
                return None
            row = min(lapsed, key=lambda row: row.seq)
            self._set(row, owner=self.owner, lease=until)
            return self.tables.rows[row.id]

    def release(self, job_id: str) -> None:
        """Let another server take the job now (its lease lapses), if it is this store's."""
        with self.tables.lock:
            row = self._mine(job_id)
            if row is not None:
                self._set(row, lease=0.0)

    def expired(self, now: float) -> list[str]:
        """Delete the finished jobs whose time-to-live ended before ``now``; their ids."""
        with self.tables.lock:
            gone = [
                row.id
                for row in self._rows().values()
                if not row.is_live and row.expires_at is not None and row.expires_at <= now
            ]
        for job_id in gone:
            self.delete(job_id)
        return gone


def _tidy(tables: MemoryTables) -> None:
    """Drop the files of jobs gone or not in that state (the SQLite store's tidy)."""
    rows = tables.rows
    for job_id in [i for i in tables.videos if i not in rows or rows[i].status != "completed"]:
        del tables.videos[job_id]
    for job_id in [i for i in tables.checkpoints if i not in rows or not rows[i].is_live]:
        del tables.checkpoints[job_id]
