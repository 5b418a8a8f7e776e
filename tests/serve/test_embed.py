"""The service mounted inside a host Starlette app, exactly as docs/serving.md shows.

In-process (httpx's ASGI transport), on trio and asyncio, the fake model, a hang budget.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import httpx
import pytest
from starlette.applications import Starlette
from starlette.routing import Mount

from omni_trio.serve import Service
from omni_trio.testing import FakeRunner, assert_engine_idle
from tests.support.core import BUDGET

pytestmark = pytest.mark.anyio

BODY = {"prompt": "a red flower", "num_inference_steps": 2}


def host_app(service: Service, *, enter: bool = True) -> Starlette:
    """The docs' example: the host's lifespan enters ``service.lifespan()``."""

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with service.lifespan():
            yield

    return Starlette(
        routes=[Mount("/images", app=service.app)], lifespan=lifespan if enter else None
    )


async def test_a_mounted_service_runs_in_the_host_apps_lifespan() -> None:
    """L50: mounted under /images, the service serves once the host's lifespan entered
    ``service.lifespan()``, and its engine is closed when the host's lifespan ends."""
    service = Service(FakeRunner())
    app = host_app(service)
    transport = httpx.ASGITransport(app=app)
    with anyio.fail_after(BUDGET):
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(transport=transport, base_url="http://host") as client,
        ):
            assert (await client.get("/images/health")).status_code == 200
            response = await client.post("/images/v1/images/generations", json=BODY)
            assert response.status_code == 200, response.text
            engine = service.engine
            assert engine is not None
        assert service.is_draining and engine.statistics().is_closing
        assert_engine_idle(engine)


async def test_a_mounted_service_whose_lifespan_never_ran_says_so_at_once() -> None:
    """A host that forgot ``service.lifespan()`` gets 503 ``not_started`` with a message
    that says what to do, at once (not "starting" forever); /health says the same."""
    service = Service(FakeRunner())
    app = host_app(service, enter=False)
    transport = httpx.ASGITransport(app=app)
    with anyio.fail_after(BUDGET):
        async with httpx.AsyncClient(transport=transport, base_url="http://host") as client:
            response = await client.post("/images/v1/images/generations", json=BODY)
            health = await client.get("/images/health")
    assert response.status_code == 503
    error = response.json()["error"]
    assert error["code"] == "not_started"
    assert "service.lifespan()" in error["message"]
    assert health.status_code == 503
    assert health.json()["status"] == "not_started"
    assert "service.lifespan()" in health.json()["message"]


async def test_the_lifespan_runs_once() -> None:
    """The engine closes the runner: a second lifespan is refused."""
    service = Service(FakeRunner())
    with anyio.fail_after(BUDGET):
        async with service.lifespan() as entered:
            assert entered is service and service.is_ready
        with pytest.raises(RuntimeError, match="runs once"):
            async with service.lifespan():
                pass
