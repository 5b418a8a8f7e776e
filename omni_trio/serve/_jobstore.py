"""The durable store of video jobs (L77, L78): SQLite records and files under one folder.

Layout of ``--jobs-dir``::

    jobs.sqlite3 (+ -wal, -shm)   one row per job: parameters, status, error, progress
    videos/<id>.mp4               a completed job's MP4
    checkpoints/<id>.ckpt         a running job's last checkpoint (L78)

Records are written through the standard library's ``sqlite3`` in WAL mode (one
connection, a lock around it); the event loop calls ``JobStore``'s methods through
``anyio.to_thread`` (never on the loop), the checkpoint writer (``CheckpointWriter``,
an owned thread) directly. Files are written atomically: a temporary file in the
same folder, ``fsync``, ``rename``, ``fsync`` of the folder; a row says
``completed`` only once its MP4 is in place, so a crash never leaves a half-written
MP4 that is served. Opening the store removes what a crash may leave: temporary
files, and files whose job is gone (deleted, or never completed).

A test hook, never set in production: ``OMNI_TRIO_TEST_HOLD=<point>`` makes the
process stop for good at one point (``admitted``: a job's row is written, before
its submit; ``checkpoint:<k>``: a checkpoint of step k or later is written;
``encode``: a job's output is there, before its MP4 is encoded; ``write``: an MP4's
temporary file is written, before its rename), after creating ``held-<point>`` in the
folder, so that a test kills the process at a known moment.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._checkpoint import Checkpoint

__all__ = ["HOLD_VARIABLE", "CheckpointWriter", "JobRow", "JobStore", "default_jobs_dir", "hold"]

_log = logging.getLogger("omni_trio.serve")

#: The environment variable of the test hook (see the module's docstring).
HOLD_VARIABLE = "OMNI_TRIO_TEST_HOLD"

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
    lease REAL
);
CREATE INDEX IF NOT EXISTS jobs_seq ON jobs (seq);
"""


def default_jobs_dir() -> Path:
    """``$XDG_STATE_HOME/omni-trio/jobs``, else ``~/.local/state/omni-trio/jobs``."""
    state = os.environ.get("XDG_STATE_HOME")
    base = Path(state) if state else Path.home() / ".local" / "state"
    return base / "omni-trio" / "jobs"


def hold(point: str, folder: Path) -> None:
    """The test hook: stop this thread for good at ``point`` if the variable names it."""
    if os.environ.get(HOLD_VARIABLE) != point:
        return
    (folder / f"held-{point.replace(':', '-')}").touch()
    _log.warning("held at %s for a test (%s)", point, HOLD_VARIABLE)
    threading.Event().wait()


