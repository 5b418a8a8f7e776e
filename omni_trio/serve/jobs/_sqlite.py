"""The video jobs' store in SQLite and files under one folder (L77, L79): ``SqliteJobStore``.

Records are written through the standard library's ``sqlite3`` in WAL mode (one
connection per store, a lock around it), files by ``_files`` (atomically, under the
folder ``_files`` lays out); a row says ``completed`` only once its MP4 is in place,
so a crash never leaves a half-written MP4 that is served.

A shared store (L79, ``_store``'s docstring): each job row names its owner and its
lease; a takeover is one SQLite transaction (``claim``), and every write about a
running job is fenced by its owner (``WHERE owner IS ?``) in one. SQLite's own locking
decides; it needs one host's file locks: the servers sharing a folder run on one host.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..._checkpoint import Checkpoint
from ._files import (
    HOLD_VARIABLE,
    hold,
    hold_folder,
    read_checkpoint,
    remove,
    tidy,
    write_atomically,
)
from ._store import LIVE, ErrorBody, JobRow, StoreOpenError, rows_query

__all__ = ["SqliteJobStore"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY,
    seq INTEGER NOT NULL,
    model TEXT NOT NULL,
    spec TEXT NOT NULL,
    status TEXT NOT NULL,
    started INTEGER NOT NULL DEFAULT 0,
    progress INTEGER NOT NULL DEFAULT 0,
    created_at INTEGER NOT NULL,
    completed_at INTEGER,
    expires_at REAL,
    error TEXT,
    bytes INTEGER NOT NULL DEFAULT 0,
    checkpoint_step INTEGER,
    tenant TEXT,
    owner TEXT,
    lease REAL,
    step INTEGER NOT NULL DEFAULT 0,
    resumes INTEGER NOT NULL DEFAULT 0,
    resumed_from INTEGER,
    steps_lost INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS jobs_seq ON jobs (seq);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL);
"""

#: Columns added since the first release of the store, with their definitions: a
#: store an earlier version made gains them when it is opened.
_ADDED_COLUMNS = {
    "step": "INTEGER NOT NULL DEFAULT 0",
    "resumes": "INTEGER NOT NULL DEFAULT 0",
    "resumed_from": "INTEGER",
    "steps_lost": "INTEGER NOT NULL DEFAULT 0",
}


