"""The PostgreSQL store's session (L98): one connection that outlives the database's restarts.

``Session`` is the connection of one ``_postgres.PostgresJobStore``: made at open, where
it takes the store's advisory lock (who holds the store: one server alone, exclusively,
or the servers that share it, shared; the SQLite store's ``flock``), and made again,
the lock taken again, when it is lost. Each call is one transaction (``Session.call``).

psycopg's synchronous API: every call blocks. The lifecycle makes its calls from worker
threads (``anyio.to_thread``, one at a time), the checkpoint writer from its own: a lock
serializes them on the one connection, and nothing here touches an event loop, so the
store serves trio and asyncio alike.

A lost connection (a database restart, a network cut) is not a job's failure: the call
connects again and runs again, trying for ``retry_s`` seconds, then raises
``StoreLostError`` naming the database in one line (the lifecycle then fails that job's
write alone, L77), and the next call connects again. A call whose commit was cut may
have been made: its next run is told so (``again``), to find what the first did.
"""

from __future__ import annotations

import contextlib
import getpass
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeAlias, TypeVar

from ._store import StoreBusyError, StoreOpenError

if TYPE_CHECKING:
    import psycopg

    Db: TypeAlias = psycopg.Connection[dict[str, Any]]

__all__ = [
    "DEFAULT_CONNECT_TIMEOUT_S",
    "DEFAULT_RETRY_S",
    "Session",
    "StoreLostError",
    "describe",
    "psycopg_missing",
]

_log = logging.getLogger("omni_trio.serve")

_T = TypeVar("_T")

#: Seconds a call tries to connect again after its connection was lost.
DEFAULT_RETRY_S = 30.0
#: Seconds one try to connect may take (libpq's ``connect_timeout``).
DEFAULT_CONNECT_TIMEOUT_S = 5.0

#: The advisory locks' first key (``omni``, plus an offset); the second is the schema's oid.
LOCKS = 0x6F6D6E69
#: The offsets: who holds the store, the making of its tables, its sequence numbers.
HOLD, MAKING, NUMBERING = 0, 1, 2


class StoreLostError(OSError):
    """The database could not be reached again within ``retry_s`` of losing it; the
    message names it, in one line. The next call connects again."""


def psycopg_missing() -> ImportError | None:
    """The error to raise where psycopg is not installed (the ``postgres`` extra)."""
    try:
        import psycopg  # noqa: F401
    except ImportError as exc:
        return ImportError(
            f"the PostgreSQL job store needs psycopg 3: pip install 'omni_trio[postgres]' ({exc})",
            name="psycopg",
        )
    return None


def describe(dsn: str) -> tuple[str, str | None]:
    """``host:port/dbname`` of a connection string (libpq's defaults where it names
    none), never its password; and the password, to keep it out of any message."""
    from psycopg.conninfo import conninfo_to_dict

    try:
        given = conninfo_to_dict(dsn)
    except Exception:
        return "(a connection string that cannot be read)", None

    def value(key: str, variable: str) -> str | None:
        found = given.get(key) or os.environ.get(variable)
        return None if found is None else str(found)

    user = value("user", "PGUSER") or getpass.getuser()
    host = value("host", "PGHOST") or value("hostaddr", "PGHOSTADDR") or "localhost"
    where = f"{host}:{value('port', 'PGPORT') or 5432}/{value('dbname', 'PGDATABASE') or user}"
    return where, value("password", "PGPASSWORD")