@dataclass(frozen=True, slots=True, kw_only=True)
class JobRow:
    """One job as the store keeps it.

    Args:
        id: the job's id.
        seq: its sequence number (admission order).
        model: the served model's name.
        spec: its parameters (``_video_jobs.spec_record``), as JSON data.
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


def _fsync_folder(folder: Path) -> None:
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


class JobStore:
    """The jobs' records and files under ``folder``; every method blocks (call off the loop).

    Args:
        folder: the jobs folder; made if missing.
    """

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.videos = folder / "videos"
        self.checkpoints = folder / "checkpoints"
        self._lock = threading.Lock()
        self._db: sqlite3.Connection | None = None

    # -- opening and closing ----------------------------------------------------

    def open(self) -> list[JobRow]:
        """Open (or make) the store, tidy what a crash left, and return every job by ``seq``.

        Raises:
            OSError: the folder cannot be made or written.
            sqlite3.Error: the database cannot be opened.
        """
        for folder in (self.folder, self.videos, self.checkpoints):
            folder.mkdir(parents=True, exist_ok=True)
        with self._lock:
            db = sqlite3.connect(
                self.folder / "jobs.sqlite3",
                timeout=30.0,
                isolation_level=None,  # autocommit; transactions where said
                check_same_thread=False,  # one connection, used under the lock
            )
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=FULL")
            db.executescript(_SCHEMA)
            self._db = db
            rows = [self._row(values) for values in db.execute(_SELECT + " ORDER BY seq")]
        self._tidy(rows)
        return rows

    def close(self) -> None:
        """Close the database (idempotent)."""
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None

    def _tidy(self, rows: list[JobRow]) -> None:
        """Remove temporary files, and files whose job is gone or not in that state."""
        completed = {row.id for row in rows if row.status == "completed"}
        live = {row.id for row in rows if row.status in ("queued", "in_progress")}
        for folder, keep, suffix in (
            (self.videos, completed, ".mp4"),
            (self.checkpoints, live, ".ckpt"),
        ):
            for path in folder.iterdir():
                if path.suffix != suffix or path.stem not in keep:
                    path.unlink(missing_ok=True)
        for path in self.folder.glob("held-*"):
            path.unlink(missing_ok=True)

    # -- records ----------------------------------------------------------------

    def _conn(self) -> sqlite3.Connection:
        if self._db is None:
            raise RuntimeError("the job store is closed")
        return self._db

    def insert(self, row: JobRow) -> None:
        """Write a new job's row (durable when this returns)."""
        with self._lock:
            self._conn().execute(
                "INSERT INTO jobs (id, seq, model, spec, status, created_at, tenant)"
                " VALUES (?, ?, ?, ?, ?, ?, ?)",
                (
                    row.id,
                    row.seq,
                    row.model,
                    json.dumps(row.spec),
                    row.status,
                    row.created_at,
                    row.tenant,
                ),
            )
            hold("admitted", self.folder)

    def started(self, job_id: str) -> None:
        """The job started (its first step): it reads ``in_progress`` from now on."""
        with self._lock:
            self._conn().execute(
                "UPDATE jobs SET started = 1, status = 'in_progress'"
                " WHERE id = ? AND status = 'queued'",
                (job_id,),
            )

    def completed(self, job_id: str, mp4: bytes, *, completed_at: int, expires_at: float) -> bool:
        """Write the job's MP4 atomically, then mark it completed; drop its checkpoint.

        Returns:
            Whether the job was still there (not deleted meanwhile).
        """
        path = self.videos / f"{job_id}.mp4"
        with self._lock:
            self._write(path, mp4, hold_point="write")
            cursor = self._conn().execute(
                "UPDATE jobs SET status = 'completed', progress = 100, bytes = ?,"
                " completed_at = ?, expires_at = ?, checkpoint_step = NULL WHERE id = ?",
                (len(mp4), completed_at, expires_at, job_id),
            )
            kept = cursor.rowcount == 1
            if not kept:
                path.unlink(missing_ok=True)
            (self.checkpoints / f"{job_id}.ckpt").unlink(missing_ok=True)
        return kept

    def failed(
        self,
        job_id: str,
        error: Mapping[str, str],
        *,
        progress: int,
        completed_at: int,
        expires_at: float,
    ) -> None:
        """Mark the job failed with ``error`` at ``progress``; drop its checkpoint."""
        with self._lock:
            self._conn().execute(
                "UPDATE jobs SET status = 'failed', error = ?, progress = MAX(progress, ?),"
                " completed_at = ?, expires_at = ?, checkpoint_step = NULL WHERE id = ?",
                (json.dumps(dict(error)), progress, completed_at, expires_at, job_id),
            )
            (self.checkpoints / f"{job_id}.ckpt").unlink(missing_ok=True)

    def delete(self, job_id: str) -> None:
        """Forget the job: its row first (durable), then its files."""
        with self._lock:
            self._conn().execute("DELETE FROM jobs WHERE id = ?", (job_id,))
            (self.videos / f"{job_id}.mp4").unlink(missing_ok=True)
            (self.checkpoints / f"{job_id}.ckpt").unlink(missing_ok=True)

    # -- files ------------------------------------------------------------------

    def _write(self, path: Path, data: bytes, *, hold_point: str | None = None) -> None:
        """Write ``data`` to ``path`` atomically: temp file, fsync, rename, fsync the folder."""
        descriptor, temporary = tempfile.mkstemp(
            dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"
        )
        try:
            with os.fdopen(descriptor, "wb") as out:
                out.write(data)
                out.flush()
                os.fsync(out.fileno())
            if hold_point is not None:
                hold(hold_point, self.folder)
            os.replace(temporary, path)
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise
        _fsync_folder(path.parent)

    def video(self, job_id: str) -> bytes | None:
        """A completed job's MP4, or ``None`` if it is gone."""
        try:
            return (self.videos / f"{job_id}.mp4").read_bytes()
        except FileNotFoundError:
            return None

    def checkpoint(self, job_id: str) -> bytes | None:
        """The job's last checkpoint, or ``None``."""
        try:
            return (self.checkpoints / f"{job_id}.ckpt").read_bytes()
        except FileNotFoundError:
            return None

    def write_checkpoint(self, checkpoint: Checkpoint) -> None:
        """Keep ``checkpoint`` as its job's last, and its progress, if the job still runs."""
        job_id = checkpoint.request_id
        path = self.checkpoints / f"{job_id}.ckpt"
        progress = min(99, 100 * checkpoint.step // max(checkpoint.total, 1))
        with self._lock:
            self._write(path, checkpoint.data)
            cursor = self._conn().execute(
                "UPDATE jobs SET checkpoint_step = ?, started = 1, status = 'in_progress',"
                " progress = MAX(progress, ?) WHERE id = ? AND status IN ('queued', 'in_progress')",
                (checkpoint.step, progress, job_id),
            )
            if cursor.rowcount != 1:
                path.unlink(missing_ok=True)  # finished or deleted meanwhile
            # The hook's ``checkpoint:<k>``: the first checkpoint written of step k or later
            # (a newer checkpoint replaces one not yet written).
            wanted = os.environ.get(HOLD_VARIABLE, "")
            if wanted.startswith("checkpoint:") and checkpoint.step >= int(wanted[11:] or 0):
                hold(wanted, self.folder)

    # -- reading rows -----------------------------------------------------------

    @staticmethod
    def _row(values: tuple[Any, ...]) -> JobRow:
        (job_id, seq, model, spec, status, started, progress, created, completed) = values[:9]
        expires, error, size, step, tenant = values[9:]
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
            checkpoint_step=step,
            tenant=tenant,
        )


