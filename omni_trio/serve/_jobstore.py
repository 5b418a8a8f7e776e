"""The durable store of video jobs (L77, L78): SQLite records and files under one folder.

Layout of ``--jobs-dir``::

    jobs.sqlite3 (+ -wal, -shm)   one row per job: parameters, status, error, progress
    videos/<id>.mp4               a completed job's MP4
    checkpoints/<id>.ckpt         a running job's last checkpoint (L78)

Records are written through the standard library's ``sqlite3`` in WAL mode (one
connection per store, a lock around it); the event loop calls ``JobStore``'s methods through
``anyio.to_thread`` (never on the loop), the checkpoint writer (``CheckpointWriter``,
an owned thread) directly. Files are written atomically: a temporary file in the
same folder, ``fsync``, ``rename``, ``fsync`` of the folder; a row says
``completed`` only once its MP4 is in place, so a crash never leaves a half-written
MP4 that is served. Opening the store removes what a crash may leave: temporary
files, and files whose job is gone (deleted, or never completed).

One server, or several on one host (L79). A store opened without an ``owner`` is
one server's: it holds the folder's lock (``lock``, ``flock``) exclusively, so a
second server on the folder is refused, and it takes every unfinished job. A store
opened with an ``owner`` (a server's id) shares the folder with the other servers
that do: each job row names its owner and a lease (Unix seconds) that the owner
renews; a server takes over a job whose lease lapsed (its owner died or stalled) in
one SQLite transaction (``claim``), and every write about a running job is fenced
by its owner (``WHERE owner IS ?``), so a server that lost a job's lease changes
nothing of it. SQLite's own locking decides; it needs one host's file locks, which a
network file system does not give: the servers sharing a folder run on one host.

A test hook, never set in production: ``OMNI_TRIO_TEST_HOLD=<point>`` makes the
process stop for good at one point (``admitted``: a job's row is written, before
its submit; ``checkpoint:<k>``: a checkpoint of step k or later is written;
``encode``: a job's output is there, before its MP4 is encoded; ``write``: an MP4's
temporary file is written, before its rename), after creating ``held-<point>`` in the
folder, so that a test kills the process at a known moment.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import logging
import os
import sqlite3
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._checkpoint import Checkpoint

__all__ = [
    "HOLD_VARIABLE",
    "CheckpointWriter",
    "JobRow",
    "JobStore",
    "StoreBusyError",
    "StoreOpenError",
    "default_jobs_dir",
    "hold",
]

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
        return self.status in _LIVE


_LIVE = ("queued", "in_progress")


class StoreOpenError(OSError):
    """The store cannot be opened: its folder, its database or its lock; the message
    says which, in one line."""


class StoreBusyError(StoreOpenError):
    """The folder is another server's: held by one that does not share it, or shared while
    this one would hold it alone."""


def _remove(path: Path) -> None:
    """Remove a file the store does not need; what cannot be removed is logged and left."""
    try:
        path.unlink(missing_ok=True)
    except OSError as exc:
        _log.warning("the video jobs' store leaves %s: %s", path, exc.strerror or exc)


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
        owner: this server's id, to share the folder with other servers on this host
            (L79; see the module's docstring); ``None``: this server's alone.
    """

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
            alone = self._hold_folder()
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
                self._tidy(rows)
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
            db.execute("UPDATE jobs SET owner = NULL, lease = NULL WHERE status IN (?, ?)", _LIVE)
        return [self._row(values) for values in db.execute(_SELECT + " ORDER BY seq")]

    def _hold_folder(self) -> bool:
        """Take the folder's lock; return whether no other server has the folder open.

        Raises:
            StoreBusyError: another server holds it in the other way.
        """
        descriptor = os.open(self.folder / "lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
                alone = True
            except BlockingIOError:
                if self.owner is None:
                    raise StoreBusyError(
                        f"another server keeps its video jobs in {self.folder}: give each"
                        " server its own --jobs-dir, or share the folder with --jobs-lease"
                        " SECONDS on every server (on one host)"
                    ) from None
                alone = False
            if self.owner is not None:
                try:
                    fcntl.flock(descriptor, fcntl.LOCK_SH | fcntl.LOCK_NB)
                except BlockingIOError:
                    raise StoreBusyError(
                        f"a server that does not share it keeps its video jobs in"
                        f" {self.folder}: give this server another --jobs-dir, or start"
                        " both with --jobs-lease SECONDS"
                    ) from None
        except BaseException:
            os.close(descriptor)
            raise
        self._held = descriptor
        return alone

    def close(self) -> None:
        """Close the database and let go of the folder (idempotent)."""
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None
            if self._held is not None:
                os.close(self._held)  # the lock goes with it
                self._held = None

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
                    _remove(path)
        for path in self.folder.glob("held-*"):
            _remove(path)

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
                (job_id, *_LIVE, self.owner),
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
                (progress, step, job_id, *_LIVE, self.owner),
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
                _remove(self.checkpoints / f"{job_id}.ckpt")
        return mine

    def failed(
        self,
        job_id: str,
        error: Mapping[str, str],
        *,
        progress: int,
        completed_at: int,
        expires_at: float,
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
                    *_LIVE,
                    self.owner,
                ),
            )
            kept = cursor.rowcount == 1
            if kept:
                _remove(self.checkpoints / f"{job_id}.ckpt")
        return kept

    def delete(self, job_id: str) -> bool:
        """Forget the job: its row first (durable), then its files.

        Returns:
            Whether it was there.
        """
        with self._lock:
            cursor = self._conn().execute("DELETE FROM jobs WHERE id = ?", (job_id,))
            _remove(self.videos / f"{job_id}.mp4")
            _remove(self.checkpoints / f"{job_id}.ckpt")
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
        where: list[str] = []
        args: list[object] = []
        if after is not None:
            where.append("seq < ?" if descending else "seq > ?")
            args.append(after)
        if tenant is not None:
            where.append("tenant = ?")
            args.append(tenant)
        sql = _SELECT + (" WHERE " + " AND ".join(where) if where else "")
        sql += f" ORDER BY seq {'DESC' if descending else 'ASC'} LIMIT ?"
        with self._lock:
            found = self._conn().execute(sql, (*args, limit)).fetchall()
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
                (until, self.owner, *_LIVE),
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
                    (*_LIVE, now),
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
                (job_id, self.owner, *_LIVE),
            )

    def expired(self, now: float) -> list[str]:
        """Delete the finished jobs whose time-to-live ended before ``now`` (Unix seconds),
        whoever finished them; return their ids."""
        with self._lock:
            found = (
                self._conn()
                .execute(
                    "SELECT id FROM jobs WHERE status NOT IN (?, ?) AND expires_at <= ?",
                    (*_LIVE, now),
                )
                .fetchall()
            )
        gone = [job_id for (job_id,) in found]
        for job_id in gone:
            self.delete(job_id)
        return gone

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
        """The job's last checkpoint, or ``None``: none, or one that cannot be read (a
        directory, no permission), which is logged and refused as a corrupt one is
        (the job runs from step 0)."""
        path = self.checkpoints / f"{job_id}.ckpt"
        try:
            return path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            _log.warning(
                "video job %s: its checkpoint %s cannot be read (%s): it runs from step 0",
                job_id,
                path,
                exc.strerror or type(exc).__name__,
                extra={"request_id": job_id},
            )
            return None

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
