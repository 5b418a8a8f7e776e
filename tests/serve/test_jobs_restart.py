"""Durable jobs that come back after a restart (L77 amended): never refused again, told
everywhere, one job's failure its own, a store that cannot open one line.

Determinism rules:
- each "restart" is a second ``Service`` on the same ``jobs_dir`` after the first one's
  lifespan ended (shutdown cuts its running job, which stays as the store has it);
- the runners are ``FakeRunner(frames=(4, 1), checkpoints=True)``; a job cut by shutdown
  runs slow steps and the test waits until the store holds what it checks (a checkpoint,
  a step), then leaves: how far it got is read back from the store, never assumed;
- the step-time bound refuses by what the warm-up measured: fake steps sleep at least
  10 ms, over a bound of 1 ms however busy the machine.
"""

from __future__ import annotations

import errno
import logging
import sqlite3
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest

import omni_trio as ot
from omni_trio.runners import DiffusersRunner, tiny_lora, tiny_pipeline
from omni_trio.serve import ServeConfig, Service, VideoConfig
from omni_trio.serve.jobs import SqliteJobStore, StoreOpenError
from omni_trio.testing import FakeRunner
from tests.support.core import BUDGET
from tests.support.jobs import RULE, content, create, finished, service_on, serving, uninterrupted
from tests.support.serve import stored_rows

pytestmark = pytest.mark.anyio


async def _cut_after(folder: Path, *, steps: int, checkpoints: bool = True) -> str:
    """Create one 40-step job on a slow runner, leave once the store says it did ``steps``
    steps (and holds a checkpoint, if asked); return its id."""
    slow = FakeRunner(frames=RULE, checkpoints=True, step_seconds=0.02)
    service, _ = service_on(folder, slow, checkpoint_every_s=0.0 if checkpoints else None)
    async with serving(service) as client:
        job = await create(client, num_frames=5, num_inference_steps=40)
        while True:
            step, checkpoint_step = _progress(folder)
            if step >= steps and (checkpoint_step is not None or not checkpoints):
                return str(job["id"])
            await anyio.sleep(0.005)


def _progress(folder: Path) -> tuple[int, int | None]:
    """The one job's step and checkpoint step, as a second reader sees them now (WAL)."""
    with sqlite3.connect(folder / "jobs.sqlite3") as db:
        step, checkpoint_step = db.execute("SELECT step, checkpoint_step FROM jobs").fetchone()
    return int(step), checkpoint_step


async def test_an_accepted_job_runs_after_a_restart_whatever_the_estimate_says(
    tmp_path: Path,
) -> None:
    """L77 (amended), L4: after a restart, a job the first server accepted runs from its
    checkpoint to completion, though this server's step-time bound refuses a new job of
    the same size (its warm-up measured steps over ``max_step_s``)."""
    with anyio.fail_after(BUDGET):
        job_id = await _cut_after(tmp_path, steps=2)
        fresh = FakeRunner(frames=RULE, checkpoints=True, step_seconds=0.01)
        service, _ = service_on(tmp_path, fresh, max_step_s=0.001, warm_up=True)
        async with serving(service) as client:
            refused = await client.post(
                "/v1/videos", json={"prompt": "a fox", "num_frames": 5, "seed": 1}
            )
            assert refused.status_code == 400, refused.text
            assert "max_step_s" in refused.json()["error"]["message"]
            end = await finished(client, job_id)
            mp4 = await content(client, job_id)
        assert end["status"] == "completed", end
        assert fresh.restores == 1
    assert mp4 == await uninterrupted(num_frames=5, num_inference_steps=40)


