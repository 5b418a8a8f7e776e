"""The durable job store (L77, L78) in-process: restarts on one folder, bounds, expiry.

Determinism rules:
- each "restart" is a second ``Service`` on the same ``jobs_dir``, after the first
  one's lifespan ended (a clean restart); what a crash leaves is made by hand
  (stray temporary files, a corrupt checkpoint) or by the subprocess tests in
  test_jobs_kill.py;
- the runners are ``FakeRunner(frames=(4, 1), checkpoints=True)``; a job cut by
  shutdown runs slow steps (``step_seconds``) and the test waits until the store
  holds its checkpoint, then leaves: how far it got changes nothing checked;
- expiry reads a fake monotonic clock and a fake wall clock that the test moves.
"""

from __future__ import annotations

import logging
import sqlite3
from pathlib import Path

import anyio
import pytest

import omni_trio as ot
from omni_trio.serve.jobs import SqliteJobStore
from omni_trio.testing import FakeRunner
from tests.support.core import BUDGET
from tests.support.jobs import (
    FPS,
    RULE,
    SIZE,
    content,
    create,
    finished,
    service_on,
    serving,
    uninterrupted,
)
from tests.support.serve import stored_rows

pytestmark = pytest.mark.anyio


async def test_a_restart_keeps_completed_failed_and_deleted_jobs_as_they_were(
    tmp_path: Path,
) -> None:
    """L77: across restarts on one folder, a completed job stays downloadable (the same
    MP4), a failed one keeps its error, a deleted one stays deleted; the list and its order
    survive, and a new job's id comes after the old ones."""
    with anyio.fail_after(BUDGET):
        service, _ = service_on(tmp_path, FakeRunner(frames=RULE, checkpoints=True, fail_at_step=2))
        async with serving(service) as client:
            failed = await finished(client, (await create(client, num_frames=5))["id"])
        assert failed["status"] == "failed"
        service, _ = service_on(tmp_path)
        async with serving(service) as client:
            assert (await client.get(f"/v1/videos/{failed['id']}")).json() == failed
            done = await finished(client, (await create(client, num_frames=5))["id"])
            mp4 = await content(client, done["id"])
            gone = await finished(client, (await create(client, num_frames=9))["id"])
            assert (await client.delete(f"/v1/videos/{gone['id']}")).status_code == 200
        service, _ = service_on(tmp_path)
        async with serving(service) as client:
            assert (await client.get(f"/v1/videos/{done['id']}")).json() == done
            assert await content(client, done["id"]) == mp4
            assert (await client.get(f"/v1/videos/{gone['id']}")).status_code == 404
            listed = (await client.get("/v1/videos")).json()["data"]
            assert [job["id"] for job in listed] == [done["id"], failed["id"]]
            newer = await create(client, num_frames=5)
            assert newer["id"] > done["id"]
            await finished(client, newer["id"])
    assert mp4 == await uninterrupted(num_frames=5)
    assert sorted(p.name for p in (tmp_path / "videos").iterdir()) == sorted(
        [f"{done['id']}.mp4", f"{newer['id']}.mp4"]
    )


async def test_jobs_cut_by_shutdown_run_again_in_order_from_their_checkpoint(
    tmp_path: Path,
) -> None:
    """L77, L78: shutdown cuts a running job (after a checkpoint) and two queued ones; after
    the restart all three run, in their order, the first resumed from its checkpoint (not
    step 0); each MP4 equals an uninterrupted run's, and the running one never read queued.
    """
    slow = FakeRunner(frames=RULE, checkpoints=True, step_seconds=0.02, max_batch_size=1)
    service, _ = service_on(tmp_path, slow, max_jobs=8)
    with anyio.fail_after(BUDGET):
        async with serving(service) as client:
            jobs = [await create(client, num_frames=5, num_inference_steps=40, seed=s)
                    for s in (1, 2, 3)]  # fmt: skip
            while slow.checkpoints_taken < 2 or not any((tmp_path / "checkpoints").iterdir()):
                await anyio.sleep(0.005)
        assert {j["status"] for j in (jobs[1], jobs[2])} == {"queued"}
        rows = {row.id: row for row in await stored_rows(tmp_path)}
        first = rows[jobs[0]["id"]]
        assert (first.status, first.started) == ("in_progress", True)
        assert first.checkpoint_step is not None and first.checkpoint_step >= 1
        assert [rows[j["id"]].status for j in jobs[1:]] == ["queued", "queued"]
        fresh = FakeRunner(frames=RULE, checkpoints=True, max_batch_size=1)
        service, _ = service_on(tmp_path, fresh)
        async with serving(service) as client:
            assert (await client.get(f"/v1/videos/{jobs[0]['id']}")).json()["status"] == (
                "in_progress"
            )
            ends = [await finished(client, job["id"]) for job in jobs]
            mp4s = [await content(client, job["id"]) for job in jobs]
        assert [end["status"] for end in ends] == ["completed"] * 3
        assert ends[0]["completed_at"] <= ends[1]["completed_at"] <= ends[2]["completed_at"]
        assert fresh.restores == 1
        assert fresh.steps_run == 3 * 40 - first.checkpoint_step
        assert not any((tmp_path / "checkpoints").iterdir())
    for seed, mp4 in zip((1, 2, 3), mp4s, strict=True):
        assert mp4 == await uninterrupted(num_frames=5, num_inference_steps=40, seed=seed)


