"""Step caching over HTTP (L84): the body's ``cache``, the server's default, ``/metrics``.

The in-process app inside its lifespan, on trio and asyncio: a ``FakeRunner`` that
declares ``step_cache`` (it keeps the policy and reports every row-call computed)
where only the plumbing matters, tiny Flux where skips must be counted, a runner
without a step cache for the refusals.
"""

from __future__ import annotations

import io
import json
from typing import Any

import anyio
import httpx
import pytest
from PIL import Image

import omni_trio as ot
from omni_trio.serve import ServeConfig, Service
from omni_trio.serve._options import OptionError, ServiceOptions, build_service
from omni_trio.testing import FakeRunner
from tests.support.core import BUDGET
from tests.support.serve import PATH, make_service, metric, serving

pytestmark = pytest.mark.anyio


async def cache_counts(client: httpx.AsyncClient) -> dict[str, float]:
    text = (await client.get("/metrics")).text
    return {
        f"{what}_{decision}": metric(text, f"omni_trio_cache_{what}_total", decision=decision)
        for what in ("calls", "blocks")
        for decision in ("computed", "skipped")
    } | {"loosened": metric(text, "omni_trio_cache_loosened_total")}


@pytest.mark.parametrize(
    "policy", ["first-block:0.2", {"kind": "taylorseer", "interval": 2}, "none"]
)
async def test_the_body_takes_a_policy_as_text_or_an_object(policy: object) -> None:
    """L84: ``cache`` (``"KIND[:THRESHOLD]"`` or the policy's fields) reaches the engine;
    /metrics sums each cached request's row-calls and row-blocks (none for ``"none"``).
    """
    service, _ = make_service(FakeRunner(step_cache=True))
    with anyio.fail_after(BUDGET):
        async with serving(service) as client:
            response = await client.post(PATH, json={"prompt": "a cat", "cache": policy})
            assert response.status_code == 200, response.text
            counts = await cache_counts(client)
    computed = 0.0 if policy == "none" else 4.0  # 4 steps, one row, nothing skipped
    assert counts == {
        "calls_computed": computed,
        "calls_skipped": 0.0,
        "blocks_computed": computed,
        "blocks_skipped": 0.0,
        "loosened": 0.0,
    }


@pytest.mark.parametrize(
    ("policy", "message"),
    [
        ("fast", "cache: kind: must be one of"),
        ("first-block:x", "cache: text: after ':' comes a threshold"),
        ({"kind": "first-block", "interval": 2}, "cache: interval: does not apply"),
        ({"threshold": 0.1}, "cache: kind: is required"),
        ({"kind": "first-block", "threshold": "0.1"}, "cache: threshold: must be a number"),
        ({"kind": "first-block", "\ud800": 1}, "cache: '\\ud800': unknown"),
        (3, "cache: must be"),
    ],
)
async def test_a_bad_policy_is_a_400_naming_cache(policy: object, message: str) -> None:
    """L52, L84: a policy that is not one is a 400 whose ``param`` is ``cache``."""
    service, runner = make_service(FakeRunner(step_cache=True))
    body = json.dumps({"prompt": "a cat", "cache": policy})  # ASCII: "\ud800" as an escape
    with anyio.fail_after(BUDGET):
        async with serving(service) as client:
            response = await client.post(PATH, content=body.encode())
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "cache", error
    assert message in error["message"], error["message"]
    assert runner.prepares == 0


async def test_a_model_without_a_step_cache_refuses_the_field_by_name() -> None:
    """L4, L84: a runner that applies no step cache answers a policy with a 400 naming it."""
    service, runner = make_service()
    with anyio.fail_after(BUDGET):
        async with serving(service) as client:
            response = await client.post(PATH, json={"prompt": "x", "cache": "first-block"})
            assert response.status_code == 400, response.text
            assert response.json()["error"]["param"] == "cache"
            fine = await client.post(PATH, json={"prompt": "x", "cache": "none"})
            assert fine.status_code == 200, fine.text
    assert runner.prepares == 1


