"""The video jobs' store in PostgreSQL (L77, L79, L98): ``PostgresJobStore``, ``postgres_store``.

Servers that share nothing but a database keep their jobs in it: the records, and for
now the MP4s and the checkpoints too (``bytea`` rows of ``video_job_blobs``, behind
``_put_blob``, ``_get_blob``, ``_drop_blobs`` and ``_tidy_blobs``: the seam an object
store takes later), so any server resumes any job and serves any MP4. It needs the
``postgres`` extra (psycopg 3).

The semantics are ``SqliteJobStore``'s, checked by the same conformance tests
(tests/serve/test_job_stores.py): every call is one transaction; every write about a
running job is fenced by its owner (``owner IS NOT DISTINCT FROM``, the row locked
``FOR UPDATE``), and a completed job's MP4 and its row are one commit; a takeover is
one transaction that locks the first lapsed job and skips those another server holds
(``FOR UPDATE SKIP LOCKED``: two servers never take the same); the sequence numbers
come from a sequence (``video_job_seq``), never below a job's already there. Who holds
the store is a session's advisory lock on it (the SQLite store's ``flock``): one
server alone holds it exclusively, the servers that share it (``owner``) hold it
shared; it goes with the connection. The tables are made in the connection's schema
(its ``search_path``) when missing, and a table an earlier version made gains the
columns added since (``_ADDED_COLUMNS``).

Every method blocks: psycopg's synchronous API, on one connection that outlives the
database's restarts (``_pg_session.Session``: its docstring says how the calls are
serialized, why trio and asyncio alike, and how a lost connection is made again). A
write whose commit was cut runs again knowing it (``again``): a job's end, its takeover
or its record is neither lost nor doubled.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from ..._checkpoint import Checkpoint
from ._pg_session import (
    DEFAULT_CONNECT_TIMEOUT_S,
    DEFAULT_RETRY_S,
    LOCKS,
    MAKING,
    NUMBERING,
    Session,
    psycopg_missing,
)
from ._store import LIVE, ErrorBody, JobRow, rows_query

if TYPE_CHECKING:
    from ._pg_session import Db

__all__ = ["PostgresJobStore", "postgres_store"]

_log = logging.getLogger("omni_trio.serve")

#: The tables and the sequence as the first version made them, each made where it is
#: missing: the columns added since are ``_ADDED_COLUMNS`` (the SQLite store's first
#: columns and additions, the same names).
_SCHEMA = {
    "video_jobs": """
CREATE TABLE video_jobs (
    id TEXT PRIMARY KEY,
    seq BIGINT NOT NULL,
    model TEXT NOT NULL,
    spec JSON NOT NULL,
    status TEXT NOT NULL,
    started BOOLEAN NOT NULL DEFAULT FALSE,
    progress INTEGER NOT NULL DEFAULT 0,
    created_at BIGINT NOT NULL,
    completed_at BIGINT,
    expires_at DOUBLE PRECISION,
    error JSON,
    bytes BIGINT NOT NULL DEFAULT 0,
    checkpoint_step INTEGER,
    tenant TEXT,
    owner TEXT,
    lease DOUBLE PRECISION
);
CREATE INDEX video_jobs_seq ON video_jobs (seq)
""",
    "video_job_blobs": """