async def test_a_corrupt_checkpoint_is_refused_and_the_job_runs_from_step_0(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """L78: a checkpoint altered on disk is refused with a log line naming the job; the job
    runs from step 0 and its MP4 equals an uninterrupted run's."""
    slow = FakeRunner(frames=RULE, checkpoints=True, step_seconds=0.02)
    service, _ = service_on(tmp_path, slow)
    with anyio.fail_after(BUDGET):
        async with serving(service) as client:
            job = await create(client, num_frames=5, num_inference_steps=20)
            while not any((tmp_path / "checkpoints").iterdir()):
                await anyio.sleep(0.005)
        path = tmp_path / "checkpoints" / f"{job['id']}.ckpt"
        data = path.read_bytes()
        path.write_bytes(data[:-3] + bytes(b ^ 0xFF for b in data[-3:]))
        fresh = FakeRunner(frames=RULE, checkpoints=True)
        service, _ = service_on(tmp_path, fresh)
        with caplog.at_level(logging.WARNING, logger="omni_trio.worker"):
            async with serving(service) as client:
                end = await finished(client, job["id"])
                mp4 = await content(client, job["id"])
    assert end["status"] == "completed"
    assert (fresh.restores, fresh.steps_run) == (0, 20)
    assert any(job["id"] in r.getMessage() and "refused" in r.getMessage() for r in caplog.records)
    assert mp4 == await uninterrupted(num_frames=5, num_inference_steps=20)


async def test_a_full_store_refuses_new_jobs_with_429_across_a_restart(tmp_path: Path) -> None:
    """L77: the store's bounds (jobs, bytes of MP4s) hold across a restart: a new job gets
    429 ``video_jobs_full`` naming what is full, and takes no place."""
    with anyio.fail_after(BUDGET):
        service, _ = service_on(tmp_path, max_jobs=2)
        async with serving(service) as client:
            for _ in range(2):
                await finished(client, (await create(client, num_frames=5))["id"])
        service, _ = service_on(tmp_path, max_jobs=2)
        async with serving(service) as client:
            refused = await client.post("/v1/videos", json={"prompt": "a fox", "num_frames": 5})
            assert refused.status_code == 429
            error = refused.json()["error"]
            assert error["code"] == "video_jobs_full" and "2 video jobs" in error["message"]
            assert len((await client.get("/v1/videos")).json()["data"]) == 2
        service, _ = service_on(tmp_path, max_jobs=8, max_bytes=1)
        async with serving(service) as client:
            refused = await client.post("/v1/videos", json={"prompt": "a fox", "num_frames": 5})
            assert refused.status_code == 429
            assert "bytes of videos" in refused.json()["error"]["message"]


class Clocks:
    """A monotonic clock and a wall clock that move only when the test says."""

    def __init__(self) -> None:
        self.monotonic = 5000.0
        self.wall = 1_000_000.0

    def clock(self) -> float:
        return self.monotonic

    def time(self) -> float:
        return self.wall


async def test_a_jobs_time_to_live_counts_across_a_restart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """L77: a completed job expires ``ttl_s`` after it finished, whatever restarts came
    between: kept before, gone (404, its row and its file) after."""
    clocks = Clocks()
    monkeypatch.setattr("omni_trio.serve.jobs._runs.time", clocks)
    with anyio.fail_after(BUDGET):
        service, _ = service_on(tmp_path, ttl_s=60.0, clock=clocks.clock)
        async with serving(service) as client:
            job = await finished(client, (await create(client, num_frames=5))["id"])
        assert job["expires_at"] == int(clocks.wall + 60)
        clocks.wall += 40  # 20 s left; the new process's monotonic clock starts elsewhere
        clocks.monotonic = 100.0
        service, _ = service_on(tmp_path, ttl_s=60.0, clock=clocks.clock)
        async with serving(service) as client:
            assert (await client.get(f"/v1/videos/{job['id']}")).status_code == 200
            clocks.monotonic += 21
            assert (await client.get(f"/v1/videos/{job['id']}")).status_code == 404
        with sqlite3.connect(tmp_path / "jobs.sqlite3") as db:
            assert db.execute("SELECT count(*) FROM jobs").fetchone() == (0,)
        assert not any((tmp_path / "videos").iterdir())


async def test_opening_the_store_removes_what_a_crash_left(tmp_path: Path) -> None:
    """L77: temporary files (a write cut by a crash) and files whose job is gone or not in
    that state are removed when the store opens; nothing half-written is ever served."""
    store = SqliteJobStore(tmp_path)
    assert await anyio.to_thread.run_sync(store.open) == []
    for name in ("videos/.video_x.mp4.abc.tmp", "videos/video_gone.mp4",
                 "checkpoints/video_gone.ckpt", "checkpoints/.video_y.ckpt.1.tmp"):  # fmt: skip
        (tmp_path / name).write_bytes(b"half")
    store.close()
    store = SqliteJobStore(tmp_path)
    await anyio.to_thread.run_sync(store.open)
    store.close()
    assert not any((tmp_path / "videos").iterdir())
    assert not any((tmp_path / "checkpoints").iterdir())


def test_a_jobs_record_keeps_its_parameters_and_its_image() -> None:
    """L77, L69: what the store keeps of a job gives back the same request, an image to
    video's image included (as PNG: exact for an image that came from one)."""
    import PIL.Image
    import torch

    from omni_trio.serve._video_body import VideoSpec
    from omni_trio.serve.jobs import spec_from_record, spec_record

    pixels = torch.randint(0, 256, (SIZE, SIZE, 3), dtype=torch.uint8)
    request = ot.GenerationRequest(
        prompt="a fox", image=PIL.Image.fromarray(pixels.numpy()), width=SIZE, height=SIZE,
        num_frames=5, num_steps=3, seed=7, cache=ot.StepCache(kind="first-block"),
    )  # fmt: skip
    spec = VideoSpec(request=request, size="16x16", seconds="0.625", fps=FPS)
    back = spec_from_record(spec_record(spec))
    assert isinstance(back.request.image, torch.Tensor)
    assert isinstance(request.image, torch.Tensor)
    assert torch.equal(back.request.image, request.image)
    assert back == spec


def test_the_command_lines_job_options_reach_the_store(tmp_path: Path) -> None:
    """L77, L78: ``serve``'s --jobs-dir defaults to the state folder ($XDG_STATE_HOME, which
    the tests set per test), 'none' keeps jobs in memory, --checkpoint-every takes seconds or
    'never', --video-bytes bounds the MP4 bytes; --jobs-lease shares the folder (L79), as
    --ray does for a video model's replicas."""
    import argparse
    import os

    from omni_trio.cli._given import record_given, refuse_unused
    from omni_trio.cli._options import service_options, unused_options
    from omni_trio.cli._ray import _options as ray_options
    from omni_trio.cli._serve import add_serve_arguments
    from omni_trio.serve.jobs import DEFAULT_JOBS_LEASE_S

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    record_given(parser)
    options = service_options(parser.parse_args(["--model", "tiny-wan"]))
    state = Path(os.environ["XDG_STATE_HOME"])
    assert (options.jobs_dir, options.checkpoint_every_s) == (
        str(state / "omni-trio" / "jobs"),
        30.0,
    )
    args = ["--model", "tiny-wan", "--jobs-dir", "none", "--checkpoint-every", "never"]
    options = service_options(parser.parse_args([*args, "--video-bytes", "1000"]))
    assert (options.jobs_dir, options.checkpoint_every_s, options.video_bytes) == (None, None, 1000)
    options = service_options(parser.parse_args(["--model", "tiny-wan", "--jobs-lease", "4"]))
    assert options.jobs_lease_s == 4.0
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "tiny-wan", "--jobs-lease", "0"])
    # Under --ray (L79) the replicas of a video model share the folder, 10 s leases by default;
    # an image model's replicas keep nothing.
    ray = ["--ray", "--ray-address", "127.0.0.1:1", "--jobs-dir", str(tmp_path)]
    for model, folder, lease in (
        ("tiny-wan", str(tmp_path), DEFAULT_JOBS_LEASE_S),
        ("tiny-sd", None, None),
    ):
        given = parser.parse_args(["--model", model, *ray])
        refuse_unused(given, unused_options(given), from_environment=())  # none refused
        options = ray_options(given)
        assert (options.jobs_dir, options.jobs_lease_s) == (folder, lease)
