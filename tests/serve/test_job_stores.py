"""One set of tests over every job store (L77, L79): what the lifecycle relies on, per store.

Each test runs once per store of ``STORES``: ``SqliteJobStore`` on a folder,
``MemoryJobStore`` on ``MemoryTables``, and ``PostgresJobStore`` on a database of its own
on the session's PostgreSQL server (tests/support/postgres.py; skipped where PostgreSQL
is not installed). A new store joins by adding its maker to ``STORES``; every test then
runs on it too.

Determinism rules:
- no event loop and no thread: a store's methods block, and the tests call them in
  order; two servers sharing a store are two stores made on one backing (a folder, a
  ``MemoryTables``, a database), with owners ``a`` and ``b``;
- leases read the times the tests pass (``now``, ``until``), never a clock.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from omni_trio._checkpoint import Checkpoint
from omni_trio.serve.jobs import (
    JobRow,
    JobStore,
    MemoryTables,
    SharedJobStore,
    SqliteJobStore,
    StoreBusyError,
    postgres_store,
)
from tests.support.postgres import PostgresServer
from tests.support.postgres import postgres as postgres

#: Makes a store on one backing for the server ``owner`` (``None``: its alone).
Maker = Callable[[str | None], SharedJobStore]


def _sqlite(request: pytest.FixtureRequest, folder: Path) -> Maker:
    def make(owner: str | None) -> SharedJobStore:
        return SqliteJobStore(folder, owner=owner)

    return make


def _memory(request: pytest.FixtureRequest, folder: Path) -> Maker:
    return MemoryTables().store


def _postgres(request: pytest.FixtureRequest, folder: Path) -> Maker:
    server: PostgresServer = request.getfixturevalue("postgres")
    return postgres_store(server.database())


#: Every store, by name: a maker of stores on one backing, from a test's request (for
#: the fixtures it needs) and folder.
STORES: dict[str, Callable[[pytest.FixtureRequest, Path], Maker]] = {
    "sqlite": _sqlite,
    "memory": _memory,
    "postgres": _postgres,
}


class Stores:
    """Stores on one backing, opened as made, all closed at the end of the test."""

    def __init__(self, make: Maker) -> None:
        self._make = make
        self.made: list[SharedJobStore] = []

    def __call__(self, owner: str | None = None, *, open_it: bool = True) -> SharedJobStore:
        store = self._make(owner)
        self.made.append(store)
        if open_it:
            store.open()
        return store

    def again(self, store: SharedJobStore) -> tuple[SharedJobStore, list[JobRow]]:
        """Close ``store`` and open another for its owner (a restart); it and its rows."""
        store.close()
        fresh = self(store.owner, open_it=False)
        return fresh, fresh.open()


@pytest.fixture(params=sorted(STORES))
def stores(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Stores]:
    made = Stores(STORES[request.param](request, tmp_path))
    yield made
    for store in made.made:
        store.close()


def row(job_id: str, seq: int, *, tenant: str | None = None, lease: float | None = None) -> JobRow:
    """A new job's row, as the lifecycle writes it."""
    spec = {"size": "16x16", "request": {"prompt": "a fox", "steps": [1, 2.5, None]}}
    return JobRow(
        id=job_id,
        seq=seq,
        model="fake-video",
        spec=spec,
        status="queued",
        created_at=1_000 + seq,
        tenant=tenant,
        lease=lease,
    )


def checkpoint(job_id: str, step: int, data: bytes = b"state") -> Checkpoint:
    return Checkpoint(request_id=job_id, step=step, total=10, data=data)


def test_every_store_is_a_shared_job_store(stores: Stores) -> None:
    """L77, L79: each store has every method the lifecycle calls, of both protocols."""
    store = stores()
    assert isinstance(store, JobStore) and isinstance(store, SharedJobStore)
    assert all(issubclass(kind, Exception) for kind in store.failures)


def test_rows_come_back_by_seq_as_written(stores: Stores) -> None:
    """L77: a new job's row is kept as written (its parameters as JSON data), and a store
    opened again gives every row back in admission order."""
    store = stores()
    for job_id, seq in (("b", 2), ("a", 1), ("c", 3)):
        store.insert(row(job_id, seq, tenant="acme" if job_id == "c" else None))
    store, rows = stores.again(store)
    assert [(r.id, r.seq) for r in rows] == [("a", 1), ("b", 2), ("c", 3)]
    assert rows[0] == row("a", 1)
    assert rows[2].tenant == "acme" and rows[2].spec == row("c", 3).spec
    assert store.row("b") == rows[1] and store.row("nothing") is None
    assert rows[0].is_live and not rows[0].started and rows[0].progress == 0


