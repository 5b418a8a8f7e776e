"""A store that fails a while costs no job and no server (L77, L98): progress writes and the
lease keeper ride it out.

Determinism rules:
- the store is the memory store with one call made to fail (``OSError``, as a store's
  lost connection is) a set number of times; nothing is timed;
- the lease keeper's passes run under trio's ``autojump_clock`` (virtual time).
"""

from __future__ import annotations

import logging
from typing import Any

import anyio
import pytest
import trio

from omni_trio.serve.jobs import MemoryJobStore, MemoryTables
from omni_trio.serve.jobs._jobs import SWEEP_RETRY_S
from omni_trio.serve.jobs._leases import LeaseKeeper
from omni_trio.serve.jobs._store import JobRow
from omni_trio.testing import FakeRunner
from tests.support.core import BUDGET
from tests.support.jobs import RULE, create, finished, service_on, serving


class Flaky(MemoryJobStore):
    """A memory store whose ``progressed`` and ``renew`` fail the first ``failing`` times,
    and whose ``delete`` the first ``failing_deletes`` times."""

    failing = 0
    failing_deletes = 0

    def delete(self, job_id: str) -> bool:
        if self.failing_deletes:
            self.failing_deletes -= 1
            raise OSError("the store's connection is lost (a test)")
        return super().delete(job_id)

    def progressed(self, job_id: str, progress: int, step: int = 0) -> bool:
        if self.failing:
            self.failing -= 1
            raise OSError("the store's connection is lost (a test)")
        return super().progressed(job_id, progress, step)

    def renew(self, until: float) -> set[str]:
        if self.failing:
            self.failing -= 1
            raise OSError("the store's connection is lost (a test)")
        return super().renew(until)


@pytest.mark.anyio
async def test_a_failed_progress_write_costs_the_job_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """L77: a store that cannot take a job's progress for a while (down, L98): the job runs
    on and completes, one warning line per write that failed."""
    tables = MemoryTables()
    made: list[Flaky] = []

    def store(owner: str | None = None) -> Flaky:
        flaky = Flaky(tables, owner=owner)
        flaky.failing = 2
        made.append(flaky)
        return flaky

    with anyio.fail_after(BUDGET), caplog.at_level(logging.WARNING, logger="omni_trio.serve"):
        service, _ = service_on(None, FakeRunner(frames=RULE, checkpoints=True), store=store)
        async with serving(service) as client:
            job = await finished(client, (await create(client, num_frames=5))["id"])
    assert job["status"] == "completed"
    lines = [r.getMessage() for r in caplog.records if "progress is not written" in r.getMessage()]
    assert len(lines) == 2 and made[0].failing == 0


class Holder:
    def __init__(self) -> None:
        self.is_closed = False
        self.lost_ids: list[str] = []

    def held(self) -> list[str]:
        return []

    def lost(self, job_id: str) -> None:
        self.lost_ids.append(job_id)

    async def took_over(self, row: JobRow) -> bool:
        return False


@pytest.mark.trio
async def test_the_lease_keeper_rides_out_a_store_that_fails_a_while(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """L79, L98: the lease keeper's pass that the store fails is one warning line; the next
    pass renews, and the keeper's task never ends the server's."""
    store = Flaky(MemoryTables(), owner="server-a")
    store.open()
    store.failing = 2

    async def stored(call: Any, /, *args: Any, **kwargs: Any) -> Any:
        return call(*args, **kwargs)

    keeper = LeaseKeeper(store, lease_s=3.0, stored=stored)
    with caplog.at_level(logging.WARNING, logger="omni_trio.serve"):
        with trio.move_on_after(3.5):  # four passes of a 1 s period
            await keeper.keep(Holder())
    lines = [r.getMessage() for r in caplog.records if "leases not kept" in r.getMessage()]
    assert len(lines) == 2 and store.failing == 0


@pytest.mark.trio
async def test_an_expired_job_the_store_fails_to_delete_costs_no_server(
    mock_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """L77: an expired job whose delete the store fails (down a while, L98) is one warning
    per try; the sweeper tries again and deletes it, and the server answers throughout."""
    mock_clock.rate = 1.0  # virtual time runs as real time, and jumps where the test says
    tables = MemoryTables()
    made: list[Flaky] = []

    def store(owner: str | None = None) -> Flaky:
        flaky = Flaky(tables, owner=owner)
        flaky.failing_deletes = 2
        made.append(flaky)
        return flaky

    def warned() -> int:
        return sum("not deleted from the store" in r.getMessage() for r in caplog.records)

    async def until(condition: Any) -> None:
        while not condition():
            await trio.sleep(0.001)

    runner = FakeRunner(frames=RULE, checkpoints=True)
    budget = BUDGET + 2 * SWEEP_RETRY_S + 11.0  # the jumps count against it
    with trio.fail_after(budget), caplog.at_level(logging.WARNING, logger="omni_trio.serve"):
        service, _ = service_on(None, runner, store=store, ttl_s=10.0, clock=trio.current_time)
        async with serving(service) as client:
            job_id = (await finished(client, (await create(client))["id"]))["id"]
            mock_clock.jump(11.0)  # expired: gone for clients at once
            assert (await client.get(f"/v1/videos/{job_id}")).status_code == 404
            await until(lambda: warned() == 1)
            assert job_id in tables.rows  # the store's delete failed: the row waits
            mock_clock.jump(SWEEP_RETRY_S)
            await until(lambda: warned() == 2)
            mock_clock.jump(SWEEP_RETRY_S)
            await until(lambda: job_id not in tables.rows)  # deleted on the third try
            assert (await finished(client, (await create(client))["id"]))["status"] == "completed"
    assert warned() == 2 and made[0].failing_deletes == 0
