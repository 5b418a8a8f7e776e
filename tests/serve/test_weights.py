"""The weights over HTTP (L102, L103): ``/v1/weights``, ``/v1/sleep``, ``/v1/wake``.

The in-process app inside its lifespan, on trio and asyncio, over a tiny Flux made fresh
for each test (an update changes it); the update's file is another tiny Flux's
transformer, saved in the adapter folder. Images are compared as the PNG bytes the
server answers (a seed gives one image).
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from safetensors.torch import save_file

from omni_trio.runners import DiffusersRunner, tiny_pipeline
from omni_trio.serve import ServeConfig, Service
from tests.support.core import BUDGET
from tests.support.serve import PATH, serving

pytestmark = pytest.mark.anyio

BODY = {"prompt": "a red flower", "size": "64x64", "num_inference_steps": 2, "seed": 3}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The adapter folder: ``new.safetensors`` (seed 1's transformer), ``bad.safetensors``
    (a tensor of no such name), and ``outside.safetensors`` next to it."""
    root = tmp_path_factory.mktemp("served")
    inside = root / "adapters"
    inside.mkdir()
    state = tiny_pipeline("flux", seed=1).transformer.state_dict()
    save_file({name: t.contiguous() for name, t in state.items()}, str(inside / "new.safetensors"))
    save_file({"no_such.weight": state["proj_out.bias"]}, str(inside / "bad.safetensors"))
    save_file({"proj_out.bias": state["proj_out.bias"]}, str(root / "outside.safetensors"))
    return inside


def service(folder: Path, *, admin: bool = True) -> Service:
    config = ServeConfig(
        model_name="tiny-flux",
        default_width=64,
        default_height=64,
        default_steps=2,
        allow_adapter_admin=admin,
        adapter_dir=str(folder) if admin else None,
    )
    return Service(DiffusersRunner(tiny_pipeline("flux")), config=config)


async def image(client: httpx.AsyncClient) -> bytes:
    response = await client.post(PATH, json=BODY)
    assert response.status_code == 200, response.text
    return base64.b64decode(response.json()["data"][0]["b64_json"])


def error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    found: dict[str, Any] = response.json()["error"]
    return found


async def test_an_update_from_the_folder_changes_the_weights_and_names_its_version(
    folder: Path,
) -> None:
    """L102: ``POST /v1/weights`` with a file of the adapter folder updates the weights
    (the images change) and answers the version with its label; a file out of the folder
    and one that fits nothing are 400s, and change nothing."""
    with anyio.fail_after(BUDGET):
        async with serving(service(folder)) as client:
            before = await image(client)
            shown = (await client.get("/v1/weights")).json()
            assert shown == {"object": "weights", "version": 0, "label": None, "sleep_level": 0}
            outside = await client.post("/v1/weights", json={"path": "../outside.safetensors"})
            assert error(outside, 400)["param"] == "path"
            bad = await client.post("/v1/weights", json={"path": "bad.safetensors"})
            assert error(bad, 400)["code"] == "weights_invalid"
            assert "no_such.weight" in error(bad, 400)["message"]
            unknown = await client.post("/v1/weights", json={"path": "x", "when": "now"})
            assert error(unknown, 400)["code"] == "unknown_parameter"
            policy = await client.post(
                "/v1/weights", json={"path": "new.safetensors", "policy": "x"}
            )
            assert error(policy, 400)["param"] == "policy"
            assert await image(client) == before
            updated = await client.post(
                "/v1/weights", json={"path": "new.safetensors", "label": "step-1"}
            )
            assert updated.status_code == 200, updated.text
            assert updated.json() == {
                "object": "weights",
                "version": 1,
                "label": "step-1",
                "sleep_level": 0,
            }
            assert await image(client) != before


async def test_a_sleep_that_refuses_answers_503_until_the_wake(folder: Path) -> None:
    """L103: ``POST /v1/sleep`` with ``refuse`` frees the weights (its answer says how many
    bytes); meanwhile a generation is a 503 ``sleeping`` with ``Retry-After`` and an update
    a 409; ``POST /v1/wake`` brings them back and the same request gives the same image."""
    with anyio.fail_after(BUDGET):
        async with serving(service(folder)) as client:
            before = await image(client)
            slept = await client.post("/v1/sleep", json={"level": 1, "refuse": True})
            assert slept.status_code == 200, slept.text
            assert slept.json()["object"] == "sleep" and slept.json()["offloaded_bytes"] > 0
            refused = await client.post(PATH, json=BODY)
            assert error(refused, 503)["code"] == "sleeping"
            assert refused.headers["retry-after"]
            update = await client.post("/v1/weights", json={"path": "new.safetensors"})
            assert error(update, 409)["code"] == "engine_asleep"
            assert (await client.get("/v1/weights")).json()["sleep_level"] == 1
            woken = await client.post("/v1/wake")
            assert woken.status_code == 200 and woken.json()["level"] == 1
            assert await image(client) == before
            bad_level = await client.post("/v1/sleep", json={"level": 3})
            assert error(bad_level, 400)["param"] == "level"


async def test_the_weights_routes_are_admin_actions(folder: Path) -> None:
    """L102, L103 (L88): without ``allow_adapter_admin`` an update, a sleep and a wake are
    403s; reading the version is not an admin action."""
    with anyio.fail_after(BUDGET):
        async with serving(service(folder, admin=False)) as client:
            for path, body in (
                ("/v1/weights", {"path": "new.safetensors"}),
                ("/v1/sleep", {}),
                ("/v1/wake", {}),
            ):
                response = await client.post(path, json=body)
                assert error(response, 403)["code"] == "admin_not_allowed", path
            assert (await client.get("/v1/weights")).json()["version"] == 0
