"""Durable video jobs' helpers (L77-L79): a video service on a folder, its jobs over HTTP."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx

import omni_trio as ot
from omni_trio.serve import ServeConfig, Service, VideoConfig
from omni_trio.testing import FakeRunner

RULE = (4, 1)
FPS = 8.0
SIZE = 16


def service_on(
    folder: Path | None,
    runner: FakeRunner | None = None,
    *,
    max_step_s: float | None = 30.0,
    warm_up: bool = False,
    **video: Any,
) -> tuple[Service, FakeRunner]:
    """A video service keeping its jobs in ``folder`` (``None``: in ``video``'s ``store``);
    checkpoints at every step."""
    runner = runner if runner is not None else FakeRunner(frames=RULE, checkpoints=True)
    video.setdefault("checkpoint_every_s", 0.0)
    config = ServeConfig(
        model_name="fake-video",
        default_width=SIZE,
        default_height=SIZE,
        default_steps=4,
        warm_up=warm_up,
    )
    service = Service(
        runner,
        engine_config=ot.EngineConfig(
            max_height=64, max_width=64, shutdown_grace=0.0, max_step_s=max_step_s
        ),
        config=config,
        video_config=VideoConfig(fps=FPS, jobs_dir=folder, **video),
    )
    return service, runner


@asynccontextmanager
async def serving(service: Service) -> AsyncIterator[httpx.AsyncClient]:
    """Run the service's lifespan; yield a client that calls it in-process."""
    transport = httpx.ASGITransport(app=service.app)
    async with (
        service.lifespan(),
        httpx.AsyncClient(transport=transport, base_url="http://test") as client,
    ):
        yield client


async def create(client: httpx.AsyncClient, **body: Any) -> dict[str, Any]:
    """Create a job (seed 1 unless ``body`` says otherwise); its JSON."""
    response = await client.post("/v1/videos", json={"prompt": "a fox", "seed": 1, **body})
    assert response.status_code == 200, response.text
    job: dict[str, Any] = response.json()
    return job


async def finished(client: httpx.AsyncClient, job_id: str) -> dict[str, Any]:
    """Poll the job until it completed or failed (the hang budget bounds it)."""
    while True:
        job: dict[str, Any] = (await client.get(f"/v1/videos/{job_id}")).json()
        if job["status"] in ("completed", "failed"):
            return job
        await anyio.sleep(0.001)


async def content(client: httpx.AsyncClient, job_id: str) -> bytes:
    response = await client.get(f"/v1/videos/{job_id}/content")
    assert response.status_code == 200, response.text
    return response.content


async def uninterrupted(**body: Any) -> bytes:
    """The MP4 of one job on a fresh in-memory service: what a resumed job must equal."""
    config = ServeConfig(
        model_name="fake-video", default_width=SIZE, default_height=SIZE, default_steps=4
    )
    service = Service(FakeRunner(frames=RULE), config=config, video_config=VideoConfig(fps=FPS))
    async with serving(service) as client:
        job = await create(client, **body)
        await finished(client, job["id"])
        return await content(client, job["id"])