class SqliteJobStore:
    """The jobs' records and files under ``folder`` (a ``SharedJobStore``); every method
    blocks (call off the loop).

    Args:
        folder: the jobs folder; made if missing.
        owner: this server's id, to share the folder with other servers on this host
            (L79; see the module's docstring); ``None``: this server's alone.
    """

    #: A write that failed: the disk's (``OSError``) or the database's.
    failures: tuple[type[Exception], ...] = (OSError, sqlite3.Error)

    def __init__(self, folder: Path, *, owner: str | None = None) -> None:
        self.folder = folder
        self.videos = folder / "videos"
        self.checkpoints = folder / "checkpoints"
        self.owner = owner
        self._lock = threading.Lock()
        self._db: sqlite3.Connection | None = None
        self._held: int | None = None  # the folder lock's file descriptor

    # -- opening and closing ----------------------------------------------------

    def open(self) -> list[JobRow]:
        """Open (or make) the store, tidy what a crash left, and return every job by ``seq``.

        A failed open holds nothing: the database is closed and the folder's lock let go.

        Raises:
            StoreOpenError: the folder cannot be made or written, the database is not
                one (corrupt, cut short), or another server holds the folder
                (``StoreBusyError``); the message names the folder and the cause.
        """
        try:
            for folder in (self.folder, self.videos, self.checkpoints):
                folder.mkdir(parents=True, exist_ok=True)
            self._held, alone = hold_folder(self.folder, shared=self.owner is not None)
        except StoreOpenError:
            raise
        except OSError as exc:
            raise StoreOpenError(
                f"the video jobs' folder {self.folder} cannot be used:"
                f" {exc.strerror or exc} ({type(exc).__name__})"
            ) from exc
        try:
            with self._lock:
                rows = self._open_database()
            if alone:
                tidy(self.folder, rows)
        except (sqlite3.Error, OSError, ValueError) as exc:
            self.close()
            raise StoreOpenError(
                f"the video jobs' store {self.folder / 'jobs.sqlite3'} cannot be read:"
                f" {exc} ({type(exc).__name__}); move it away to start with no jobs"
            ) from exc
        return rows

    def _open_database(self) -> list[JobRow]:
        db = sqlite3.connect(
            self.folder / "jobs.sqlite3",
            timeout=30.0,
            isolation_level=None,  # autocommit; transactions where said
            check_same_thread=False,  # one connection, used under the lock
        )
        self._db = db
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=FULL")
        db.executescript(_SCHEMA)
        have = {row[1] for row in db.execute("PRAGMA table_info(jobs)")}
        for column, definition in _ADDED_COLUMNS.items():
            if column not in have:
                db.execute(f"ALTER TABLE jobs ADD COLUMN {column} {definition}")
        if self.owner is None:
            # One server's: every unfinished job is its own, whoever ran it before.
            db.execute("UPDATE jobs SET owner = NULL, lease = NULL WHERE status IN (?, ?)", LIVE)
        return [self._row(values) for values in db.execute(_SELECT + " ORDER BY seq")]

    def close(self) -> None:
        """Close the database and let go of the folder (idempotent)."""
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None
            if self._held is not None:
                os.close(self._held)  # the lock goes with it
                self._held = None

    # -- records ----------------------------------------------------------------

    def _conn(self) -> sqlite3.Connection:
        if self._db is None:
            raise RuntimeError("the job store is closed")
        return self._db

    @contextlib.contextmanager
    def _owning(self, job_id: str) -> Iterator[bool]:
        """A write transaction (SQLite's lock, across processes) in which the job is
        known to be this store's and live, or not; files written inside it are fenced:
        no other server takes the job, nor deletes it, until it ends."""
        db = self._conn()
        db.execute("BEGIN IMMEDIATE")
        try:
            found = db.execute(
                "SELECT 1 FROM jobs WHERE id = ? AND status IN (?, ?) AND owner IS ?",
                (job_id, *LIVE, self.owner),
            ).fetchone()
            yield found is not None
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")

    def insert(self, row: JobRow) -> None:
        """Write a new job's row, this store's own (durable when this returns)."""
        with self._lock:
            self._conn().execute(
                "INSERT INTO jobs (id, seq, model, spec, status, created_at, tenant, owner, lease)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    row.id,
                    row.seq,
                    row.model,
                    json.dumps(row.spec),
                    row.status,
                    row.created_at,
                    row.tenant,
                    self.owner,
                    row.lease,
                ),
            )
            hold("admitted", self.folder)

    def progressed(self, job_id: str, progress: int, step: int = 0) -> bool:
        """The job runs, at ``progress`` percent, its denoise ``step`` done (neither ever
        lower than it was).

        Returns:
            Whether it is still this store's (not deleted, not taken over).
        """
        with self._lock:
            cursor = self._conn().execute(
                "UPDATE jobs SET started = 1, status = 'in_progress', progress = MAX(progress, ?),"
                " step = MAX(step, ?) WHERE id = ? AND status IN (?, ?) AND owner IS ?",
                (progress, step, job_id, *LIVE, self.owner),
            )
            return cursor.rowcount == 1

    def resumed(self, job_id: str, from_step: int, lost: int) -> None:
        """The job runs again after a restart or a takeover (L77), from ``from_step``, with
        ``lost`` steps it had done to do again."""
        with self._lock:
            self._conn().execute(
                "UPDATE jobs SET resumes = resumes + 1, resumed_from = ?,"
                " steps_lost = steps_lost + ?, step = ? WHERE id = ? AND owner IS ?",
                (from_step, lost, from_step, job_id, self.owner),
            )

    def completed(self, job_id: str, mp4: bytes, *, completed_at: int, expires_at: float) -> bool:
        """Write the job's MP4 atomically, then mark it completed; drop its checkpoint.

        Returns:
            Whether the job was still this store's (not deleted, not taken over).
        """
        path = self.videos / f"{job_id}.mp4"
        with self._lock, self._owning(job_id) as mine:
            if mine:
                self._write(path, mp4, hold_point="write")
                self._conn().execute(
                    "UPDATE jobs SET status = 'completed', progress = 100, bytes = ?,"
                    " completed_at = ?, expires_at = ?, checkpoint_step = NULL, lease = NULL"
                    " WHERE id = ?",
                    (len(mp4), completed_at, expires_at, job_id),
                )
                remove(self.checkpoints / f"{job_id}.ckpt")
        return mine

    def failed(
        self, job_id: str, error: ErrorBody, *, progress: int, completed_at: int, expires_at: float
    ) -> bool:
        """Mark the job failed with ``error`` at ``progress``; drop its checkpoint.

        Returns:
            Whether the job was still this store's (not deleted, not taken over).
        """
        with self._lock:
            cursor = self._conn().execute(
                "UPDATE jobs SET status = 'failed', error = ?, progress = MAX(progress, ?),"
                " completed_at = ?, expires_at = ?, checkpoint_step = NULL, lease = NULL"
                " WHERE id = ? AND status IN (?, ?) AND owner IS ?",
                (
                    json.dumps(dict(error)),
                    progress,
                    completed_at,
                    expires_at,
                    job_id,
                    *LIVE,
                    self.owner,
                ),
            )
            kept = cursor.rowcount == 1
            if kept:
                remove(self.checkpoints / f"{job_id}.ckpt")
        return kept

    def delete(self, job_id: str) -> bool:
        """Forget the job: its row first (durable), then its files.

        Returns:
            Whether it was there.
        """
        with self._lock:
            cursor = self._conn().execute("DELETE FROM jobs WHERE id = ?", (job_id,))
            remove(self.videos / f"{job_id}.mp4")
            remove(self.checkpoints / f"{job_id}.ckpt")
        return cursor.rowcount == 1

    # -- a shared store (L79) -----------------------------------------------------

    def next_seq(self) -> int:
        """A sequence number no job of the store had or will get from another server."""
        with self._lock:
            db = self._conn()
            db.execute("BEGIN IMMEDIATE")
            try:
                (last,) = db.execute(
                    "SELECT MAX(COALESCE((SELECT MAX(seq) FROM jobs), 0),"
                    " COALESCE((SELECT value FROM meta WHERE key = 'seq'), 0))"
                ).fetchone()
                db.execute(
                    "INSERT INTO meta (key, value) VALUES ('seq', ?)"
                    " ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                    (last + 1,),
                )
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")
        return int(last) + 1

    def row(self, job_id: str) -> JobRow | None:
        """The job's row as the store has it now, or ``None``."""
        with self._lock:
            values = self._conn().execute(_SELECT + " WHERE id = ?", (job_id,)).fetchone()
        return None if values is None else self._row(values)

    def rows(
        self, *, limit: int, after: int | None, descending: bool, tenant: str | None
    ) -> list[JobRow]:
        """Up to ``limit`` rows by ``seq`` (after the cursor ``after``), of ``tenant`` if named."""
        sql, args = rows_query(
            _SELECT, "?", limit=limit, after=after, descending=descending, tenant=tenant
        )
        with self._lock:
            found = self._conn().execute(sql, args).fetchall()
        return [self._row(values) for values in found]

    def totals(self) -> tuple[int, int]:
        """The jobs the store holds, of any status, and their MP4 bytes."""
        with self._lock:
            count, size = (
                self._conn()
                .execute("SELECT COUNT(*), COALESCE(SUM(bytes), 0) FROM jobs")
                .fetchone()
            )
        return int(count), int(size)

    def renew(self, until: float) -> set[str]:
        """Hold this store's live jobs until ``until``; return the ids of every job of this
        store, live or finished (one not among them was deleted, or taken over)."""
        with self._lock:
            db = self._conn()
            db.execute(
                "UPDATE jobs SET lease = ? WHERE owner IS ? AND status IN (?, ?)",
                (until, self.owner, *LIVE),
            )
            found = db.execute("SELECT id FROM jobs WHERE owner IS ?", (self.owner,)).fetchall()
        return {job_id for (job_id,) in found}

    def claim(self, now: float, until: float) -> JobRow | None:
        """Take over the first live job (by ``seq``) whose lease lapsed before ``now``: it is
        this store's until ``until``. One transaction: two servers never take the same."""
        with self._lock:
            db = self._conn()
            db.execute("BEGIN IMMEDIATE")
            try:
                values = db.execute(
                    _SELECT + " WHERE status IN (?, ?) AND (lease IS NULL OR lease < ?)"
                    " ORDER BY seq LIMIT 1",
                    (*LIVE, now),
                ).fetchone()
                if values is not None:
                    db.execute(
                        "UPDATE jobs SET owner = ?, lease = ? WHERE id = ?",
                        (self.owner, until, values[0]),
                    )
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")
        if values is None:
            return None
        return dataclasses.replace(self._row(values), owner=self.owner, lease=until)

    def release(self, job_id: str) -> None:
        """Let another server take the job now (its lease lapses), if it is this store's."""
        with self._lock:
            self._conn().execute(
                "UPDATE jobs SET lease = 0 WHERE id = ? AND owner IS ? AND status IN (?, ?)",
                (job_id, self.owner, *LIVE),
            )

    def expired(self, now: float) -> list[str]:
        """Delete the finished jobs whose time-to-live ended before ``now`` (Unix seconds),
        whoever finished them; return their ids."""
        with self._lock:
            found = (
                self._conn()
                .execute(
                    "SELECT id FROM jobs WHERE status NOT IN (?, ?) AND expires_at <= ?",
                    (*LIVE, now),
                )
                .fetchall()
            )
        gone = [job_id for (job_id,) in found]
        for job_id in gone:
            self.delete(job_id)
        return gone

    # -- files ------------------------------------------------------------------

    def _write(self, path: Path, data: bytes, *, hold_point: str | None = None) -> None:
        """Write ``data`` to ``path`` atomically (the test hook at ``hold_point`` first)."""
        folder = self.folder
        before = None if hold_point is None else lambda: hold(hold_point, folder)
        write_atomically(path, data, before_rename=before)

    def video(self, job_id: str) -> bytes | None:
        """A completed job's MP4, or ``None`` if it is gone."""
        try:
            return (self.videos / f"{job_id}.mp4").read_bytes()
        except FileNotFoundError:
            return None

    def checkpoint(self, job_id: str) -> bytes | None:
        """The job's last checkpoint, or ``None`` (none, or unreadable: logged)."""
        return read_checkpoint(self.checkpoints / f"{job_id}.ckpt", job_id)

    def hold(self, point: str) -> None:
        """The test hook (``_files``): stop this thread for good at ``point`` if asked."""
        hold(point, self.folder)

    def write_checkpoint(self, checkpoint: Checkpoint) -> None:
        """Keep ``checkpoint`` as its job's last, and its progress, if the job still runs."""
        job_id = checkpoint.request_id
        path = self.checkpoints / f"{job_id}.ckpt"
        progress = min(99, 100 * checkpoint.step // max(checkpoint.total, 1))
        with self._lock:
            with self._owning(job_id) as mine:
                if mine:
                    self._write(path, checkpoint.data)
                    self._conn().execute(
                        "UPDATE jobs SET checkpoint_step = ?, started = 1, status = 'in_progress',"
                        " progress = MAX(progress, ?), step = MAX(step, ?) WHERE id = ?",
                        (checkpoint.step, progress, checkpoint.step, job_id),
                    )
            # The hook's ``checkpoint:<k>``: the first checkpoint written of step k or later
            # (a newer checkpoint replaces one not yet written).
            wanted = os.environ.get(HOLD_VARIABLE, "")
            if wanted.startswith("checkpoint:") and checkpoint.step >= int(wanted[11:] or 0):
                hold(wanted, self.folder)

    # -- reading rows -----------------------------------------------------------

    @staticmethod
    def _row(values: tuple[Any, ...]) -> JobRow:
        (job_id, seq, model, spec, status, started, progress, created, completed) = values[:9]
        expires, error, size, checkpoint_step, tenant, owner, lease = values[9:16]
        step, resumes, resumed_from, steps_lost = values[16:]
        return JobRow(
            id=job_id,
            seq=seq,
            model=model,
            spec=json.loads(spec),
            status=status,
            started=bool(started),
            progress=progress,
            created_at=created,
            completed_at=completed,
            expires_at=expires,
            error=json.loads(error) if error else None,
            bytes=size,
            checkpoint_step=checkpoint_step,
            tenant=tenant,
            owner=owner,
            lease=lease,
            step=step,
            resumes=resumes,
            resumed_from=resumed_from,
            steps_lost=steps_lost,
        )


_SELECT = (
    "SELECT id, seq, model, spec, status, started, progress, created_at, completed_at,"
    " expires_at, error, bytes, checkpoint_step, tenant, owner, lease, step, resumes,"
    " resumed_from, steps_lost FROM jobs"
)