_SELECT = (
    "SELECT id, seq, model, spec, status, started, progress, created_at, completed_at,"
    " expires_at, error, bytes, checkpoint_step, tenant FROM jobs"
)


class CheckpointWriter:
    """An owned thread that writes the jobs' checkpoints, the latest of each job first.

    ``offer`` is the engine's checkpoint sink: it never blocks on the disk (a newer
    checkpoint of a job replaces one not yet written).

    Args:
        store: where the checkpoints go.
    """

    def __init__(self, store: JobStore) -> None:
        self._store = store
        self._pending: dict[str, Checkpoint] = {}
        self._changed = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(
            target=self._run, name="omni-trio-checkpoints", daemon=False
        )
        self.written = 0

    def start(self) -> None:
        """Start the thread."""
        self._thread.start()

    def offer(self, checkpoint: Checkpoint) -> None:
        """Queue ``checkpoint`` (any thread); it replaces its job's unwritten one."""
        with self._changed:
            if not self._stopped:
                self._pending[checkpoint.request_id] = checkpoint
                self._changed.notify()

    def forget(self, job_id: str) -> None:
        """Drop the job's unwritten checkpoint (it finished or was deleted)."""
        with self._changed:
            self._pending.pop(job_id, None)

    def stop(self) -> None:
        """Write what is queued, then end the thread; returns once it ended."""
        with self._changed:
            self._stopped = True
            self._changed.notify()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while True:
            with self._changed:
                while not self._pending and not self._stopped:
                    self._changed.wait()
                if not self._pending:
                    return
                job_id = next(iter(self._pending))
                checkpoint = self._pending.pop(job_id)
            started = time.perf_counter()
            try:
                self._store.write_checkpoint(checkpoint)
            except Exception:
                _log.exception(
                    "the checkpoint of %s is not written", job_id, extra={"request_id": job_id}
                )
            else:
                self.written += 1
                _log.debug(
                    "checkpoint of %s after step %d: %d bytes in %.1f ms",
                    job_id,
                    checkpoint.step,
                    len(checkpoint.data),
                    (time.perf_counter() - started) * 1e3,
                )
            del checkpoint
