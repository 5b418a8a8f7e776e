"""The result cache over HTTP (L95, L96): a repeat's answer says it was a hit, /metrics
counts what the cache did.

Determinism: an instant fake runner in-process (httpx's ASGI transport), requests one
after another; whether one ran is read from the runner's counters. Each test has a
hang budget.
"""

from __future__ import annotations

import anyio
import pytest

import omni_trio as ot
from omni_trio.serve import Service
from tests.support.core import BUDGET
from tests.support.serve import PATH, make_service, metric, parse_sse, serving

HEADER = "x-omni-trio-result-cache"


def cached_service() -> tuple[Service, ot.testing.FakeRunner]:
    return make_service(result_cache=ot.ResultCache(max_bytes=1 << 20))


@pytest.mark.anyio
async def test_a_repeat_over_http_is_answered_as_a_hit_and_metrics_count_it() -> None:
    """L95, L96: a seeded repeat's answer carries ``x-omni-trio-result-cache: hit`` and
    ``omni_trio.result_cache_hit``, with the first answer's image; streamed, it sends no
    progress or partial image, only its completed event; an unseeded request never hits;
    /metrics counts the hits, the misses, the outputs kept and the bytes held."""
    service, runner = cached_service()
    body = {"prompt": "a flower", "seed": 7}
    with anyio.fail_after(BUDGET):
        async with serving(service) as client:
            first = await client.post(PATH, json=body)
            second = await client.post(PATH, json=body)
            streamed = await client.post(PATH, json={**body, "stream": True, "partial_images": 2})
            fresh = await client.post(PATH, json={**body, "seed": 8, "stream": True})
            unseeded = [await client.post(PATH, json={"prompt": "a flower"}) for _ in range(2)]
            text = (await client.get("/metrics")).text
    assert [r.status_code for r in (first, second, streamed, fresh, *unseeded)] == [200] * 6
    assert HEADER not in first.headers and second.headers[HEADER] == "hit"
    assert first.json()["omni_trio"]["result_cache_hit"] is False
    assert second.json()["omni_trio"]["result_cache_hit"] is True
    # A runner without a prompt cache, and a hit, which encoded nothing (L94).
    assert [r.json()["omni_trio"]["prompt_cache"] for r in (first, second)] == [None, None]
    assert second.json()["data"] == first.json()["data"]
    assert streamed.headers[HEADER] == "hit" and HEADER not in fresh.headers
    events = parse_sse(streamed.text)
    assert [name for name, _ in events] == ["image_generation.completed"]
    assert events[0][1]["b64_json"] == first.json()["data"][0]["b64_json"]
    assert "image_generation.progress" in [name for name, _ in parse_sse(fresh.text)]
    assert not any(HEADER in r.headers for r in unseeded)
    assert runner.prepares == 4
    assert metric(text, "omni_trio_result_cache_hits_total") == 2
    assert metric(text, "omni_trio_result_cache_misses_total") == 2
    assert metric(text, "omni_trio_result_cache_kept_total") == 2
    assert metric(text, "omni_trio_result_cache_entries") == 2
    assert metric(text, "omni_trio_result_cache_bytes") == 2 * 64 * 64 * 3 * 4
    assert metric(text, "omni_trio_requests_total", outcome="completed") == 6


@pytest.mark.anyio
async def test_a_server_without_a_result_cache_exports_none_of_its_series() -> None:
    """L95: the result cache's series are there only when the engine has one."""
    service, _ = make_service()
    with anyio.fail_after(BUDGET):
        async with serving(service) as client:
            response = await client.post(PATH, json={"prompt": "a flower", "seed": 7})
            text = (await client.get("/metrics")).text
    assert HEADER not in response.headers
    assert response.json()["omni_trio"]["result_cache_hit"] is False
    assert "omni_trio_result_cache" not in text
