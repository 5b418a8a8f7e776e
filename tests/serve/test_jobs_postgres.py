"""Video jobs in PostgreSQL (L98, L77, L79): servers that share only a database.

tests/serve/test_job_stores.py runs the stores' conformance tests on ``PostgresJobStore``
too; these are what only a database server brings: two servers that share nothing but
the database take over each other's jobs, MP4s and checkpoints; a PostgreSQL restart
(``pg_ctl restart``) or a stop loses no accepted job; a database that cannot be reached
is one line naming it; a commit cut by a lost connection is neither lost nor doubled.

Determinism rules:
- one PostgreSQL server for the session (tests/support/postgres.py), a database of its
  own for each test; the restarts and stops are ``pg_ctl``'s, which return once the
  server is up, or down;
- a call made while the server is down is known to be waiting for it from the store's
  log line, never from a sleep; a store that must give up has a short ``retry_s`` and
  the server stays down until it did;
- the service tests are ``test_jobs_on_memory``'s on a database: a takeover is a bounded
  poll of the lease keeper's passes (every ``LEASE / 3`` seconds).
"""

from __future__ import annotations

import logging
import re
import sys
import threading
from collections.abc import Iterator
from contextlib import AsyncExitStack

import anyio
import anyio.to_thread
import psycopg
import pytest

from omni_trio._checkpoint import Checkpoint
from omni_trio.serve.jobs import (
    JobRow,
    PostgresJobStore,
    StoreBusyError,
    StoreLostError,
    StoreOpenError,
    postgres_store,
)
from omni_trio.testing import FakeRunner
from tests.support.cli import free_port
from tests.support.core import BUDGET
from tests.support.jobs import RULE, content, create, finished, service_on, serving, uninterrupted
from tests.support.postgres import PostgresServer
from tests.support.postgres import postgres as postgres

LEASE = 3.0


@pytest.fixture
def dsn(postgres: PostgresServer) -> str:
    """A new database on the session's server."""
    return postgres.database()


@pytest.fixture
def opened() -> Iterator[list[PostgresJobStore]]:
    """The stores a test opens (append them): closed at its end."""
    stores: list[PostgresJobStore] = []
    yield stores
    for store in stores:
        store.close()


def open_store(
    dsn: str, made: list[PostgresJobStore], owner: str | None = None, **options: float
) -> PostgresJobStore:
    store = postgres_store(dsn, **options)(owner)
    made.append(store)
    store.open()
    return store


def row(job_id: str, seq: int, lease: float | None = None) -> JobRow:
    return JobRow(
        id=job_id,
        seq=seq,
        model="fake-video",
        spec={"size": "16x16", "request": {"prompt": "a fox \u0000 and a hen"}},
        status="queued",
        created_at=1_000,
        lease=lease,
    )


def checkpoint(job_id: str, step: int, data: bytes) -> Checkpoint:
    return Checkpoint(request_id=job_id, step=step, total=10, data=data)


def test_two_servers_sharing_only_the_database_take_over_a_lapsed_job(
    dsn: str, opened: list[PostgresJobStore]
) -> None:
    """L98, L79: two stores on one database, nothing else shared: ``b`` reads ``a``'s MP4,
    takes over ``a``'s job once its lease lapsed, reads its checkpoint and completes it;
    ``a`` then writes nothing of it and reads ``b``'s MP4."""
    a = open_store(dsn, opened, "a")
    b = open_store(dsn, opened, "b")
    mp4 = bytes(range(256)) * 4096  # 1 MiB, every byte value
    a.insert(row("done", 1, lease=100.0))
    assert a.completed("done", mp4, completed_at=5, expires_at=9e9)
    a.insert(row("job", 2, lease=100.0))
    a.write_checkpoint(checkpoint("job", 6, b"\x00state\xff" * 1000))
    assert b.video("done") == mp4
    assert b.claim(99.0, 200.0) is None  # a holds it yet
    taken = b.claim(101.0, 200.0)
    assert taken is not None and (taken.id, taken.owner, taken.checkpoint_step) == ("job", "b", 6)
    assert b.checkpoint("job") == b"\x00state\xff" * 1000
    assert not a.progressed("job", 90, 9)
    a.write_checkpoint(checkpoint("job", 9, b"late"))
    assert b.completed("job", b"b's mp4", completed_at=7, expires_at=9e9)
    assert not a.completed("job", b"a's mp4", completed_at=8, expires_at=9e9)
    assert a.video("job") == b"b's mp4" and a.checkpoint("job") is None
    assert a.renew(300.0) == {"done"}
    found = a.row("job")
    assert found is not None and (found.status, found.owner, found.bytes) == ("completed", "b", 7)