async def test_a_resumed_job_is_logged_shown_and_counted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """L77 (amended): a job run again after a restart is one log line (its id, the step it
    resumes from, the steps lost), its body says so, and /metrics counts it; a job with no
    checkpoint runs from step 0 and loses every step it had done."""
    with anyio.fail_after(BUDGET):
        job_id = await _cut_after(tmp_path, steps=3, checkpoints=False)
        [row] = await stored_rows(tmp_path)
        assert row.checkpoint_step is None and row.step >= 3
        lost = row.step
        service, _ = service_on(tmp_path, FakeRunner(frames=RULE, checkpoints=True))
        with caplog.at_level(logging.INFO, logger="omni_trio.serve"):
            async with serving(service) as client:
                end = await finished(client, job_id)
                metrics = (await client.get("/metrics")).text
    line = f"video job {job_id} runs again from step 0 of 40 (no checkpoint; {lost} steps lost)"
    assert [r.getMessage() for r in caplog.records].count(line) == 1
    assert end["status"] == "completed"
    resumed = {k: end["omni_trio"][k] for k in ("resumes", "resumed_from_step", "steps_lost")}
    assert resumed == {"resumes": 1, "resumed_from_step": 0, "steps_lost": lost}
    assert "omni_trio_video_jobs_resumed_total 1.0" in metrics
    assert f"omni_trio_video_steps_lost_total {float(lost)}" in metrics
    [row] = await stored_rows(tmp_path)
    assert (row.resumes, row.resumed_from, row.steps_lost) == (1, 0, lost)


async def test_a_job_resumed_from_its_checkpoint_loses_only_the_steps_after_it(
    tmp_path: Path,
) -> None:
    """L77 (amended), L78: resumed from its checkpoint of step k, a job loses the steps it
    did after k; its body names k."""
    with anyio.fail_after(BUDGET):
        job_id = await _cut_after(tmp_path, steps=2)
        [row] = await stored_rows(tmp_path)
        assert row.checkpoint_step is not None
        service, _ = service_on(tmp_path, FakeRunner(frames=RULE, checkpoints=True))
        async with serving(service) as client:
            end = await finished(client, job_id)
    assert end["omni_trio"]["resumed_from_step"] == row.checkpoint_step
    assert end["omni_trio"]["steps_lost"] == row.step - row.checkpoint_step


async def test_a_job_this_server_cannot_run_fails_in_one_line_naming_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """L77 (amended): a job the restarted server's model cannot take (here its frame rule
    refuses the job's 5 frames) is not refused by an estimate but by a field: it fails
    with the engine's reason, said in one log line naming the job, and the server answers
    on; nothing of it runs."""
    with anyio.fail_after(BUDGET):
        job_id = await _cut_after(tmp_path, steps=2)
        other = FakeRunner(frames=(8, 1), checkpoints=True)
        service, _ = service_on(tmp_path, other)
        with caplog.at_level(logging.INFO, logger="omni_trio.serve"):
            async with serving(service) as client:
                end = await finished(client, job_id)
                later = await create(client, num_frames=9)
                assert (await finished(client, later["id"]))["status"] == "completed"
    assert end["status"] == "failed"
    assert end["error"]["message"].startswith("num_frames: "), end
    lines = [r for r in caplog.records if r.getMessage().startswith(f"video job {job_id} ")]
    assert [(r.levelno, r.getMessage().count("\n")) for r in lines] == [(logging.ERROR, 0)]
    said = f"video job {job_id} cannot run again after the restart: num_frames: "
    assert lines[0].getMessage().startswith(said)
    assert lines[0].exc_info is None
    assert other.restores == 0 and other.prepares == 1  # the later job only