def test_progress_and_checkpoints_only_move_forward(stores: Stores) -> None:
    """L73, L77, L78: a running job's progress and step never go back; its checkpoint is
    its last one, with its step, and makes it ``in_progress``."""
    store = stores()
    store.insert(row("a", 1))
    store.write_checkpoint(checkpoint("a", 3, b"three"))
    found = store.row("a")
    assert found is not None
    assert (found.status, found.started, found.checkpoint_step) == ("in_progress", True, 3)
    assert (found.progress, found.step) == (30, 3)
    assert store.progressed("a", 50, 5)
    assert store.progressed("a", 20, 2)  # late news: nothing goes back
    store.write_checkpoint(checkpoint("a", 4, b"four"))
    found = store.row("a")
    assert found is not None and (found.progress, found.step, found.checkpoint_step) == (50, 5, 4)
    assert store.checkpoint("a") == b"four"
    assert store.checkpoint("nothing") is None


def test_an_end_is_kept_once_and_drops_the_checkpoint(stores: Stores) -> None:
    """L77: a completed job keeps its MP4 and its times, a failed one its error and its
    progress; either drops its checkpoint; a job that ended takes no other end."""
    store = stores()
    store.insert(row("done", 1))
    store.insert(row("broke", 2))
    for job_id in ("done", "broke"):
        store.write_checkpoint(checkpoint(job_id, 6))
    assert store.completed("done", b"mp4 bytes", completed_at=2_000, expires_at=5_000.5)
    error = {"code": "runner_error", "message": "the model failed"}
    assert store.failed("broke", error, progress=40, completed_at=2_001, expires_at=5_001.0)
    assert not store.failed("done", error, progress=0, completed_at=3_000, expires_at=6_000.0)
    assert not store.completed("broke", b"late", completed_at=3_000, expires_at=6_000.0)
    assert not store.progressed("done", 99, 9)
    store.write_checkpoint(checkpoint("done", 9))  # a late checkpoint is not kept
    store, rows = stores.again(store)
    done, broke = rows
    assert (done.status, done.progress, done.bytes) == ("completed", 100, 9)
    assert done.completed_at == 2_000
    assert (done.expires_at, done.checkpoint_step, done.lease) == (5_000.5, None, None)
    assert store.video("done") == b"mp4 bytes" and store.checkpoint("done") is None
    assert (broke.status, broke.error, broke.progress) == ("failed", error, 60)
    assert store.video("broke") is None and store.checkpoint("broke") is None


def test_a_deleted_job_is_gone_with_its_files(stores: Stores) -> None:
    """L77: a deleted job is gone, row and files, and stays gone; nothing writes to it."""
    store = stores()
    store.insert(row("a", 1))
    store.write_checkpoint(checkpoint("a", 2))
    assert store.delete("a")
    assert not store.delete("a")
    assert store.row("a") is None and store.checkpoint("a") is None
    assert not store.progressed("a", 10, 1)
    assert not store.completed("a", b"mp4", completed_at=1, expires_at=2.0)
    store.write_checkpoint(checkpoint("a", 3))
    store, rows = stores.again(store)
    assert rows == [] and store.checkpoint("a") is None


def test_each_resume_is_counted_with_the_steps_it_lost(stores: Stores) -> None:
    """L77: each run again counts once, from its step, adding the steps done again."""
    store = stores()
    store.insert(row("a", 1))
    store.progressed("a", 70, 7)
    store.resumed("a", 4, 3)
    store.progressed("a", 60, 6)
    store.resumed("a", 5, 1)
    found = store.row("a")
    assert found is not None
    assert (found.resumes, found.resumed_from, found.steps_lost, found.step) == (2, 5, 4, 5)


def test_a_store_alone_takes_every_unfinished_job(stores: Stores) -> None:
    """L77, L79: opened by one server alone, the unfinished jobs of servers gone are its
    own, with no lease; the finished ones stay as they were."""
    shared = stores("a")
    shared.insert(row("live", 1, lease=9e9))
    shared.insert(row("done", 2, lease=9e9))
    assert shared.completed("done", b"mp4", completed_at=1, expires_at=9e9)
    shared.close()
    alone = stores(None, open_it=False)
    live, done = alone.open()
    assert (live.owner, live.lease) == (None, None)
    assert done.owner == "a"
    assert alone.progressed("live", 10, 1)  # its own now


def test_a_store_held_alone_refuses_a_second_server(stores: Stores) -> None:
    """L77, L79: a store held by one server alone refuses a second one, sharing or not,
    and a shared one refuses a server that would hold it alone; closed, it lets go."""
    alone = stores(None)
    for owner in (None, "b"):
        with pytest.raises(StoreBusyError):
            stores(owner)
    alone.close()
    stores("a")
    stores("b")  # sharing it
    with pytest.raises(StoreBusyError, match="another server keeps its video jobs"):
        stores(None)


def test_sequence_numbers_come_from_the_store(stores: Stores) -> None:
    """L79: every server's ids keep one order: each number is new to the whole store."""
    a, b = stores("a"), stores("b")
    a.insert(row("x", 7))
    assert a.next_seq() == 8
    assert b.next_seq() == 9
    assert a.next_seq() == 10
    b.insert(row("y", 20))
    assert a.next_seq() == 21


