"""The video jobs' lifecycle on the memory store (L77, L79): it needs nothing of SQLite.

``VideoConfig(store=MemoryTables().store)``: the same ``Service`` and ``VideoJobs``
as with ``jobs_dir``, its store a ``MemoryJobStore``; making a ``SqliteJobStore``
fails the test (``_job.store_of``, the one place that makes one, is patched to).

Determinism rules:
- each "restart" is a second ``Service`` on the same ``MemoryTables`` after the first
  one's lifespan ended (a clean restart);
- two servers sharing the tables have ``lease_s=LEASE`` and look for lapsed jobs every
  ``LEASE / 3`` seconds, so a wait for a takeover is a bounded poll, never a sleep
  that decides; the job taken over checkpoints at every step, and the test waits until
  the tables hold a checkpoint before it lets its owner go.
"""

from __future__ import annotations

from contextlib import AsyncExitStack
from pathlib import Path

import anyio
import pytest

from omni_trio.serve import VideoConfig
from omni_trio.serve.jobs import MemoryJobStore, MemoryTables
from omni_trio.testing import FakeRunner
from tests.support.core import BUDGET
from tests.support.jobs import RULE, content, create, finished, service_on, serving, uninterrupted

pytestmark = pytest.mark.anyio

LEASE = 3.0


@pytest.fixture(autouse=True)
def _no_sqlite(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(folder: Path, *, owner: str | None = None) -> None:
        raise AssertionError(f"a SQLite store was made in {folder}")

    monkeypatch.setattr("omni_trio.serve.jobs._job.SqliteJobStore", refuse)


async def test_a_job_on_the_memory_store_outlives_a_restart() -> None:
    """L77: on the memory store, a job is kept before its ``POST`` is answered, completes,
    and after a restart on the same tables reads the same with the same MP4; a new job's
    id comes after it."""
    tables = MemoryTables()
    with anyio.fail_after(BUDGET):
        service, _ = service_on(None, store=tables.store)
        async with serving(service) as client:
            assert isinstance(service.videos.store, MemoryJobStore)
            job = await create(client, num_frames=5)
            assert [row.id for row in tables.rows.values()] == [job["id"]]
            done = await finished(client, job["id"])
            mp4 = await content(client, job["id"])
        assert done["status"] == "completed"
        assert tables.videos == {job["id"]: mp4}
        service, _ = service_on(None, store=tables.store)
        async with serving(service) as client:
            assert (await client.get(f"/v1/videos/{job['id']}")).json() == done
            assert await content(client, job["id"]) == mp4
            later = await create(client, num_frames=5)
            assert later["id"] > job["id"]


async def test_a_job_let_go_is_taken_over_on_the_memory_store() -> None:
    """L79, L78: two servers share the memory tables; ``a`` shuts down while its job runs
    (cut, not failed), ``b`` takes it over at its next lease pass and resumes it from
    ``a``'s last checkpoint: its MP4 equals an uninterrupted run's."""
    tables = MemoryTables()
    slow = FakeRunner(frames=RULE, checkpoints=True, step_seconds=0.02)
    fresh = FakeRunner(frames=RULE, checkpoints=True)
    body = {"num_frames": 5, "num_inference_steps": 40, "seed": 7}
    with anyio.fail_after(BUDGET):
        async with AsyncExitStack() as stack:
            b_service, _ = service_on(None, fresh, store=tables.store, lease_s=LEASE)
            b = await stack.enter_async_context(serving(b_service))
            a_service, _ = service_on(None, slow, store=tables.store, lease_s=LEASE)
            async with serving(a_service) as a:
                job = await create(a, **body)
                while slow.checkpoints_taken < 2 or not tables.checkpoints:
                    await anyio.sleep(0.005)
            assert slow.steps_run < 40  # cut by a's shutdown
            ended = await finished(b, job["id"])
            assert ended["status"] == "completed", ended
            assert 0 < fresh.steps_run < 40  # resumed, not started again
            assert ended["omni_trio"]["resumes"] == 1
            assert await content(b, job["id"]) == await uninterrupted(**body)


def test_a_store_factory_is_checked() -> None:
    """``VideoConfig.store`` is a callable that replaces ``jobs_dir``; with ``lease_s`` it
    must make a store that can be shared (a ``SharedJobStore``), else the open refuses."""
    tables = MemoryTables()
    with pytest.raises(ValueError, match=r"^store: give jobs_dir or store, not both$"):
        VideoConfig(jobs_dir="jobs", store=tables.store)
    with pytest.raises(ValueError, match=r"^store: must make a job store \(a callable\)"):
        VideoConfig(store=tables)  # type: ignore[arg-type]
    service, _ = service_on(None, store=lambda owner: object(), lease_s=LEASE)
    with pytest.raises(TypeError, match=r"^lease_s: the store object cannot be shared"):
        service.videos.open_store()
    assert service.videos.store is None
