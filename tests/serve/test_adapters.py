"""Adapters over HTTP (L88): the body's ``adapters`` and ``lora``, ``/v1/models``,
``/v1/adapters`` as admin actions from one folder, ``--adapter`` at start.

The in-process app inside its lifespan, on trio and asyncio, over tiny Stable
Diffusion with tiny random LoRAs (``tests/support/adapters.py``).
"""

from __future__ import annotations

import base64
from functools import cache
from pathlib import Path
from typing import Any

import httpx
import pytest

from omni_trio.runners import DiffusersRunner, tiny_pipeline
from omni_trio.serve import ApiKey, ApiKeys, ServeConfig, Service
from omni_trio.serve._options import OptionError, ServiceOptions, build_service
from tests.support.adapters import make_lora
from tests.support.serve import PATH, serving

pytestmark = pytest.mark.anyio

BODY = {"prompt": "a red flower", "size": "64x64", "num_inference_steps": 2, "seed": 3}


@cache
def _pipe() -> Any:
    return tiny_pipeline("sd")


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The adapter folder: ``ink`` and ``film``, and ``outside/`` next to it."""
    root = tmp_path_factory.mktemp("served")
    inside = root / "adapters"
    inside.mkdir()
    make_lora(_pipe(), inside, "ink", seed=1)
    make_lora(_pipe(), inside, "film", seed=2)
    (root / "outside").mkdir()
    make_lora(_pipe(), root / "outside", "secret", seed=3)
    (inside / "link.safetensors").symlink_to(root / "outside" / "secret.safetensors")
    return inside


def service(
    folder: Path, *, admin: bool = False, load: bool = True, keys: ApiKeys | None = None
) -> Service:
    runner = DiffusersRunner(_pipe())
    if load:
        runner.load_adapter("ink", folder / "ink.safetensors")
    config = ServeConfig(
        model_name="tiny-sd",
        default_width=64,
        default_height=64,
        default_steps=2,
        allow_adapter_admin=admin,
        adapter_dir=str(folder) if admin else None,
    )
    return Service(runner, config=config, keys=keys)


async def image(client: httpx.AsyncClient, **fields: Any) -> bytes:
    response = await client.post(PATH, json={**BODY, **fields})
    assert response.status_code == 200, response.text
    return base64.b64decode(response.json()["data"][0]["b64_json"])


async def test_the_body_names_adapters_or_lora(folder: Path) -> None:
    """L88: ``adapters``, its text form and OpenAI-style ``lora`` give the same image;
    an unknown name, or both fields, are 400s naming the field."""
    async with serving(service(folder)) as client:
        plain = await image(client)
        inked = await image(client, adapters={"ink": 0.8})
        assert inked != plain
        assert await image(client, adapters="ink:0.8") == inked
        assert await image(client, lora=[{"name": "ink", "scale": 0.8}]) == inked
        for fields, param in (
            ({"adapters": {"nope": 1.0}}, "adapters"),
            ({"adapters": {"ink": 1.0}, "lora": {"ink": 1.0}}, "lora"),
            ({"adapters": "ink:x"}, "adapters"),
            ({"lora": [{"name": "ink", "weight": 1}]}, "lora"),
        ):
            response = await client.post(PATH, json={**BODY, **fields})
            assert response.status_code == 400, fields
            assert response.json()["error"]["param"] == param, response.text


async def test_models_list_the_loaded_adapters(folder: Path) -> None:
    """L88: ``/v1/models`` (and ``GET /v1/adapters``) list the adapters."""
    async with serving(service(folder)) as client:
        card = (await client.get("/v1/models")).json()["data"][0]
        assert [a["id"] for a in card["adapters"]] == ["ink"]
        assert card["adapters"][0]["loaded"] is True and card["adapters"][0]["bytes"] > 0
        listed = (await client.get("/v1/adapters")).json()["data"]
        assert [a["id"] for a in listed] == ["ink"]


async def test_admin_actions_are_off_by_default(folder: Path) -> None:
    """L88: without ``allow_adapter_admin``, loads and unloads are 403s."""
    async with serving(service(folder)) as client:
        response = await client.post(
            "/v1/adapters", json={"name": "film", "path": "film.safetensors"}
        )
        assert response.status_code == 403
        assert (await client.delete("/v1/adapters/ink")).status_code == 403
        assert [a["id"] for a in (await client.get("/v1/adapters")).json()["data"]] == ["ink"]


async def test_admin_loads_only_files_inside_the_folder(folder: Path) -> None:
    """L88: a load names a file in the adapter folder; ``..``, absolute paths and symlinks
    out of it are 400s; unload, then the name is unknown."""
    async with serving(service(folder, admin=True, load=False)) as client:
        outside = folder.parent / "outside" / "secret.safetensors"
        for path in ("../outside/secret.safetensors", str(outside), "link.safetensors", "ink.bin"):
            response = await client.post("/v1/adapters", json={"name": "x", "path": path})
            assert response.status_code == 400, path
            assert response.json()["error"]["param"] == "path"
        response = await client.post(
            "/v1/adapters", json={"name": "film", "path": "film.safetensors"}
        )
        assert response.status_code == 201, response.text
        assert response.json()["id"] == "film" and response.json()["loaded"] is True
        again = await client.post("/v1/adapters", json={"name": "film", "path": "film.safetensors"})
        assert again.status_code == 409
        await image(client, adapters={"film": 1.0})
        assert (await client.delete("/v1/adapters/film")).status_code == 200
        assert (await client.delete("/v1/adapters/film")).status_code == 404
        response = await client.post(PATH, json={**BODY, "adapters": {"film": 1.0}})
        assert response.status_code == 400


async def test_with_keys_only_an_admin_key_loads_and_unloads(folder: Path) -> None:
    """L88, L55: on a keyed server that allows admin actions, a tenant's key gets 403
    ``admin_required`` for a load and an unload, and changes nothing; an admin key loads
    and unloads."""
    keys = ApiKeys(
        keys=(
            ApiKey.of("sk-tenant-1", tenant="acme"),
            ApiKey.of("sk-admin-1", tenant="ops", admin=True),
        )
    )
    tenant = {"Authorization": "Bearer sk-tenant-1"}
    admin = {"Authorization": "Bearer sk-admin-1"}
    load = {"name": "film", "path": "film.safetensors"}
    async with serving(service(folder, admin=True, keys=keys)) as client:
        for response in (
            await client.post("/v1/adapters", json=load, headers=tenant),
            await client.delete("/v1/adapters/ink", headers=tenant),
        ):
            assert response.status_code == 403, response.text
            assert response.json()["error"]["code"] == "admin_required"
        listed = (await client.get("/v1/adapters", headers=tenant)).json()["data"]
        assert [a["id"] for a in listed] == ["ink"]
        assert (await client.post("/v1/adapters", json=load, headers=admin)).status_code == 201
        assert (await client.delete("/v1/adapters/film", headers=admin)).status_code == 200


async def test_adapters_load_at_start(folder: Path) -> None:
    """L88: ``ServiceOptions.adapters`` (``serve --adapter``) load into every runner;
    a model that takes none refuses them, naming ``adapters``."""
    options = ServiceOptions(model="tiny-sd", adapters=(("ink", str(folder / "ink.safetensors")),))
    built = build_service(options)
    async with serving(built) as client:
        assert [a["id"] for a in (await client.get("/v1/adapters")).json()["data"]] == ["ink"]
    with pytest.raises(OptionError) as caught:
        build_service(ServiceOptions(model="fake", adapters=(("ink", "x.safetensors"),)))
    assert caught.value.option == "adapters"