def test_servers_claiming_at_once_never_take_the_same_job(
    dsn: str, opened: list[PostgresJobStore]
) -> None:
    """L98, L79: three servers take over twenty lapsed jobs at once, each in its own
    thread: every job is taken once, by one of them (its row locked, those another
    holds skipped)."""
    a = open_store(dsn, opened, "a")
    for seq in range(1, 21):
        a.insert(row(f"j{seq}", seq, lease=1.0))
    takers = {owner: open_store(dsn, opened, owner) for owner in ("b", "c", "d")}
    taken: dict[str, list[str]] = {owner: [] for owner in takers}
    start = threading.Barrier(len(takers))

    def take(owner: str) -> None:
        start.wait(BUDGET)
        while (found := takers[owner].claim(2.0, 9e9)) is not None:
            taken[owner].append(found.id)

    threads = [threading.Thread(target=take, args=(owner,)) for owner in takers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(BUDGET)
    every = [job_id for ids in taken.values() for job_id in ids]
    assert sorted(every) == sorted(f"j{seq}" for seq in range(1, 21))
    owners = {r.id: r.owner for r in a.rows(limit=99, after=None, descending=False, tenant=None)}
    assert owners == {job_id: owner for owner, ids in taken.items() for job_id in ids}


def test_a_postgresql_restart_between_two_writes_loses_nothing(
    postgres: PostgresServer,
    dsn: str,
    opened: list[PostgresJobStore],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """L98: ``pg_ctl restart`` between two writes: the next call connects again (one log
    line each way) and every write before and after it is kept."""
    store = open_store(dsn, opened)
    store.insert(row("a", 1))
    store.write_checkpoint(checkpoint("a", 3, b"three"))
    with caplog.at_level(logging.WARNING, logger="omni_trio.serve"):
        postgres.restart()
        assert store.progressed("a", 50, 5)
    lost, back = (record.getMessage() for record in caplog.records)
    assert re.fullmatch(
        rf"the video jobs' database {re.escape(store.where)}: the connection is lost \(.+\);"
        " connecting again",
        lost,
    )
    assert back == f"the video jobs' database {store.where} is connected again"
    postgres.restart()
    assert store.completed("a", b"mp4", completed_at=9, expires_at=9e9)
    store.close()
    again = open_store(dsn, opened)
    found = again.row("a")
    assert found is not None
    assert (found.status, found.progress, found.step, found.bytes) == ("completed", 100, 5, 3)
    assert again.video("a") == b"mp4" and again.checkpoint("a") is None


def test_a_write_while_postgresql_is_down_waits_until_it_is_back(
    postgres: PostgresServer,
    dsn: str,
    opened: list[PostgresJobStore],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """L98: a write made while the server is stopped tries again until it is back (within
    ``retry_s``) and is kept: the job's run never learns of it."""
    store = open_store(dsn, opened)
    store.insert(row("a", 1))
    waiting = threading.Event()
    results: list[bool] = []

    class Lost(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "connection is lost" in record.getMessage():
                waiting.set()

    handler = Lost()
    logger = logging.getLogger("omni_trio.serve")
    logger.addHandler(handler)
    caplog.set_level(logging.WARNING, logger="omni_trio.serve")
    try:
        with postgres.down():
            writer = threading.Thread(target=lambda: results.append(store.progressed("a", 40, 4)))
            writer.start()
            assert waiting.wait(BUDGET)
        writer.join(BUDGET)
    finally:
        logger.removeHandler(handler)
    assert results == [True]
    found = store.row("a")
    assert found is not None and (found.progress, found.step) == (40, 4)


def test_a_database_down_past_retry_s_fails_that_write_in_one_line_then_reconnects(
    postgres: PostgresServer, dsn: str, opened: list[PostgresJobStore]
) -> None:
    """L98, L77: a database still down after ``retry_s`` fails the write with one line
    naming it (host:port/database, never the password), an error of the store's
    ``failures`` (the lifecycle fails that job's write alone); the next call, the server
    back, connects again and nothing written before is lost."""
    store = open_store(dsn + " password=hunter2", opened, retry_s=0.2)
    store.insert(row("a", 1))
    with postgres.down(), pytest.raises(StoreLostError) as lost:
        store.progressed("a", 10, 1)
    message = str(lost.value)
    database = dsn.rpartition("dbname=")[2]
    assert message.startswith(
        f"the video jobs' database 127.0.0.1:{postgres.port}/{database} cannot be reached: "
    )
    assert message.endswith("(tried for 0.2 s)") and "\n" not in message
    assert "hunter2" not in message
    assert isinstance(lost.value, store.failures)
    assert store.progressed("a", 20, 2)
    found = store.row("a")
    assert found is not None and (found.progress, found.step) == (20, 2)


def test_an_unreachable_database_at_open_is_one_line_naming_it(
    postgres: PostgresServer, opened: list[PostgresJobStore]
) -> None:
    """L98: a database that cannot be reached at open (nothing listens; no such
    database) is one ``StoreOpenError`` line naming host:port/database, never the
    password; nothing is held."""
    port = free_port()
    secret = f"postgresql://jobs:hunter2@127.0.0.1:{port}/jobs"
    with pytest.raises(StoreOpenError) as refused:
        open_store(secret, opened)
    message = str(refused.value)
    assert message.startswith(f"the video jobs' database 127.0.0.1:{port}/jobs cannot be reached: ")
    assert "Connection refused" in message and "\n" not in message
    assert "hunter2" not in message
    with pytest.raises(
        StoreOpenError, match=r'/nothing cannot be reached: .*"nothing" does not exist$'
    ):
        open_store(postgres.dsn("nothing"), opened)


def test_one_server_alone_holds_the_database(dsn: str, opened: list[PostgresJobStore]) -> None:
    """L98, L77: a database held by one server alone refuses a second one in one line
    naming it, until the first closes."""
    first = open_store(dsn, opened)
    with pytest.raises(
        StoreBusyError,
        match=r"^another server keeps its video jobs in the database 127\.0\.0\.1:\d+/test_\d+: ",
    ):
        open_store(dsn, opened)
    first.close()
    open_store(dsn, opened)


def test_a_table_an_earlier_version_made_gains_the_added_columns(
    dsn: str, opened: list[PostgresJobStore]
) -> None:
    """L98, L77: a store opened on the tables of its first version adds the columns
    added since (with their defaults) and reads the jobs kept there."""
    with psycopg.connect(dsn, autocommit=True) as db:
        db.execute(
            "CREATE TABLE video_jobs (id TEXT PRIMARY KEY, seq BIGINT NOT NULL, model TEXT NOT"
            " NULL, spec JSON NOT NULL, status TEXT NOT NULL, started BOOLEAN NOT NULL DEFAULT"
            " FALSE, progress INTEGER NOT NULL DEFAULT 0, created_at BIGINT NOT NULL,"
            " completed_at BIGINT, expires_at DOUBLE PRECISION, error JSON, bytes BIGINT NOT"
            " NULL DEFAULT 0, checkpoint_step INTEGER, tenant TEXT, owner TEXT,"
            " lease DOUBLE PRECISION)"
        )
        db.execute(
            "INSERT INTO video_jobs (id, seq, model, spec, status, created_at, progress)"
            """ VALUES ('old', 3, 'fake-video', '{"size": "16x16"}', 'in_progress', 7, 30)"""
        )
    store = open_store(dsn, opened)
    found = store.row("old")
    assert found is not None
    assert (found.progress, found.step, found.resumes, found.steps_lost) == (30, 0, 0, 0)
    assert store.progressed("old", 40, 4)
    store.resumed("old", 2, 2)
    assert store.next_seq() == 4


def test_a_commit_cut_by_a_lost_connection_runs_again_finding_what_it_did(
    dsn: str, opened: list[PostgresJobStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    """L98, L77, L79: the connection lost just after a commit (made, but not known to
    be): the call runs again and finds what it did: a record is not doubled, a job's
    end is this store's, a takeover is not lost."""
    a = open_store(dsn, opened, "a")
    b = open_store(dsn, opened, "b")
    session = b.session
    commit = session.commit

    def cut(db: psycopg.Connection[dict[str, object]]) -> None:
        commit(db)
        db.close()
        monkeypatch.setattr(session, "commit", commit)  # once
        raise psycopg.OperationalError("the connection was cut")

    a.insert(row("ended", 1, lease=100.0))
    a.insert(row("failing", 2, lease=9e9))
    monkeypatch.setattr(session, "commit", cut)
    taken = b.claim(101.0, 200.0)
    assert taken is not None and (taken.id, taken.owner, taken.lease) == ("ended", "b", 200.0)
    monkeypatch.setattr(session, "commit", cut)
    assert b.completed("ended", b"mp4", completed_at=5, expires_at=9e9)
    assert b.video("ended") == b"mp4"
    monkeypatch.setattr(session, "commit", cut)
    b.insert(row("new", 3, lease=9e9))
    monkeypatch.setattr(session, "commit", cut)
    assert b.failed(
        "new", {"code": "x", "message": "y"}, progress=1, completed_at=6, expires_at=9e9
    )
    assert [r.id for r in b.rows(limit=9, after=None, descending=False, tenant=None)] == [
        "ended",
        "failing",
        "new",
    ]
    assert not b.failed(
        "new", {"code": "x", "message": "y"}, progress=1, completed_at=6, expires_at=9e9
    )


def test_the_factory_names_the_extra_when_psycopg_is_missing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``postgres_store`` without psycopg is one ImportError naming the ``postgres``
    extra; its options are checked."""
    with pytest.raises(ValueError, match=r"^retry_s: must be a finite number >= 0, got -1$"):
        postgres_store("dbname=jobs", retry_s=-1)
    monkeypatch.setitem(sys.modules, "psycopg", None)
    with pytest.raises(ImportError, match=r"pip install 'omni_trio\[postgres\]'"):
        postgres_store("dbname=jobs")


@pytest.mark.anyio
async def test_a_job_survives_a_postgresql_restart_mid_job(
    postgres: PostgresServer, dsn: str
) -> None:
    """L98, L77: PostgreSQL restarts while a job runs (its checkpoints and progress being
    written): the job completes, to the uninterrupted MP4, as the database keeps it."""
    slow = FakeRunner(frames=RULE, checkpoints=True, step_seconds=0.02)
    body = {"num_frames": 5, "num_inference_steps": 100, "seed": 7}
    with anyio.fail_after(BUDGET):
        service, _ = service_on(None, slow, store=postgres_store(dsn))
        async with serving(service) as client:
            job = await create(client, **body)
            while slow.checkpoints_taken < 2:
                await anyio.sleep(0.005)
            await anyio.to_thread.run_sync(postgres.restart)
            assert slow.steps_run < 100  # restarted mid-job: its next writes reconnect
            ended = await finished(client, job["id"])
            assert ended["status"] == "completed", ended
            mp4 = await content(client, job["id"])
        assert mp4 == await uninterrupted(**body)
        store = postgres_store(dsn)(None)
        try:
            kept = await anyio.to_thread.run_sync(store.open)
            assert [(r.id, r.status, r.bytes) for r in kept] == [(job["id"], "completed", len(mp4))]
            assert await anyio.to_thread.run_sync(store.video, job["id"]) == mp4
        finally:
            store.close()


@pytest.mark.anyio
async def test_a_job_let_go_is_taken_over_by_a_server_sharing_only_the_database(
    dsn: str,
) -> None:
    """L98, L79, L78: two servers share only the database; ``a`` shuts down while its job
    runs, ``b`` takes it over and resumes it from ``a``'s last checkpoint, read from the
    database: its MP4 equals an uninterrupted run's, served by ``b``."""
    slow = FakeRunner(frames=RULE, checkpoints=True, step_seconds=0.02)
    fresh = FakeRunner(frames=RULE, checkpoints=True)
    body = {"num_frames": 5, "num_inference_steps": 40, "seed": 7}
    with anyio.fail_after(BUDGET):
        async with AsyncExitStack() as stack:
            b_service, _ = service_on(None, fresh, store=postgres_store(dsn), lease_s=LEASE)
            b = await stack.enter_async_context(serving(b_service))
            a_service, _ = service_on(None, slow, store=postgres_store(dsn), lease_s=LEASE)
            async with serving(a_service) as a:
                job = await create(a, **body)
                while slow.checkpoints_taken < 2:
                    await anyio.sleep(0.005)
                assert a_service.videos.store is not None
                while (
                    await anyio.to_thread.run_sync(a_service.videos.store.checkpoint, job["id"])
                    is None
                ):
                    await anyio.sleep(0.005)
            assert slow.steps_run < 40  # cut by a's shutdown
            ended = await finished(b, job["id"])
            assert ended["status"] == "completed", ended
            assert 0 < fresh.steps_run < 40  # resumed, not started again
            assert ended["omni_trio"]["resumes"] == 1
            assert await content(b, job["id"]) == await uninterrupted(**body)
