"""SIGKILL the server during a video job (L77, L78): restarted on its folder, nothing is lost.

Determinism rules:
- the server is ``python -m omni_trio serve --model tiny-wan`` (random weights, one
  torch thread), checkpointing at every step (``--checkpoint-every 0``);
- each moment is reached through the store's test hook (``OMNI_TRIO_TEST_HOLD``): the
  process stops for good at that point and says so with a file in the folder; the
  test then kills it (SIGKILL): no sleep decides when;
- one job goes through every moment in turn, each restart on the same folder
  holding at the next one; the last restart runs it to its end, and its frames are
  compared with an uninterrupted run's (in-process, the same pipeline and request).
"""

from __future__ import annotations

import concurrent.futures
import functools
import io
import multiprocessing
import signal
import sqlite3
import threading
from pathlib import Path
from typing import Any

import anyio
import httpx
import numpy as np
import pytest
import torch

from omni_trio.runners import DiffusersRunner, tiny_pipeline
from omni_trio.serve import ServeConfig, Service, VideoConfig
from omni_trio.serve.jobs import HOLD_VARIABLE
from tests.support.core import BUDGET
from tests.support.serve import poll_until, run_server

BODY = {"prompt": "a red fox", "num_frames": 5, "size": "32x32", "num_inference_steps": 6,
        "guidance_scale": 5.0, "seed": 3}  # fmt: skip
ARGS = ("--model", "tiny-wan", "--torch-threads", "1", "--checkpoint-every", "0")


def frames(data: bytes) -> np.ndarray[Any, Any]:
    import av

    with av.open(io.BytesIO(data), mode="r") as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])


def rows(folder: Path) -> list[tuple[str, str, int | None]]:
    with sqlite3.connect(folder / "jobs.sqlite3") as db:
        return list(db.execute("SELECT id, status, checkpoint_step FROM jobs ORDER BY seq"))


def held(folder: Path, point: str) -> bool:
    return (folder / f"held-{point.replace(':', '-')}").exists()


def uninterrupted() -> bytes:
    """The MP4 of the job on a service that nothing interrupts, in a fresh process as the
    server is: this process's state after other tests (torch's threads, an attention
    backend a parallel group left set) must not change the frames the codec sees."""
    spawn = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=spawn) as pool:
        return pool.submit(_uninterrupted_here).result(timeout=BUDGET)


def _uninterrupted_here() -> bytes:
    torch.set_num_threads(1)  # as the server's --torch-threads 1

    async def run() -> bytes:
        service = Service(
            DiffusersRunner(tiny_pipeline("wan", seed=0)),
            config=ServeConfig(model_name="tiny-wan", default_width=32, default_height=32),
            video_config=VideoConfig(fps=16.0),
        )
        with anyio.fail_after(BUDGET):
            return await follow(service)

    async def follow(service: Service) -> bytes:
        transport = httpx.ASGITransport(app=service.app)
        async with (
            service.lifespan(),
            httpx.AsyncClient(transport=transport, base_url="http://t") as client,
        ):
            job = (await client.post("/v1/videos", json=BODY)).json()
            while (await client.get(f"/v1/videos/{job['id']}")).json()["status"] != "completed":
                await anyio.sleep(0.01)
            return (await client.get(f"/v1/videos/{job['id']}/content")).content

    return anyio.run(run)


@pytest.mark.slow
@pytest.mark.timeout(480)  # five server starts of tiny Wan, 10 to 30 s each on 2 cores
@pytest.mark.usefixtures("one_torch_thread")
def test_sigkill_at_every_moment_of_a_job_loses_nothing_and_serves_no_half_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """L77, L78: SIGKILL after the job's record is written (its POST unanswered), after its
    checkpoint of step 2 (or later), with its output made but not encoded, and with its MP4
    half-written (a temporary file, never renamed): after each restart on the same folder the job is
    there once, never completed early, and the last restart completes it: one job, its
    frames those of an uninterrupted run, no temporary file left."""
    folder = tmp_path / "jobs"
    args = (*ARGS, "--jobs-dir", str(folder))
    posted: list[BaseException | httpx.Response] = []

    def post(url: str) -> None:
        try:
            posted.append(httpx.post(f"{url}/v1/videos", json=BODY, timeout=60))
        except httpx.HTTPError as exc:
            posted.append(exc)

    for index, point in enumerate(["admitted", "checkpoint:2", "encode", "write"]):
        monkeypatch.setenv(HOLD_VARIABLE, point)
        server = "hypercorn" if index % 2 else "uvicorn"
        with run_server(*args, server=server, log_dir=tmp_path) as handle:
            if point == "admitted":
                thread = threading.Thread(target=post, args=(handle.url,))
                thread.start()
            reached = functools.partial(held, folder, point)
            poll_until(reached, timeout=60, what=f"the hold at {point}")
            handle.process.send_signal(signal.SIGKILL)
            handle.process.wait(timeout=30)
        if point == "admitted":
            thread.join(timeout=60)
            assert isinstance(posted[0], httpx.HTTPError)  # never answered: killed first
        (job_id, status, step), *others = rows(folder)
        assert others == [] and status in ("queued", "in_progress"), (point, rows(folder))
        if point == "checkpoint:2":
            assert step is not None and step >= 2
        mp4s = list((folder / "videos").iterdir())
        if point == "write":
            assert [p.name.startswith(f".{job_id}.mp4.") for p in mp4s] == [True]
        else:
            assert mp4s == []
    monkeypatch.delenv(HOLD_VARIABLE)
    with run_server(*args, server="uvicorn", log_dir=tmp_path) as handle:
        poll_until(
            lambda: httpx.get(f"{handle.url}/v1/videos/{job_id}").json()["status"] == "completed",
            timeout=60,
            what="the job to complete",
        )
        listed = httpx.get(f"{handle.url}/v1/videos").json()["data"]
        content = httpx.get(f"{handle.url}/v1/videos/{job_id}/content", timeout=30).content
        log = handle.log_text()
    assert [job["id"] for job in listed] == [job_id]
    assert "is refused" not in log
    assert [p.name for p in (folder / "videos").iterdir()] == [f"{job_id}.mp4"]
    assert list((folder / "checkpoints").iterdir()) == []
    ours, theirs = frames(content), frames(uninterrupted())
    assert ours.shape == theirs.shape == (5, 32, 32, 3)
    assert np.abs(ours.astype(int) - theirs.astype(int)).max() <= 2
