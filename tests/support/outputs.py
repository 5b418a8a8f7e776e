"""Outputs as signed URLs' helpers (L97): a service with an output store, its URLs read."""

from __future__ import annotations

import urllib.parse
from pathlib import Path
from typing import Any

import httpx

import omni_trio as ot
from omni_trio.serve import ApiKeys, OutputConfig, ServeConfig, Service, VideoConfig
from omni_trio.testing import FakeRunner

PATH = "/v1/images/generations"
SECRET = b"a secret the replicas share, 32+"
START = 1_800_000_000.0


class WallClock:
    """Seconds since the epoch that move only when the test says."""

    def __init__(self, now: float = START) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def outputs(folder: Path, clock: WallClock, **fields: Any) -> OutputConfig:
    fields = {"secret": SECRET, "ttl_s": 60.0, **fields}
    return OutputConfig(store=folder, clock=clock, **fields)


def image_service(
    output: OutputConfig | None, *, keys: ApiKeys | None = None, **video: Any
) -> Service:
    """A fake image model at 16x16, 2 steps; a video model with ``video``'s config."""
    config = ServeConfig(
        model_name="fake", default_width=16, default_height=16, default_steps=2, outputs=output
    )
    runner = FakeRunner(frames=(4, 1)) if video else FakeRunner()
    return Service(
        runner,
        engine_config=ot.EngineConfig(max_height=64, max_width=64, shutdown_grace=0.0),
        config=config,
        keys=keys,
        video_config=VideoConfig(fps=8.0, **video) if video else None,
    )


def files_in(folder: Path) -> list[str]:
    """Every file under ``folder``, hidden (temporary) ones too, as keys."""
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


def local(url: str) -> str:
    """The path and query of ``url`` (the in-process client's base is its host)."""
    parts = urllib.parse.urlsplit(url)
    return f"{parts.path}?{parts.query}"


def with_query(url: str, **changes: str | None) -> str:
    """``url`` with query parameters changed (``None``: removed)."""
    parts = urllib.parse.urlsplit(url)
    query = dict(urllib.parse.parse_qsl(parts.query))
    for name, value in changes.items():
        if value is None:
            query.pop(name, None)
        else:
            query[name] = value
    return f"{parts.path}?{urllib.parse.urlencode(query)}"


async def generate(client: httpx.AsyncClient, **body: Any) -> list[dict[str, str]]:
    response = await client.post(PATH, json={"prompt": "a fox", "seed": 3, **body})
    assert response.status_code == 200, response.text
    data: list[dict[str, str]] = response.json()["data"]
    return data


def error_of(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    error: dict[str, Any] = response.json()["error"]
    return error
