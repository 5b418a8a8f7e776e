"""GET /metrics: the omni_trio series, the standard process and Python ones, no ``_created``.

The in-process app (``httpx.ASGITransport``) inside its own lifespan, on trio and
asyncio, with an instant ``FakeRunner`` and a hang budget.
"""

from __future__ import annotations

import dataclasses
import platform
import sys

import anyio
import httpx
import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import omni_trio as ot
from omni_trio.testing import FakeRunner, wait_until
from tests.support.core import BUDGET
from tests.support.serve import make_service, metric, serving

pytestmark = pytest.mark.anyio


async def scrape(client: httpx.AsyncClient) -> str:
    response = await client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain;")
    return response.text


async def test_metrics_have_the_standard_series_and_no_created_ones() -> None:
    """/metrics has omni_trio's, python_info's and python_gc's families, and no *_created."""
    with anyio.fail_after(BUDGET):
        async with serving(make_service()[0]) as client:
            response = await client.post("/v1/images/generations", json={"prompt": "a cat"})
            assert response.status_code == 200, response.text
            text = await scrape(client)
    families = {family.name: family for family in text_string_to_metric_families(text)}
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in families.values()
        for sample in family.samples
    }
    assert samples[("omni_trio_requests_total", (("outcome", "completed"),))] == 1.0
    assert samples[("omni_trio_queue_wait_seconds_count", ())] == 1.0
    implementation = platform.python_implementation()
    assert families["python_info"].samples[0].labels["implementation"] == implementation
    assert families["python_info"].samples[0].labels["major"] == str(sys.version_info.major)
    assert {"python_gc_objects_collected", "python_gc_collections"} <= set(families)
    assert [name for name, _ in samples if name.endswith("_created")] == []
    assert "_created" not in text
    # One process per worker: no parallel group, no group series.
    assert not {"omni_trio_group_ranks", "omni_trio_group_calls"} & set(families)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process_* reads /proc")
async def test_metrics_have_the_process_series() -> None:
    """On Linux, /metrics has the process collector's families, this process's own."""
    with anyio.fail_after(BUDGET):
        async with serving(make_service()[0]) as client:
            text = await scrape(client)
    families = {family.name for family in text_string_to_metric_families(text)}
    expected = {
        "process_cpu_seconds",
        "process_resident_memory_bytes",
        "process_virtual_memory_bytes",
        "process_start_time_seconds",
        "process_open_fds",
        "process_max_fds",
    }
    assert expected <= families


async def test_two_apps_and_the_process_keep_their_own_series() -> None:
    """Two apps in one process both serve the collectors; other registries keep _created."""
    with anyio.fail_after(BUDGET):
        async with serving(make_service()[0]) as first, serving(make_service()[0]) as second:
            texts = [await scrape(first), await scrape(second)]
    for text in texts:
        assert "python_info{" in text
        assert "_created" not in text
    # Nothing process-wide was switched off: another registry still exports _created.
    registry = CollectorRegistry()
    Counter("user_events", "A counter of the application's own.", registry=registry)
    assert b"user_events_created" in generate_latest(registry)


async def test_a_python_callers_requests_are_counted_as_the_routes_count_theirs() -> None:
    """``Service.generate`` (what a Ray Serve handle call runs on its replica) counts its
    requests in ``/metrics`` as the HTTP routes do: completed, refused by the engine
    (``invalid``), cancelled by the caller (``aborted``, once released), with their
    timings; a service that is not serving refuses with ``EngineClosedError``."""
    service, runner = make_service(FakeRunner(step_seconds=0.001))
    request = ot.GenerationRequest(prompt="a cat", num_steps=2, width=64, height=64)
    with pytest.raises(ot.EngineClosedError):
        await service.generate(request)
    with anyio.fail_after(BUDGET):
        async with serving(service) as client:
            output = await service.generate(request, request_id="py-1")
            assert output.metrics.steps_done == 2
            with pytest.raises(ot.InvalidRequestError):
                await service.generate(dataclasses.replace(request, height=4096))
            with anyio.move_on_after(BUDGET) as scope:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(service.generate, dataclasses.replace(request, num_steps=1000))
                    await wait_until(lambda: runner.steps_run >= 5, max_interval=0.02)
                    scope.cancel()
            assert runner.live_states == 0
            text = await scrape(client)
    counted = {
        outcome: metric(text, "omni_trio_requests_total", outcome=outcome)
        for outcome in ("completed", "invalid", "aborted")
    }
    assert counted == {"completed": 1.0, "invalid": 1.0, "aborted": 1.0}
    assert metric(text, "omni_trio_queue_wait_seconds_count") == 2.0
