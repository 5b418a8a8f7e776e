"""A job store shared by several servers on one host (L79), in-process.

Determinism rules:
- two ``Service``s, ``a`` and ``b``, share one ``jobs_dir`` with ``lease_s=LEASE``; each
  renews its jobs and looks for lapsed ones every ``LEASE / 3`` seconds, so a wait for a
  takeover or for an owner to learn of a deletion is a bounded poll, never a sleep that
  decides;
- a job that must still run when the test acts on it has 200 slow steps (4 s); one that
  is taken over checkpoints at every step, and the test waits until the store holds a
  checkpoint before it lets the owner go;
- an owner that "lost" a job is made by hand: the test gives its row to an owner that
  does not exist, with a lapsed lease (what a server that stalled past its lease sees).
"""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from omni_trio.serve import Service
from omni_trio.serve.jobs import StoreBusyError
from omni_trio.testing import FakeRunner
from tests.support.core import BUDGET
from tests.support.jobs import RULE, content, create, finished, service_on, serving, uninterrupted
from tests.support.serve import parse_sse

pytestmark = pytest.mark.anyio

#: The lease: long enough that a live server never loses one on a busy machine.
LEASE = 3.0
SLOW = {"num_frames": 5, "num_inference_steps": 200}


def slow_runner(**kwargs: Any) -> FakeRunner:
    return FakeRunner(frames=RULE, checkpoints=True, step_seconds=0.02, **kwargs)


@asynccontextmanager
async def two(
    folder: Path, a: FakeRunner | None = None, b: FakeRunner | None = None, **video: Any
) -> AsyncIterator[tuple[httpx.AsyncClient, httpx.AsyncClient, Service, Service]]:
    """Servers ``a`` and ``b`` sharing ``folder``; their clients and services."""
    video.setdefault("lease_s", LEASE)
    first, _ = service_on(folder, a, **video)
    second, _ = service_on(folder, b, **video)
    async with serving(first) as one, serving(second) as other:
        yield one, other, first, second


def idle(service: Service) -> bool:
    assert service.engine is not None
    stats = service.engine.statistics()
    return stats.running == 0 and stats.waiting == 0


async def until(predicate: Any, what: str) -> None:
    with anyio.fail_after(BUDGET):
        while not await predicate():
            await anyio.sleep(0.01)


async def status_on(client: httpx.AsyncClient, job_id: str) -> tuple[int, str | None]:
    answer = await client.get(f"/v1/videos/{job_id}")
    return answer.status_code, answer.json().get("status")


async def test_any_server_reads_lists_downloads_and_deletes_any_job(tmp_path: Path) -> None:
    """L79: a job made on ``a`` reads the same on ``b`` (GET, the list, its events, its MP4);
    the ids of both servers keep one order; a job deleted through ``b`` is gone on both, and
    ``a``, which runs it, aborts its request."""
    slow = slow_runner()
    with anyio.fail_after(BUDGET):
        async with two(tmp_path, a=slow) as (a, b, service_a, _):
            done = await create(a, num_frames=5)
            theirs = await finished(b, done["id"])
            assert theirs["status"] == "completed" and theirs["progress"] == 100
            assert await content(b, done["id"]) == await content(a, done["id"])
            other = await create(b, num_frames=5, seed=2)
            await finished(b, other["id"])
            for client in (a, b):
                listed = (await client.get("/v1/videos?order=asc")).json()["data"]
                assert [job["id"] for job in listed] == [done["id"], other["id"]]
            events = (await b.get(f"/v1/videos/{done['id']}/events")).text
            assert [kind for kind, _ in parse_sse(events)] == ["video.completed"]

            running = await create(a, **SLOW)
            await until(lambda: _in_progress(b, running["id"]), "b to read a's job as in progress")
            deleted = await b.delete(f"/v1/videos/{running['id']}")
            assert deleted.status_code == 200 and deleted.json()["deleted"] is True
            for client in (a, b):
                assert (await status_on(client, running["id"]))[0] == 404

            async def a_let_go() -> bool:
                return idle(service_a)

            await until(a_let_go, "a to abort the deleted job's request")
            steps = slow.steps_run
            assert steps < 200
            await anyio.sleep(LEASE / 3 + 0.1)  # a keeper pass: nothing runs on
            assert slow.steps_run == steps
            assert (await b.delete(f"/v1/videos/{running['id']}")).status_code == 404


async def _in_progress(client: httpx.AsyncClient, job_id: str) -> bool:
    return await status_on(client, job_id) == (200, "in_progress")


async def test_another_servers_event_stream_follows_the_job_until_it_is_deleted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """L79, L73: ``b``'s event stream of a job ``a`` runs says it is in progress, reads the
    store again while it waits, and once ``a`` deleted the job sends one ``error`` event
    (404) and ends."""
    with anyio.fail_after(BUDGET):
        async with two(tmp_path, a=slow_runner()) as (a, b, _, service_b):
            job = await create(a, **SLOW)
            await until(lambda: _in_progress(b, job["id"]), "b to read it in progress")
            waiting = anyio.Event()
            follow = service_b.videos.next_change

            async def next_change(*args: Any, **kwargs: Any) -> Any:
                waiting.set()  # the stream sent what it knew and waits for a change
                return await follow(*args, **kwargs)

            monkeypatch.setattr(service_b.videos, "next_change", next_change)
            answers: list[httpx.Response] = []

            async def stream() -> None:
                # httpx's in-process transport hands the body over once it ended.
                answers.append(await b.get(f"/v1/videos/{job['id']}/events"))

            async with anyio.create_task_group() as tasks:
                tasks.start_soon(stream)
                await waiting.wait()
                assert (await a.delete(f"/v1/videos/{job['id']}")).status_code == 200
            events = parse_sse(answers[0].text)
            assert events[0][0] == "video.progress" and events[0][1]["status"] == "in_progress"
            assert events[-1][0] == "error"
            assert events[-1][1]["error"]["code"] == "video_not_found"