CREATE TABLE video_job_blobs (
    job_id TEXT NOT NULL REFERENCES video_jobs (id) ON DELETE CASCADE,
    kind TEXT NOT NULL,
    data BYTEA NOT NULL,
    PRIMARY KEY (job_id, kind)
)
""",
    "video_job_seq": "CREATE SEQUENCE video_job_seq",
}

#: Columns added since the first version of the tables, with their definitions: the
#: tables an earlier version made gain them when the store opens.
_ADDED_COLUMNS = {
    "step": "INTEGER NOT NULL DEFAULT 0",
    "resumes": "INTEGER NOT NULL DEFAULT 0",
    "resumed_from": "INTEGER",
    "steps_lost": "INTEGER NOT NULL DEFAULT 0",
}

_IS_LIVE = "status IN (" + ", ".join(f"'{status}'" for status in LIVE) + ")"
_SELECT = "SELECT " + ", ".join(f.name for f in dataclasses.fields(JobRow)) + " FROM video_jobs"
#: A fenced write's test: the job is live and this store's (the owner is the last argument).
_MINE = f"id = %s AND {_IS_LIVE} AND owner IS NOT DISTINCT FROM %s"

#: What ``video_job_blobs`` keeps of a job: its MP4 (once completed), its last checkpoint.
VIDEO, CHECKPOINT = "video", "checkpoint"


class PostgresJobStore:
    """The jobs' records and files in the PostgreSQL database ``dsn`` names (a
    ``SharedJobStore``); every method blocks (call off the loop).

    It uses psycopg's synchronous API: the lifecycle calls the store from worker
    threads (``anyio.to_thread``, with a limiter of 1) and the checkpoint writer from its
    own thread, a lock serializes them on one connection, and nothing touches an event
    loop, so it works on trio and asyncio alike.

    Args:
        dsn: a libpq connection string (``postgresql://user@host:5432/db``, or
            ``host=... dbname=...``); the tables are made in its schema.
        owner: this server's id, to share the database with the other servers that do
            (L79, L98); ``None``: this server's alone (a second server is refused).
        retry_s: seconds a call tries to connect again after losing its connection,
            before it raises ``StoreLostError``.
        connect_timeout_s: seconds one try to connect may take.

    Raises:
        ImportError: psycopg is not installed (the ``postgres`` extra).
    """

    def __init__(
        self,
        dsn: str,
        *,
        owner: str | None = None,
        retry_s: float = DEFAULT_RETRY_S,
        connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
    ) -> None:
        missing = psycopg_missing()
        if missing is not None:
            raise missing
        import psycopg

        self.owner = owner
        #: A write that failed: the database's (psycopg's errors, ``StoreLostError``).
        self.failures: tuple[type[Exception], ...] = (OSError, psycopg.Error)
        self.session = Session(
            dsn, shared=owner is not None, retry_s=retry_s, connect_timeout_s=connect_timeout_s
        )
        #: ``host:port/dbname``, for messages (never the password).
        self.where = self.session.where
        self._call = self.session.call

    def __repr__(self) -> str:
        return f"PostgresJobStore({self.where}, owner={self.owner!r})"

    def open(self) -> list[JobRow]:
        """Connect, hold the store (alone, or shared), make its tables if missing, tidy
        what a crash left if no other server holds it, and return every job by ``seq``.

        Raises:
            StoreOpenError: the database cannot be reached or used, or another server
                holds it (``StoreBusyError``): one line naming ``host:port/dbname``.
        """
        return self.session.open(self._open_database)

    def _open_database(self, db: Db, alone: bool) -> list[JobRow]:
        db.execute("SELECT pg_advisory_xact_lock(%s, %s)", (LOCKS + MAKING, self.session.space))
        for name, definition in _SCHEMA.items():
            made = db.execute(
                "SELECT to_regclass(quote_ident(current_schema()) || '.' || %s)"
                " IS NOT NULL AS made",
                (name,),
            ).fetchone()
            if made is None or not made["made"]:
                for statement in definition.split(";"):
                    db.execute(statement)
        columns = db.execute(
            "SELECT column_name FROM information_schema.columns"
            " WHERE table_schema = current_schema() AND table_name = 'video_jobs'"
        ).fetchall()
        found = {column["column_name"] for column in columns}
        for column, definition in _ADDED_COLUMNS.items():
            if column not in found:
                db.execute(f"ALTER TABLE video_jobs ADD COLUMN {column} {definition}")
        if self.owner is None:
            # One server's: every unfinished job is its own, whoever ran it before.
            db.execute(f"UPDATE video_jobs SET owner = NULL, lease = NULL WHERE {_IS_LIVE}")
        if alone:
            self._tidy_blobs(db)
        return [JobRow(**values) for values in db.execute(_SELECT + " ORDER BY seq")]

    def close(self) -> None:
        """Close the connection, which lets go of the store (idempotent)."""
        self.session.close()

    # -- records ----------------------------------------------------------------

    @staticmethod
    def _mine(db: Db, job_id: str, owner: str | None) -> bool:
        """Whether the job is live and ``owner``'s, its row locked for this transaction:
        the fence of every write about a running job."""
        found = db.execute(f"SELECT 1 FROM video_jobs WHERE {_MINE} FOR UPDATE", (job_id, owner))
        return found.fetchone() is not None

    def _ended(self, db: Db, job_id: str, status: str, completed_at: int) -> bool:
        """Whether the job ended as a cut commit of this store's would have left it."""
        found = db.execute(
            "SELECT 1 FROM video_jobs WHERE id = %s AND owner IS NOT DISTINCT FROM %s"
            " AND status = %s AND completed_at = %s",
            (job_id, self.owner, status, completed_at),
        )
        return found.fetchone() is not None

    def insert(self, row: JobRow) -> None:
        """Write a new job's row, this store's own (durable when this returns)."""
        from psycopg.types.json import Json

        def work(db: Db, again: bool) -> None:
            db.execute(
                "INSERT INTO video_jobs (id, seq, model, spec, status, created_at, tenant,"
                " owner, lease) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s)"
                + (" ON CONFLICT (id) DO NOTHING" if again else ""),
                (
                    row.id,
                    row.seq,
                    row.model,
                    Json(row.spec),
                    row.status,
                    row.created_at,
                    row.tenant,
                    self.owner,
                    row.lease,
                ),
            )

        self._call(work)

    def progressed(self, job_id: str, progress: int, step: int = 0) -> bool:
        """The job runs, at ``progress`` percent, its denoise ``step`` done (neither ever
        lower than it was); return whether it is still this store's and live."""

        def work(db: Db, again: bool) -> bool:
            return (
                db.execute(
                    "UPDATE video_jobs SET started = TRUE, status = 'in_progress',"
                    " progress = GREATEST(progress, %s), step = GREATEST(step, %s)"
                    f" WHERE {_MINE}",
                    (progress, step, job_id, self.owner),
                ).rowcount
                == 1
            )

        return self._call(work)

    def resumed(self, job_id: str, from_step: int, lost: int) -> None:
        """The job runs again after a restart or a takeover (L77), from ``from_step``, with
        ``lost`` steps it had done to do again (if it is this store's)."""
        self._call(
            lambda db, again: db.execute(
                "UPDATE video_jobs SET resumes = resumes + 1, resumed_from = %s,"
                " steps_lost = steps_lost + %s, step = %s"
                " WHERE id = %s AND owner IS NOT DISTINCT FROM %s",
                (from_step, lost, from_step, job_id, self.owner),
            )
        )

    def completed(self, job_id: str, mp4: bytes, *, completed_at: int, expires_at: float) -> bool:
        """Keep the MP4 and mark the job completed, in one commit; drop its checkpoint.

        Returns:
            Whether the job was still this store's and live.
        """

        def work(db: Db, again: bool) -> bool:
            if not self._mine(db, job_id, self.owner):
                return again and self._ended(db, job_id, "completed", completed_at)
            self._put_blob(db, job_id, VIDEO, mp4)
            db.execute(
                "UPDATE video_jobs SET status = 'completed', progress = 100, bytes = %s,"
                " completed_at = %s, expires_at = %s, checkpoint_step = NULL, lease = NULL"
                " WHERE id = %s",
                (len(mp4), completed_at, expires_at, job_id),
            )
            self._drop_blobs(db, [job_id], (CHECKPOINT,))
            return True

        return self._call(work)

    def failed(
        self, job_id: str, error: ErrorBody, *, progress: int, completed_at: int, expires_at: float
    ) -> bool:
        """Mark the job failed with ``error`` at ``progress`` (never lower); drop its
        checkpoint.

        Returns:
            Whether the job was still this store's and live.
        """
        from psycopg.types.json import Json

        def work(db: Db, again: bool) -> bool:
            kept = (
                db.execute(
                    "UPDATE video_jobs SET status = 'failed', error = %s,"
                    " progress = GREATEST(progress, %s), completed_at = %s, expires_at = %s,"
                    f" checkpoint_step = NULL, lease = NULL WHERE {_MINE}",
                    (Json(dict(error)), progress, completed_at, expires_at, job_id, self.owner),
                ).rowcount
                == 1
            )
            if kept:
                self._drop_blobs(db, [job_id], (CHECKPOINT,))
                return True
            return again and self._ended(db, job_id, "failed", completed_at)

        return self._call(work)

    def delete(self, job_id: str) -> bool:
        """Forget the job: its row, then its MP4 and checkpoint; return whether it was there."""

        def work(db: Db, again: bool) -> bool:
            there = db.execute("DELETE FROM video_jobs WHERE id = %s", (job_id,)).rowcount == 1
            self._drop_blobs(db, [job_id])
            return there

        return self._call(work)

    def row(self, job_id: str) -> JobRow | None:
        """The job's row as the store has it now, or ``None``."""
        found = self._call(
            lambda db, again: db.execute(_SELECT + " WHERE id = %s", (job_id,)).fetchone()
        )
        return None if found is None else JobRow(**found)

    def video(self, job_id: str) -> bytes | None:
        """A completed job's MP4, or ``None`` if it is gone."""
        return self._get_blob(job_id, VIDEO)

    def checkpoint(self, job_id: str) -> bytes | None:
        """The job's last checkpoint, or ``None``: none, or one that cannot be read
        (logged: the job runs from step 0)."""
        try:
            return self._get_blob(job_id, CHECKPOINT)
        except self.failures as exc:
            _log.warning(
                "video job %s: its checkpoint cannot be read from %s (%s): it runs from step 0",
                job_id,
                self.where,
                self.session.line(exc),
                extra={"request_id": job_id},
            )
            return None

    def write_checkpoint(self, checkpoint: Checkpoint) -> None:
        """Keep ``checkpoint`` as its job's last, and its progress, if the job is still
        this store's and live."""
        job_id = checkpoint.request_id
        progress = min(99, 100 * checkpoint.step // max(checkpoint.total, 1))

        def work(db: Db, again: bool) -> None:
            if self._mine(db, job_id, self.owner):
                self._put_blob(db, job_id, CHECKPOINT, checkpoint.data)
                db.execute(
                    "UPDATE video_jobs SET checkpoint_step = %s, started = TRUE,"
                    " status = 'in_progress', progress = GREATEST(progress, %s),"
                    " step = GREATEST(step, %s) WHERE id = %s",
                    (checkpoint.step, progress, checkpoint.step, job_id),
                )

        self._call(work)

    def hold(self, point: str) -> None:
        """The test hook is the SQLite store's (a process stopped for good): none here."""

    # -- a shared store (L79) -----------------------------------------------------

    def next_seq(self) -> int:
        """A sequence number no job of the store had or will get from another server:
        the sequence's next, above every job's already there."""

        def work(db: Db, again: bool) -> int:
            db.execute(
                "SELECT pg_advisory_xact_lock(%s, %s)", (LOCKS + NUMBERING, self.session.space)
            )
            found = db.execute(
                "SELECT setval('video_job_seq', GREATEST(nextval('video_job_seq'),"
                " (SELECT COALESCE(MAX(seq), 0) + 1 FROM video_jobs))) AS seq"
            ).fetchone()
            assert found is not None
            return int(found["seq"])

        return self._call(work)

    def rows(
        self, *, limit: int, after: int | None, descending: bool, tenant: str | None
    ) -> list[JobRow]:
        """Up to ``limit`` rows by ``seq`` (after the cursor ``after``), of ``tenant`` if named."""
        sql, args = rows_query(
            _SELECT, "%s", limit=limit, after=after, descending=descending, tenant=tenant
        )
        found = self._call(lambda db, again: db.execute(sql, args).fetchall())
        return [JobRow(**values) for values in found]

    def totals(self) -> tuple[int, int]:
        """The jobs the store holds, of any status, and their MP4 bytes."""
        found = self._call(
            lambda db, again: db.execute(
                "SELECT COUNT(*) AS count, COALESCE(SUM(bytes), 0) AS size FROM video_jobs"
            ).fetchone()
        )
        assert found is not None
        return int(found["count"]), int(found["size"])

    def renew(self, until: float) -> set[str]:
        """Hold this store's live jobs until ``until``; return the ids of every job of this
        store, live or finished (one not among them was deleted, or taken over)."""

        def work(db: Db, again: bool) -> list[dict[str, Any]]:
            db.execute(
                "UPDATE video_jobs SET lease = %s WHERE owner IS NOT DISTINCT FROM %s"
                f" AND {_IS_LIVE}",
                (until, self.owner),
            )
            return db.execute(
                "SELECT id FROM video_jobs WHERE owner IS NOT DISTINCT FROM %s", (self.owner,)
            ).fetchall()

        return {values["id"] for values in self._call(work)}

    def claim(self, now: float, until: float) -> JobRow | None:
        """Take over the first live job (by ``seq``) whose lease lapsed before ``now``: it is
        this store's until ``until``. One transaction, the row locked and those another
        server holds skipped: two servers never take the same."""

        def work(db: Db, again: bool) -> dict[str, Any] | None:
            if again:  # the cut commit may have taken one: this store's until ``until``
                found = db.execute(
                    _SELECT + f" WHERE {_IS_LIVE} AND owner IS NOT DISTINCT FROM %s"
                    " AND lease = %s ORDER BY seq LIMIT 1",
                    (self.owner, until),
                ).fetchone()
                if found is not None:
                    return found
            found = db.execute(
                _SELECT + f" WHERE {_IS_LIVE} AND (lease IS NULL OR lease < %s)"
                " ORDER BY seq LIMIT 1 FOR UPDATE SKIP LOCKED",
                (now,),
            ).fetchone()
            if found is not None:
                db.execute(
                    "UPDATE video_jobs SET owner = %s, lease = %s WHERE id = %s",
                    (self.owner, until, found["id"]),
                )
            return found

        found = self._call(work)
        if found is None:
            return None
        return dataclasses.replace(JobRow(**found), owner=self.owner, lease=until)

    def release(self, job_id: str) -> None:
        """Let another server take the job now (its lease lapses), if it is this store's."""
        self._call(
            lambda db, again: db.execute(
                f"UPDATE video_jobs SET lease = 0 WHERE {_MINE}", (job_id, self.owner)
            )
        )

    def expired(self, now: float) -> list[str]:
        """Delete the finished jobs whose time-to-live ended before ``now`` (Unix seconds),
        whoever finished them, with their MP4s; return their ids, by ``seq``."""

        def work(db: Db, again: bool) -> list[str]:
            gone = db.execute(
                f"DELETE FROM video_jobs WHERE NOT {_IS_LIVE} AND expires_at <= %s"
                " RETURNING id, seq",
                (now,),
            ).fetchall()
            ids = [values["id"] for values in sorted(gone, key=lambda values: values["seq"])]
            self._drop_blobs(db, ids)
            return ids

        return self._call(work)

    # -- the blobs: MP4s and checkpoints (the seam an object store takes) --------

    def _put_blob(self, db: Db, job_id: str, kind: str, data: bytes) -> None:
        """Keep ``data`` as the job's ``kind`` (in ``db``'s transaction: with its row)."""
        db.execute(
            "INSERT INTO video_job_blobs (job_id, kind, data) VALUES (%s, %s, %b)"
            " ON CONFLICT (job_id, kind) DO UPDATE SET data = EXCLUDED.data",
            (job_id, kind, data),
        )

    def _get_blob(self, job_id: str, kind: str) -> bytes | None:
        """The job's ``kind``, or ``None``."""
        found = self._call(
            lambda db, again: db.execute(
                "SELECT data FROM video_job_blobs WHERE job_id = %s AND kind = %s",
                (job_id, kind),
                binary=True,
            ).fetchone()
        )
        return None if found is None else bytes(found["data"])

    def _drop_blobs(
        self, db: Db, job_ids: Sequence[str], kinds: Iterable[str] = (VIDEO, CHECKPOINT)
    ) -> None:
        """Drop the jobs' ``kinds`` (a deleted job's went with its row already)."""
        if job_ids:
            db.execute(
                "DELETE FROM video_job_blobs WHERE job_id = ANY(%s) AND kind = ANY(%s)",
                (list(job_ids), list(kinds)),
            )

    def _tidy_blobs(self, db: Db) -> None:
        """Drop the MP4s of jobs not completed and the checkpoints of jobs not live (the
        SQLite store's tidy at open)."""
        db.execute(
            "DELETE FROM video_job_blobs AS b WHERE NOT EXISTS (SELECT 1 FROM video_jobs AS j"
            " WHERE j.id = b.job_id AND CASE b.kind WHEN %s THEN j.status = 'completed'"
            f" ELSE j.{_IS_LIVE} END)",
            (VIDEO,),
        )


def postgres_store(
    dsn: str,
    *,
    retry_s: float = DEFAULT_RETRY_S,
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
) -> Callable[[str | None], PostgresJobStore]:
    """A ``VideoConfig.store`` factory: each server's ``PostgresJobStore`` on ``dsn``.

    ``VideoConfig(store=postgres_store("postgresql://jobs@db:5432/jobs"))`` keeps the
    video jobs in that database, one server's alone; with ``lease_s`` too, every server
    given the same ``dsn`` shares them (L79, L98).

    Raises:
        ImportError: psycopg is not installed (the ``postgres`` extra).
        ValueError: ``retry_s`` or ``connect_timeout_s`` is out of range.
    """
    missing = psycopg_missing()
    if missing is not None:
        raise missing
    for name, value in (("retry_s", retry_s), ("connect_timeout_s", connect_timeout_s)):
        if (
            not isinstance(value, int | float)
            or isinstance(value, bool)
            or not math.isfinite(value)
            or value < 0
        ):
            raise ValueError(f"{name}: must be a finite number >= 0, got {value!r}")

    def make(owner: str | None) -> PostgresJobStore:
        return PostgresJobStore(
            dsn, owner=owner, retry_s=retry_s, connect_timeout_s=connect_timeout_s
        )

    return make
