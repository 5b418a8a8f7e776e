"""Adapters over HTTP (L88): the body's ``adapters`` and ``lora``, ``/v1/models``,
``/v1/adapters`` as admin actions from one folder, ``--adapter`` at start.

The in-process app inside its lifespan, on trio and asyncio, over tiny Stable
Diffusion with tiny random LoRAs (``omni_trio.runners.tiny_lora``); edits and video
jobs over ``Adapted``, a fake runner that knows three adapters, takes two a request,
and records the requests it prepares.
"""

from __future__ import annotations

import base64
import dataclasses
import io
import os
import threading
from collections.abc import Mapping
from functools import cache, partial
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from PIL import Image

import omni_trio as ot
from omni_trio.runners import DiffusersRunner, tiny_lora, tiny_pipeline
from omni_trio.serve import ApiKey, ApiKeys, ServeConfig, Service, VideoConfig
from omni_trio.serve._options import OptionError, ServiceOptions, build_service
from omni_trio.testing import FakeRunner, FakeState, wait_until
from tests.support.core import BUDGET
from tests.support.serve import PATH, PixelWork, serving

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
    tiny_lora(_pipe(), inside, "ink", seed=1)
    tiny_lora(_pipe(), inside, "film", seed=2)
    (root / "outside").mkdir()
    tiny_lora(_pipe(), root / "outside", "secret", seed=3)
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


async def test_a_symlink_loop_is_a_400_naming_path(tmp_path: Path) -> None:
    """L88: a path in the adapter folder that is a symlink loop is a 400 naming ``path``
    (resolving it raises; never a 500), and nothing is loaded."""
    (tmp_path / "loop.safetensors").symlink_to(tmp_path / "loop.safetensors")
    async with serving(service(tmp_path, admin=True, load=False)) as client:
        response = await client.post(
            "/v1/adapters", json={"name": "loop", "path": "loop.safetensors"}
        )
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "path"
        assert (await client.get("/v1/adapters")).json()["data"] == []


# -- edits and video jobs -------------------------------------------------------------