async def test_a_job_its_server_let_go_at_shutdown_is_taken_over_from_its_checkpoint(
    tmp_path: Path,
) -> None:
    """L79, L78: ``a`` shuts down while its job runs (the job is cut, not failed); ``b`` takes
    it over at its next lease pass and resumes it from ``a``'s last checkpoint: it runs only
    the steps left, and its MP4 equals an uninterrupted run's."""
    slow = slow_runner()
    fresh = FakeRunner(frames=RULE, checkpoints=True)
    body = {"num_frames": 5, "num_inference_steps": 40, "seed": 7}
    with anyio.fail_after(BUDGET):
        async with AsyncExitStack() as stack:
            b_service, _ = service_on(tmp_path, fresh, lease_s=LEASE)
            b = await stack.enter_async_context(serving(b_service))
            a_service, _ = service_on(tmp_path, slow, lease_s=LEASE)
            async with serving(a_service) as a:
                job = await create(a, **body)
                while slow.checkpoints_taken < 2 or not any((tmp_path / "checkpoints").iterdir()):
                    await anyio.sleep(0.005)
            assert slow.steps_run < 40  # cut by a's shutdown
            ended = await finished(b, job["id"])
            assert ended["status"] == "completed", ended
            assert 0 < fresh.steps_run < 40  # resumed, not started again
            assert await content(b, job["id"]) == await uninterrupted(**body)


async def test_a_server_that_lost_its_lease_stops_and_another_finishes_the_job_once(
    tmp_path: Path,
) -> None:
    """L79: a job whose lease lapsed and that another server holds now is no longer its old
    server's: the old one aborts its request at its next write and writes nothing of it;
    the new one resumes it from the last checkpoint; the job completes once, as an
    uninterrupted run."""
    slow = slow_runner()
    body = {"num_frames": 5, "num_inference_steps": 60, "seed": 5}
    with anyio.fail_after(BUDGET):
        async with two(tmp_path, a=slow, b=FakeRunner(frames=RULE, checkpoints=True)) as (
            a,
            b,
            service_a,
            _,
        ):
            job = await create(a, **body)
            while slow.checkpoints_taken < 2 or not any((tmp_path / "checkpoints").iterdir()):
                await anyio.sleep(0.005)
            with sqlite3.connect(tmp_path / "jobs.sqlite3") as db:
                # As if a had stalled past its lease and a third server had taken the job,
                # then died: a must stop, b takes it over.
                db.execute("UPDATE jobs SET owner = 'gone', lease = 0 WHERE id = ?", (job["id"],))

            async def a_let_go() -> bool:
                return idle(service_a)

            await until(a_let_go, "a to abort the job it lost")
            ended = await finished(b, job["id"])
            assert ended["status"] == "completed", ended
            assert (await finished(a, job["id"]))["status"] == "completed"
            assert await content(a, job["id"]) == await uninterrupted(**body)
            assert len((await a.get("/v1/videos")).json()["data"]) == 1


async def test_the_bounds_count_every_servers_jobs(tmp_path: Path) -> None:
    """L79, L77: with ``max_jobs=2`` shared by two servers, one job on each fills the store:
    a third gets 429 ``video_jobs_full`` on either."""
    with anyio.fail_after(BUDGET):
        async with two(tmp_path, max_jobs=2) as (a, b, _, _):
            await create(a, num_frames=5)
            await create(b, num_frames=5)
            for client in (a, b):
                answer = await client.post("/v1/videos", json={"prompt": "a fox", "num_frames": 5})
                assert answer.status_code == 429 and "2 video jobs" in answer.text
                assert answer.json()["error"]["code"] == "video_jobs_full"


async def test_a_folder_held_alone_refuses_a_second_server(tmp_path: Path) -> None:
    """L77, L79: a server that keeps its jobs alone holds its folder; a second server on it,
    sharing or not, fails to start with one clear error, and so does one that would hold a
    shared folder alone."""
    with anyio.fail_after(BUDGET):
        alone, _ = service_on(tmp_path)
        async with serving(alone):
            for lease in (None, LEASE):
                second, _ = service_on(tmp_path, lease_s=lease)
                with pytest.raises(Exception) as raised:  # noqa: PT011 (a group, or not)
                    async with serving(second):
                        pass
                assert isinstance(_leaf(raised.value), StoreBusyError), raised.value
        shared, _ = service_on(tmp_path, lease_s=LEASE)
        async with serving(shared):
            single, _ = service_on(tmp_path)
            with pytest.raises(Exception) as raised:  # noqa: PT011 (a group, or not)
                async with serving(single):
                    pass
            assert "another server keeps its video jobs" in str(_leaf(raised.value))


def _leaf(error: BaseException) -> BaseException:
    while isinstance(error, BaseExceptionGroup):
        error = error.exceptions[0]
    return error