def test_every_write_about_a_running_job_is_its_owners(stores: Stores) -> None:
    """L79: a server writes nothing of a job another runs: progress, checkpoint, end,
    resume and release each leave it as it was."""
    a, b = stores("a"), stores("b")
    a.insert(row("j", 1, lease=100.0))
    before = a.row("j")
    assert not b.progressed("j", 50, 5)
    b.write_checkpoint(checkpoint("j", 5))
    b.resumed("j", 5, 2)
    b.release("j")
    assert not b.completed("j", b"mp4", completed_at=1, expires_at=2.0)
    error = {"code": "x", "message": "y"}
    assert not b.failed("j", error, progress=1, completed_at=1, expires_at=2.0)
    assert a.row("j") == before and a.checkpoint("j") is None and b.video("j") is None
    assert b.renew(200.0) == set()
    assert a.renew(200.0) == {"j"}


def test_a_lapsed_lease_is_taken_over_once(stores: Stores) -> None:
    """L79: a live job whose lease lapsed is taken over by one server, first by ``seq``,
    with a lease of its own; its old owner learns it from its renewal and its writes."""
    a, b = stores("a"), stores("b")
    a.insert(row("second", 2, lease=100.0))
    a.insert(row("first", 1, lease=100.0))
    a.insert(row("done", 3, lease=100.0))
    a.completed("done", b"mp4", completed_at=1, expires_at=9e9)
    assert b.claim(99.0, 200.0) is None  # held yet
    taken = b.claim(101.0, 200.0)
    assert taken is not None and (taken.id, taken.owner, taken.lease) == ("first", "b", 200.0)
    assert b.row("first") == taken
    assert a.renew(300.0) == {"second", "done"}
    assert not a.progressed("first", 10, 1)
    assert b.progressed("first", 10, 1)
    assert b.claim(101.0, 200.0) is None  # a renewed "second"
    assert b.renew(350.0) == {"first"}
    again = b.claim(301.0, 400.0)
    assert again is not None and again.id == "second"
    assert b.claim(301.0, 400.0) is None  # nothing live lapsed any more


def test_a_job_let_go_is_taken_at_once(stores: Stores) -> None:
    """L79: a job its owner let go (at shutdown) is another server's at the next claim."""
    a, b = stores("a"), stores("b")
    a.insert(row("j", 1, lease=9e9))
    assert b.claim(1.0, 2.0) is None
    a.release("j")
    taken = b.claim(1.0, 2.0)
    assert taken is not None and taken.owner == "b"


def test_expired_jobs_are_deleted_whoever_finished_them(stores: Stores) -> None:
    """L77, L79: finished jobs whose time-to-live ended are deleted by any server, files
    and all; live ones and those still kept stay."""
    a, b = stores("a"), stores("b")
    for job_id, seq in (("old", 1), ("new", 2), ("live", 3)):
        a.insert(row(job_id, seq))
    a.completed("old", b"mp4", completed_at=1, expires_at=50.0)
    a.failed("new", {"code": "x", "message": "y"}, progress=0, completed_at=1, expires_at=150.0)
    assert b.expired(100.0) == ["old"]
    assert a.row("old") is None and a.video("old") is None
    assert [r.id for r in b.rows(limit=9, after=None, descending=False, tenant=None)] == [
        "new",
        "live",
    ]


def test_the_list_pages_by_seq_and_tenant_and_the_totals_count_every_job(stores: Stores) -> None:
    """L73, L55, L79: rows by ``seq`` either way, after a cursor, of one tenant, at most
    ``limit``; the totals count every server's jobs and their MP4 bytes."""
    a, b = stores("a"), stores("b")
    for seq in range(1, 7):
        (a if seq % 2 else b).insert(row(f"j{seq}", seq, tenant="acme" if seq > 3 else None))
    a.completed("j1", b"12345", completed_at=1, expires_at=9e9)
    b.completed("j2", b"123", completed_at=1, expires_at=9e9)

    def ids(
        limit: int = 9,
        after: int | None = None,
        descending: bool = False,
        tenant: str | None = None,
    ) -> list[str]:
        rows = b.rows(limit=limit, after=after, descending=descending, tenant=tenant)
        return [r.id for r in rows]

    assert ids() == ["j1", "j2", "j3", "j4", "j5", "j6"]
    assert ids(descending=True, limit=2) == ["j6", "j5"]
    assert ids(after=2, limit=2) == ["j3", "j4"]
    assert ids(after=5, descending=True) == ["j4", "j3", "j2", "j1"]
    assert ids(tenant="acme", after=4) == ["j5", "j6"]
    assert a.totals() == b.totals() == (6, 8)


def test_a_closed_store_refuses_to_read_rows(stores: Stores) -> None:
    """A closed store refuses (``RuntimeError``), as a closed database does."""
    store = stores()
    store.close()
    with pytest.raises(RuntimeError, match="closed"):
        store.row("a")