class Adapted(FakeRunner):
    """A FakeRunner that declares ``max_adapters`` 2 (and takes an input image, or makes
    videos), knows ``ink``, ``film`` and ``dust``, and records the requests it prepares."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.names = frozenset({"ink", "film", "dust"})
        self.prepared: list[ot.GenerationRequest] = []
        self._recording = threading.Lock()

    @property
    def capabilities(self) -> ot.abc.RunnerCapabilities:
        image = super().capabilities.frames is None
        return dataclasses.replace(super().capabilities, max_adapters=2, image_input=image)

    def prepare(self, request: ot.GenerationRequest, request_id: str) -> FakeState:
        with self._recording:
            self.prepared.append(request)
        return super().prepare(request, request_id)

    def load_adapter(self, name: str, source: str | os.PathLike[str] | Mapping[str, Any]) -> None:
        raise ot.AdapterError("this fake loads nothing", reason="invalid", name=name)

    def unload_adapter(self, name: str) -> None:
        raise ot.AdapterError("this fake unloads nothing", reason="in-use", name=name)

    def adapters(self) -> tuple[ot.AdapterInfo, ...]:
        return tuple(
            ot.AdapterInfo(name=name, bytes=8, holders=0, loaded=True, source=None)
            for name in sorted(self.names)
        )

    def adapter_names(self) -> frozenset[str]:
        return self.names


def prepared(runner: Adapted, count: int) -> bool:
    return len(runner.prepared) >= count


def png() -> bytes:
    data = io.BytesIO()
    Image.new("RGB", (64, 64), (200, 40, 40)).save(data, format="PNG")
    return data.getvalue()


#: Bad adapter fields of a form, as text (every value of a form is), each a 400 naming
#: ``adapters``: a scale that is no number, a name no runner has, more than
#: ``max_adapters``, a name that is no adapter's name.
BAD_FORM_ADAPTERS = ("ink:x", "nope:1", "ink,film:0.5,dust", "ink:1,:2")


async def test_an_edit_sends_its_adapters_to_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """L88, L4 (amended): an edit's form takes ``adapters`` (the text form) and ``lora``:
    the request the runner prepares names them with their scales; a bad one, an unknown
    name included, is a 400 naming it before its upload is decoded or resized, and
    nothing more reaches the runner."""
    runner = Adapted()
    config = ServeConfig(model_name="fake", default_width=64, default_height=64, default_steps=2)
    image = {"image": ("photo.png", png(), "image/png")}
    with anyio.fail_after(BUDGET):
        async with serving(Service(runner, config=config)) as client:
            for field, text, pairs in (
                ("adapters", "ink:0.8,film", (("ink", 0.8), ("film", 1.0))),
                ("lora", "film:-0.5", (("film", -0.5),)),
            ):
                form = {"prompt": "a cat", "strength": "0.5", field: text}
                response = await client.post("/v1/images/edits", data=form, files=image)
                assert response.status_code == 200, response.text
                assert runner.prepared[-1].adapter_pairs == pairs
                assert runner.prepared[-1].image is not None  # an edit indeed
            work = PixelWork(monkeypatch)
            for text in BAD_FORM_ADAPTERS:
                form = {"prompt": "a cat", "adapters": text, "size": "32x32"}
                response = await client.post("/v1/images/edits", data=form, files=image)
                assert response.status_code == 400, text
                assert response.json()["error"]["param"] == "adapters", response.text
                assert work.done == (0, 0), text
    assert len(runner.prepared) == 2


async def test_a_video_job_sends_its_adapters_to_the_engine() -> None:
    """L88, L4 (amended): a video job's JSON body (``adapters`` as a map or as text,
    ``lora`` as a list) and its form (``adapters`` as text) reach the engine with their
    scales; a bad one, an unknown name included, is a 400 naming the field before it
    takes a place: with the server's jobs at their bound it is still a 400, not the
    429 of a full server, and makes no job."""
    runner = Adapted(frames=(4, 1))
    config = ServeConfig(model_name="fake-video", default_width=16, default_height=16)
    videos = VideoConfig(fps=8.0, max_jobs=4)  # the four jobs sent below fill it
    service = Service(runner, config=config, video_config=videos)
    body = {"prompt": "a fox", "num_frames": 5, "num_inference_steps": 2}
    sent: list[tuple[dict[str, Any], tuple[tuple[str, float], ...]]] = [
        ({"json": {**body, "adapters": {"ink": 0.8, "film": 0.3}}}, (("ink", 0.8), ("film", 0.3))),
        ({"json": {**body, "adapters": "film:0.25"}}, (("film", 0.25),)),
        ({"json": {**body, "lora": [{"name": "ink", "scale": -1.0}]}}, (("ink", -1.0),)),
    ]
    form = {key: str(value) for key, value in body.items()}
    # A form (what the OpenAI SDK sends): httpx makes one of ``files``.
    parts = {key: (None, value) for key, value in {**form, "adapters": "ink:0.6,film"}.items()}
    sent.append(({"files": parts}, (("ink", 0.6), ("film", 1.0))))
    with anyio.fail_after(BUDGET):
        async with serving(service) as client:
            for index, (request, pairs) in enumerate(sent):
                response = await client.post("/v1/videos", **request)
                assert response.status_code == 200, response.text
                await wait_until(partial(prepared, runner, index + 1))
                assert runner.prepared[index].adapter_pairs == pairs
                assert runner.prepared[index].num_frames == 5  # a video indeed
            bad: list[tuple[dict[str, Any], str]] = [
                ({"json": {**body, "adapters": {"nope": 1.0}}}, "adapters"),
                ({"json": {**body, "adapters": {"ink": "0.8"}}}, "adapters"),
                ({"json": {**body, "adapters": ["ink"]}}, "adapters"),
                ({"json": {**body, "lora": [{"name": "ink", "weight": 1}]}}, "lora"),
                ({"json": {**body, "adapters": "ink", "lora": "film"}}, "lora"),
            ]
            for text in BAD_FORM_ADAPTERS:
                fields = {**form, "adapters": text}
                bad.append(({"files": {k: (None, v) for k, v in fields.items()}}, "adapters"))
            for request, param in bad:
                response = await client.post("/v1/videos", **request)
                assert response.status_code == 400, request
                assert response.json()["error"]["param"] == param, response.text
            full = await client.post("/v1/videos", json=body)  # a good one: no room
            assert full.status_code == 429, full.text
            listed = (await client.get("/v1/videos")).json()["data"]
    assert len(listed) == len(sent)
    assert len(runner.prepared) == len(sent)


class Gated(Adapted):
    """An ``Adapted`` that loads and unloads names, each load listed as it begins (as
    ``DiffusersRunner``'s is before it makes room) and held until ``gate`` is set;
    with ``breaks`` its loads raise a ``BaseException`` (a parallel group that broke)."""

    def __init__(self, *, breaks: bool = False) -> None:
        super().__init__()
        self.names = frozenset()
        self.breaks = breaks
        self.entered = threading.Event()
        self.gate = threading.Event()

    def load_adapter(self, name: str, source: str | os.PathLike[str] | Mapping[str, Any]) -> None:
        if self.breaks:
            raise KeyboardInterrupt("the group broke")  # any BaseException that is no Exception
        self.names = self.names | {name}
        self.entered.set()
        self.gate.wait(BUDGET)

    def unload_adapter(self, name: str) -> None:
        self.names = self.names - {name}


def admin_service(runner: Adapted, folder: Path) -> Service:
    """A service over ``runner`` that allows admin actions, with ``ink.safetensors`` (a
    file the fake never reads) in ``folder``."""
    (folder / "ink.safetensors").write_bytes(b"never read")
    config = ServeConfig(
        model_name="fake",
        default_width=64,
        default_height=64,
        default_steps=2,
        allow_adapter_admin=True,
        adapter_dir=str(folder),
    )
    return Service(runner, config=config)


async def test_a_delete_racing_the_load_of_its_name_is_refused(tmp_path: Path) -> None:
    """L88, L85: a ``DELETE`` of a name whose ``POST`` is loading is a 409
    ``adapter_in_use`` (not a 500 of the load's answer, not an unload half across the
    runners); the load answers 201 and the adapter stays until a later ``DELETE``."""
    runner = Gated()
    answers: dict[str, httpx.Response] = {}
    with anyio.fail_after(BUDGET):
        async with serving(admin_service(runner, tmp_path)) as client:

            async def load() -> None:
                body = {"name": "ink", "path": "ink.safetensors"}
                answers["load"] = await client.post("/v1/adapters", json=body)

            async with anyio.create_task_group() as tg:
                tg.start_soon(load)
                await wait_until(runner.entered.is_set)
                deleted = await client.delete("/v1/adapters/ink")
                runner.gate.set()
            assert deleted.status_code == 409, deleted.text
            assert deleted.json()["error"]["code"] == "adapter_in_use"
            assert answers["load"].status_code == 201, answers["load"].text
            assert answers["load"].json()["id"] == "ink"
            listed = (await client.get("/v1/adapters")).json()["data"]
            assert [a["id"] for a in listed] == ["ink"]
            assert (await client.delete("/v1/adapters/ink")).status_code == 200
    assert runner.names == frozenset()


async def test_a_load_that_breaks_the_worker_is_a_503_and_the_server_answers_on(
    tmp_path: Path,
) -> None:
    """L88, L23: a load whose runner breaks (raises a ``BaseException`` that is no
    ``Exception``) is a 503 ``engine_dead``, not the end of the server: ``/health`` says
    ``dead``, ``/v1/models`` lists no adapter, a later load is a 503 too; the lifespan's
    end raises ``EngineDeadError``."""
    with anyio.fail_after(BUDGET), pytest.raises(ot.EngineDeadError):
        async with serving(admin_service(Gated(breaks=True), tmp_path)) as client:
            body = {"name": "ink", "path": "ink.safetensors"}
            for _ in range(2):
                response = await client.post("/v1/adapters", json=body)
                assert response.status_code == 503, response.text
                assert response.json()["error"]["code"] in ("engine_dead", "shutting_down")
            health = await client.get("/health")
            assert (health.status_code, health.json()["status"]) == (503, "dead")
            models = await client.get("/v1/models")
            assert models.status_code == 200 and models.json()["data"][0]["adapters"] == []