async def test_a_failed_mp4_write_fails_that_job_only_and_the_server_answers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """L77 (amended): a full disk when the MP4 is written fails that job (``storage_error``,
    one log line), not the server: the next job completes, and the server stops cleanly."""
    real_write = SqliteJobStore._write
    failing = {"left": 1}

    def write(self: SqliteJobStore, path: Path, data: bytes, **kwargs: object) -> None:
        if path.suffix == ".mp4" and failing["left"]:
            failing["left"] -= 1
            raise OSError(errno.ENOSPC, "No space left on device")
        real_write(self, path, data, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(SqliteJobStore, "_write", write)
    with anyio.fail_after(BUDGET):
        service, _ = service_on(tmp_path)
        with caplog.at_level(logging.ERROR, logger="omni_trio.serve"):
            async with serving(service) as client:
                first = await finished(client, (await create(client, num_frames=5))["id"])
                second = await finished(client, (await create(client, num_frames=5))["id"])
                assert (await client.get("/health")).status_code == 200
    assert first["status"] == "failed"
    assert first["error"]["code"] == "storage_error", first
    assert second["status"] == "completed"
    lines = [r.getMessage() for r in caplog.records if first["id"] in r.getMessage()]
    assert lines == [
        f"video job {first['id']} fails: the store cannot keep its video (No space left on device)"
    ]
    rows = {row.id: row for row in await stored_rows(tmp_path)}
    assert rows[first["id"]].status == "failed"


async def test_a_store_that_cannot_open_says_why_and_holds_nothing(tmp_path: Path) -> None:
    """L4 (amended), L77: a corrupt database, a folder that is a file: one error naming the
    cause; the folder's lock is let go, so the next open (once mended) works."""
    folder = tmp_path / "jobs"
    folder.mkdir()
    (folder / "jobs.sqlite3").write_bytes(b"not a database, " * 512)
    store = SqliteJobStore(folder)
    with pytest.raises(StoreOpenError, match=r"jobs\.sqlite3 cannot be read: file is not a"):
        await anyio.to_thread.run_sync(store.open)
    (folder / "jobs.sqlite3").unlink()
    again = SqliteJobStore(folder)
    assert await anyio.to_thread.run_sync(again.open) == []
    again.close()
    plain = tmp_path / "plain"
    plain.write_text("a file")
    with pytest.raises(StoreOpenError, match="cannot be used: File exists"):
        await anyio.to_thread.run_sync(SqliteJobStore(plain).open)


async def test_a_checkpoint_that_cannot_be_read_is_refused_and_the_job_runs_from_step_0(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """L77, L78: a directory where a job's checkpoint should be is refused as a corrupt one
    is (one log line naming the job), and the job runs from step 0 to completion."""
    with anyio.fail_after(BUDGET):
        job_id = await _cut_after(tmp_path, steps=2)
        path = tmp_path / "checkpoints" / f"{job_id}.ckpt"
        path.unlink()
        path.mkdir()
        fresh = FakeRunner(frames=RULE, checkpoints=True)
        service, _ = service_on(tmp_path, fresh)
        with caplog.at_level(logging.WARNING, logger="omni_trio.serve"):
            async with serving(service) as client:
                end = await finished(client, job_id)
    assert end["status"] == "completed"
    assert (fresh.restores, fresh.steps_run) == (0, 40)
    assert any(
        job_id in r.getMessage() and "cannot be read" in r.getMessage() for r in caplog.records
    )


class _SlowWan(DiffusersRunner):
    """Tiny Wan with an ``ink`` adapter, each step at least 20 ms (so a test can leave
    mid-job); the pipeline of seed 0, as every run here."""

    def __init__(self, lora: Path) -> None:
        super().__init__(tiny_pipeline("wan", seed=0))
        self.load_adapter("ink", lora)

    def step(self, states: Sequence[Any]) -> None:
        time.sleep(0.02)
        super().step(states)


def _wan_service(runner: DiffusersRunner, folder: Path | None) -> Service:
    return Service(
        runner,
        engine_config=ot.EngineConfig(shutdown_grace=0.0),
        config=ServeConfig(model_name="tiny-wan", default_width=32, default_height=32),
        video_config=VideoConfig(fps=16.0, jobs_dir=folder, checkpoint_every_s=0.0),
    )


async def test_a_job_with_adapters_resumes_from_its_checkpoint_with_them(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """L77 (amended), L78, L85: a durable job naming an adapter keeps it across a restart:
    the store gives back the very request, so its checkpoint is restored (not refused as
    another request's) and its video equals an uninterrupted run's with the adapter."""
    lora = tiny_lora(tiny_pipeline("wan", seed=0), tmp_path / "adapters", "ink", seed=1)
    body = {"prompt": "a fox", "num_frames": 5, "num_inference_steps": 30, "seed": 2,
            "adapters": {"ink": 1.0}}  # fmt: skip
    folder = tmp_path / "jobs"
    with anyio.fail_after(BUDGET):
        async with serving(_wan_service(_SlowWan(lora), folder)) as client:
            job = await create(client, **body)
            while _progress(folder)[1] is None:
                await anyio.sleep(0.005)
        with caplog.at_level(logging.INFO):
            async with serving(_wan_service(_SlowWan(lora), folder)) as client:
                end = await finished(client, job["id"])
                mp4 = await content(client, job["id"])
        async with serving(_wan_service(_SlowWan(lora), None)) as client:
            alone_job = await finished(client, (await create(client, **body))["id"])
            alone = await content(client, alone_job["id"])
    assert end["status"] == "completed" and end["omni_trio"]["resumed_from_step"] > 0, end
    assert not [r for r in caplog.records if "refused" in r.getMessage()]
    assert mp4 == alone