async def test_videos_take_a_policy_as_json_and_in_a_form() -> None:
    """L84: ``/v1/videos`` carries ``cache`` to its request, from JSON and from a form."""
    runner = FakeRunner(step_cache=True, frames=(4, 1))
    service = Service(
        runner,
        engine_config=ot.EngineConfig(max_height=256, max_width=256),
        config=ServeConfig(model_name="fake", default_width=32, default_height=32, default_steps=3),
    )
    form = [("prompt", "a"), ("num_frames", "5"), ("cache", "taylorseer:2")]
    sends: list[dict[str, Any]] = [
        {"json": {"prompt": "a", "num_frames": 5, "cache": "first-block:0.3"}},
        {"files": [(name, (None, value)) for name, value in form]},  # multipart, text parts
    ]
    with anyio.fail_after(BUDGET):
        async with serving(service) as client:
            for send in sends:
                job = await client.post("/v1/videos", **send)
                assert job.status_code == 200, job.text
                video = job.json()["id"]
                while (await client.get(f"/v1/videos/{video}")).json()["status"] != "completed":
                    await anyio.sleep(0.01)
            counts = await cache_counts(client)
    assert counts["calls_computed"] == 6.0  # two jobs, 3 steps each


async def test_an_edit_form_carries_the_policy_to_its_model() -> None:
    """L84: ``/v1/images/edits`` takes ``cache`` as a form field; tiny SD (a UNet: no step
    cache) refuses it with a 400 naming it.
    """
    options = ServiceOptions(model="tiny-sd")
    image = io.BytesIO()
    Image.new("RGB", (64, 64), "red").save(image, format="PNG")
    form = [("prompt", (None, "a")), ("cache", (None, "first-block:0.1"))]
    form.append(("image", ("a.png", image.getvalue(), "image/png")))  # type: ignore[arg-type]
    with anyio.fail_after(BUDGET):
        async with serving(build_service(options)) as client:
            response = await client.post("/v1/images/edits", files=form)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "cache"
    assert "cannot apply a 'first-block' step cache" in response.json()["error"]["message"]


async def test_the_servers_default_applies_and_tiny_flux_counts_its_skips() -> None:
    """L80, L84: ``ServiceOptions``' ``engine_config.default_cache`` (``serve --cache``) is
    the policy of a body without one, checked against the model at build time; tiny Flux
    skips (threshold 0.6: its ratios are 0.2-0.5), and /metrics counts both decisions.
    """
    policy = ot.StepCache(kind="first-block", threshold=0.6)
    options = ServiceOptions(model="tiny-flux", engine_config=ot.EngineConfig(default_cache=policy))
    with anyio.fail_after(BUDGET):
        async with serving(build_service(options)) as client:
            response = await client.post(PATH, json={"prompt": "a cat", "seed": 1})
            assert response.status_code == 200, response.text
            counts = await cache_counts(client)
    steps = 20  # the tiny models' default
    assert counts["calls_computed"] + counts["calls_skipped"] == steps
    assert counts["calls_skipped"] > 0
    blocks = 2  # tiny Flux: one double block, one single block
    assert counts["blocks_computed"] == counts["calls_computed"] * blocks + counts["calls_skipped"]
    assert counts["blocks_skipped"] == counts["calls_skipped"] * (blocks - 1)


def test_a_default_the_model_cannot_apply_is_refused_when_the_service_is_built() -> None:
    """L80: a ``default_cache`` the model refuses fails ``build_service``, naming the option."""
    options = ServiceOptions(
        model="fake", engine_config=ot.EngineConfig(default_cache=ot.StepCache(kind="first-block"))
    )
    with pytest.raises(OptionError) as info:
        build_service(options)
    assert info.value.option == "default_cache"
    assert "cannot apply a 'first-block' step cache" in str(info.value)