class Session:
    """The connection of one store to the database ``dsn`` names.

    Args:
        dsn: a libpq connection string.
        shared: the store is shared (L79): its lock is held shared, not exclusively.
        retry_s: seconds a call tries to connect again after losing its connection.
        connect_timeout_s: seconds one try to connect may take.
    """

    def __init__(self, dsn: str, *, shared: bool, retry_s: float, connect_timeout_s: float) -> None:
        self.dsn = dsn
        self.shared = shared
        self.retry_s = retry_s
        self.connect_timeout_s = connect_timeout_s
        #: ``host:port/dbname``, for messages.
        self.where, self._password = describe(dsn)
        #: The tables' schema (its oid): the advisory locks' second key.
        self.space = 0
        self._lock = threading.Lock()
        self._db: Db | None = None  # ``None`` while closed, or lost
        self._open = False
        self._lost = False  # the connection was lost: say so once it is back

    def line(self, exc: BaseException) -> str:
        """libpq's message of ``exc`` in one line, without the password."""
        text = str(exc).strip()
        text = text.splitlines()[0] if text else type(exc).__name__
        for prefix in ("connection failed: ", "connection is bad: "):
            text = text.removeprefix(prefix)
        return text.replace(self._password, "***") if self._password else text

    # -- opening and closing ----------------------------------------------------

    def open(self, setup: Callable[[Db, bool], _T]) -> _T:
        """Connect, hold the store, and run ``setup(db, alone)`` in one transaction
        (``alone``: no other server held the store); its result.

        Raises:
            StoreOpenError: the database cannot be reached or used, or another server
                holds the store (``StoreBusyError``); one line naming ``where``.
        """
        import psycopg

        with self._lock:
            try:
                db = self._connect()
            except psycopg.Error as exc:
                raise StoreOpenError(
                    f"the video jobs' database {self.where} cannot be reached: {self.line(exc)}"
                ) from exc
            try:
                found = db.execute(
                    "SELECT oid::int AS space FROM pg_namespace WHERE nspname = current_schema()"
                ).fetchone()
                if found is None:
                    raise StoreOpenError(
                        f"the video jobs' database {self.where} has no schema to keep them"
                        " in (its search_path names none that exists)"
                    )
                self.space = found["space"]
                result = setup(db, self._hold(db, first=True))
                db.commit()
            except psycopg.Error as exc:
                db.close()
                raise StoreOpenError(
                    f"the video jobs' database {self.where} cannot be used: {self.line(exc)}"
                    f" ({type(exc).__name__})"
                ) from exc
            except BaseException:
                db.close()
                raise
            self._db, self._open, self._lost = db, True, False
        return result

    def _connect(self) -> Db:
        import psycopg
        from psycopg.rows import dict_row

        timeout = max(1, math.ceil(self.connect_timeout_s))
        return psycopg.connect(self.dsn, connect_timeout=timeout, row_factory=dict_row)

    def _hold(self, db: Db, *, first: bool) -> bool:
        """Take the store's advisory lock: exclusively, or shared; return whether no other
        server held it (known at the first open only).

        Raises:
            StoreBusyError: another server holds it the other way.
        """

        def take(function: str) -> bool:
            found = db.execute(
                f"SELECT {function}(%s, %s) AS got", (LOCKS + HOLD, self.space)
            ).fetchone()
            return found is not None and bool(found["got"])

        alone = (first or not self.shared) and take("pg_try_advisory_lock")
        if not self.shared:
            if not alone:
                raise StoreBusyError(
                    f"another server keeps its video jobs in the database {self.where}:"
                    " give each server its own database, or share it with a lease"
                    " (lease_s, --jobs-lease SECONDS) on every server"
                )
            return True
        shared = take("pg_try_advisory_lock_shared")
        if alone:
            take("pg_advisory_unlock")  # the shared hold stays
        if not shared:
            raise StoreBusyError(
                f"a server that does not share it keeps its video jobs in the database"
                f" {self.where}: give this server another database, or start both with"
                " a lease (lease_s, --jobs-lease SECONDS)"
            )
        return alone

    def close(self) -> None:
        """Close the connection, which lets go of the store (idempotent)."""
        with self._lock:
            self._open = False
            self._drop()

    def _drop(self) -> None:
        db, self._db = self._db, None
        if db is not None:
            with contextlib.suppress(Exception):
                # The store's advisory locks go now, not when the server notices the
                # closed connection: a server opening it next finds it free.
                db.rollback()
                db.execute("SELECT pg_advisory_unlock_all()")
            with contextlib.suppress(Exception):
                db.close()

    # -- one transaction, on a connection made again where it was lost ------------

    def call(self, work: Callable[[Db, bool], _T]) -> _T:
        """``work(db, again)`` in one transaction, committed; its result.

        Where the connection is lost it is made again and ``work`` runs again, for
        ``retry_s`` seconds; ``again`` says that a run before may have been committed
        (its commit was cut), so that ``work`` finds what it did. A transaction the
        database rolled back (a deadlock) runs again at once.

        Raises:
            RuntimeError: the store is closed.
            StoreLostError: the database was not reached again within ``retry_s``.
            StoreBusyError: connected again, another server holds the store the other way.
            psycopg.Error: ``work`` failed (rolled back).
        """
        import psycopg

        with self._lock:
            again = False
            since: float | None = None  # when the connection was lost (monotonic)
            while True:
                if not self._open:
                    raise RuntimeError("the job store is closed")
                committing = False
                try:
                    db = self._connection()
                    result = work(db, again)
                    committing = True
                    self.commit(db)
                    return result
                except psycopg.OperationalError as exc:
                    if self._db is not None and not self._db.closed:
                        self._rollback()
                        if isinstance(exc, psycopg.errors.TransactionRollback):
                            continue
                        raise
                    again = again or committing
                    since = self._wait(exc, since)
                except BaseException:
                    self._rollback()
                    raise

    def commit(self, db: Db) -> None:
        """Commit ``db``'s transaction (where a test cuts a commit)."""
        db.commit()

    def _connection(self) -> Db:
        """The connection, made again (and the store held again) if it was lost."""
        if self._db is not None and not self._db.closed:
            return self._db
        self._drop()
        db = self._connect()
        try:
            self._hold(db, first=False)
            db.commit()
        except BaseException:
            db.close()
            raise
        self._db = db
        if self._lost:
            self._lost = False
            _log.warning("the video jobs' database %s is connected again", self.where)
        return db

    def _rollback(self) -> None:
        db = self._db
        if db is not None and not db.closed:
            try:
                db.rollback()
            except Exception:
                self._drop()

    def _wait(self, exc: BaseException, since: float | None) -> float:
        """The connection is lost: drop it, then wait before the next try (none before
        the first), or raise once ``retry_s`` passed; return when it was lost."""
        self._drop()
        now = time.monotonic()
        if since is None:
            if not self._lost:
                _log.warning(
                    "the video jobs' database %s: the connection is lost (%s); connecting again",
                    self.where,
                    self.line(exc),
                )
            self._lost = True
            return now
        waited = now - since
        if waited >= self.retry_s:
            raise StoreLostError(
                f"the video jobs' database {self.where} cannot be reached: {self.line(exc)}"
                f" (tried for {self.retry_s:g} s)"
            ) from exc
        time.sleep(min(1.0, 0.05 + waited / 4, self.retry_s - waited))
        return since
