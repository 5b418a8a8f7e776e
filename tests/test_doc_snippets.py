"""Every docs/snippets/*.py that a page includes runs here as the page shows it.

A snippet is either a whole program (run with ``exec`` in a namespace that holds the
names the page says are yours: ``pipeline``, ``runner``, ``picture``) or a fragment of an
``async`` function (its ``await`` at top level: run as the body of one, given the names
the page's prose sets up). The pages say what each name is; the tests give the tiny
version of it: a tiny pipeline (``omni_trio.runners.tiny_pipeline``), a ``FakeRunner``
or a ``GatedRunner``. The OpenAI SDK snippets run against a real ``omni-trio serve``
subprocess (the tiny models) on a free loopback port: the only change made to their
text is that address for ``http://127.0.0.1:8000``. The Ray Serve snippet starts a
local Ray cluster (marked ``ray``, skipped without the extra).

Determinism: the tiny pipelines' weights are seeded; gated runners step only when the
test releases them; every wait is under ``anyio.fail_after(BUDGET)`` or the servers'
bounded polls.
"""

from __future__ import annotations

import ast
import base64
import importlib.util
import inspect
import os
import textwrap
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
import PIL.Image
import pytest

import omni_trio as ot
from omni_trio.runners import DiffusersRunner, tiny_pipeline
from omni_trio.testing import (
    FakeRunner,
    GatedRunner,
    RequestLedger,
    assert_nothing_left,
    assume_step_time,
    probe,
    wait_until,
)
from tests.support.core import BUDGET, req
from tests.support.serve import Server, png_size, poll_until, run_server

ROOT = Path(__file__).resolve().parent.parent
SNIPPETS = ROOT / "docs" / "snippets"
#: The address the SDK snippets show; the tests' servers listen elsewhere.
SHOWN_URL = "http://127.0.0.1:8000"
HAVE_RAY = importlib.util.find_spec("ray") is not None
_PIPES: dict[str, Any] = {}


def tiny(kind: str) -> Any:
    """The tiny pipeline of ``kind``, built once per test run (runners never change it)."""
    if kind not in _PIPES:
        _PIPES[kind] = tiny_pipeline(kind)
    return _PIPES[kind]


def code(name: str) -> str:
    return (SNIPPETS / name).read_text()


def run(name: str, **names: Any) -> dict[str, Any]:
    """Run the program ``docs/snippets/NAME`` with ``names`` defined; its namespace."""
    namespace: dict[str, Any] = dict(names)
    exec(compile(code(name), str(SNIPPETS / name), "exec"), namespace)
    return namespace


def fragment(name: str, **names: Any) -> Callable[[], Awaitable[dict[str, Any]]]:
    """``docs/snippets/NAME`` as the body of an ``async def``; it returns its locals."""
    source = "async def fragment():\n" + textwrap.indent(code(name), "    ")
    source += "    return locals()\n"
    namespace: dict[str, Any] = dict(names)
    exec(compile(source, str(SNIPPETS / name), "exec"), namespace)
    function: Callable[[], Awaitable[dict[str, Any]]] = namespace["fragment"]
    return function


@asynccontextmanager
async def served(app: Any) -> AsyncIterator[httpx.AsyncClient]:
    """``app`` with its lifespan entered, and a client over httpx's ASGI transport."""
    transport = httpx.ASGITransport(app=app)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://app") as client,
    ):
        yield client


# -- docs/runners.md -----------------------------------------------------------------


def test_diffusers_runner() -> None:
    """diffusers_runner.py: the step-by-step runner of a pipeline, batches of 8."""
    runner = run("diffusers_runner.py", pipeline=tiny("sd"))["runner"]
    try:
        assert isinstance(runner, DiffusersRunner)
        assert runner.capabilities.max_batch_size == 8
    finally:
        runner.close()


def test_edit_request() -> None:
    """edit_request.py: an image-to-image request of 6 of its 10 steps (its own asserts);
    the same with a mask is an inpainting."""
    picture = PIL.Image.new("RGB", (64, 64), (200, 120, 40))
    request = run("edit_request.py", picture=picture)["request"]
    assert request.strength == 0.6 and request.image is not None
    mask = PIL.Image.new("L", (64, 64), 255)
    assert ot.GenerationRequest(**{**_fields(request), "mask": mask}).kind == "inpaint"


def _fields(request: ot.GenerationRequest) -> dict[str, Any]:
    return {
        "prompt": request.prompt,
        "num_steps": request.num_steps,
        "height": request.height,
        "width": request.width,
        "image": request.image,
        "strength": request.strength,
    }


@pytest.mark.anyio
@pytest.mark.usefixtures("one_torch_thread")
async def test_video_request(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """video_request.py on the tiny Wan: a [1, 9, 3, 32, 32] video (its own asserts), its
    first frames as images, and an MP4."""
    pytest.importorskip("av")
    monkeypatch.chdir(tmp_path)
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(DiffusersRunner(tiny("wan"))) as engine:
            await fragment("video_request.py", ot=ot, engine=engine)()
    assert (tmp_path / "boat.mp4").read_bytes()[4:8] == b"ftyp"


def test_decode_defaults_are_the_runners() -> None:
    """decode_defaults.py spells out DiffusersRunner's decode options at their defaults."""
    [call] = [node for node in ast.walk(ast.parse(code("decode_defaults.py"))) if _is_call(node)]
    assert isinstance(call, ast.Call)
    shown = {
        str(kw.arg): eval(compile(ast.Expression(kw.value), "kw", "eval")) for kw in call.keywords
    }
    defaults = inspect.signature(DiffusersRunner).parameters
    assert set(shown) == {"decode_slices", "tile_above", "framewise_above"}
    assert all(defaults[name].default == value for name, value in shown.items()), shown
    names = run("decode_defaults.py", DiffusersRunner=DiffusersRunner, pipeline=tiny("sd"))
    names["runner"].close()


def _is_call(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and getattr(node.func, "id", None) == "DiffusersRunner"


@pytest.mark.anyio
async def test_step_cache_policies() -> None:
    """step_cache_policies.py: each policy is valid, and a runner that applies step
    caches admits and serves every request under the default the config sets."""
    names = run("step_cache_policies.py")
    assert names["cached"].cache == ot.StepCache(kind="first-block", threshold=0.08)
    assert names["forecast"].cache.kind == "taylorseer"
    assert names["plain"].cache.kind == "none"
    config = names["config"]
    assert config.default_cache.kind == "first-block"
    small = {"num_steps": 2, "height": 16, "width": 16}
    requests = [
        ot.GenerationRequest(**{**_fields(names[key]), **small, "cache": names[key].cache})
        for key in ("cached", "forecast", "plain")
    ]
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(FakeRunner(step_cache=True), config) as engine:
            for request in [*requests, req()]:
                assert (await engine.generate(request)).images.shape == (1, 3, 16, 16)


def test_adapter_calls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """adapter_calls.py with two random LoRAs at its paths: both load, requests name
    them with their scales, the listing has both, and "film" is unloaded."""
    pytest.importorskip("peft")
    from omni_trio.runners import tiny_lora

    pipe = tiny_pipeline("sd")  # its own: LoRA layers stay in a pipeline once loaded
    (tmp_path / "loras").mkdir()
    for seed, name in enumerate(["ink", "film"]):
        tiny_lora(pipe, tmp_path / "loras", name, seed=seed)
    monkeypatch.chdir(tmp_path)
    runner = DiffusersRunner(pipe)
    try:
        names = run("adapter_calls.py", runner=runner)
        assert sorted(info.name for info in names["listed"]) == ["film", "ink"]
        assert all(info.loaded and info.bytes > 0 for info in names["listed"])
        assert names["mixed"].adapters == (("ink", 0.3), ("film", 0.5))
        assert names["plain"].adapters == ()
        assert [info.name for info in runner.adapters()] == ["ink"]
    finally:
        runner.close()


# -- docs/serving.md: in-process ---------------------------------------------------------


@pytest.mark.anyio
async def test_create_app() -> None:
    """create_app.py: the app serves under its model name; its service drains on exit."""
    names = run("create_app.py", runner=FakeRunner())
    service = names["service"]
    with anyio.fail_after(BUDGET):
        async with served(names["app"]) as client:
            models = (await client.get("/v1/models")).json()
            assert [model["id"] for model in models["data"]] == ["my-model"]
    assert service.is_draining


@pytest.mark.anyio
async def test_mount_service() -> None:
    """mount_service.py: mounted under /images, served once the host's lifespan ran."""
    names = run("mount_service.py", runner=FakeRunner())
    body = {"prompt": "a red flower", "num_inference_steps": 2, "size": "64x64"}
    with anyio.fail_after(BUDGET):
        async with served(names["app"]) as client:
            assert (await client.get("/images/health")).status_code == 200
            answer = await client.post("/images/v1/images/generations", json=body)
            assert answer.status_code == 200, answer.text
            assert png_size(answer.json()["data"][0]["b64_json"]) == (64, 64)


@pytest.mark.anyio
@pytest.mark.usefixtures("one_torch_thread")
async def test_build_service(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """build_service.py on a folder ``save_pretrained`` wrote: the service generates."""
    tiny("sd").save_pretrained(tmp_path / "my-sd-folder")
    monkeypatch.chdir(tmp_path)
    names = run("build_service.py")
    body = {"prompt": "a red flower", "num_inference_steps": 2, "size": "64x64"}
    with anyio.fail_after(BUDGET):
        async with served(names["app"]) as client:
            answer = await client.post("/v1/images/generations", json=body)
            assert answer.status_code == 200, answer.text
    assert names["service"].is_draining


# -- docs/serving.md: the OpenAI SDK against a server ---------------------------------


def run_against(server: Server, name: str, **names: Any) -> dict[str, Any]:
    """Run an SDK snippet with ``server``'s address for the one it shows."""
    text = code(name)
    assert SHOWN_URL in text, name
    namespace: dict[str, Any] = dict(names)
    try:
        exec(compile(text.replace(SHOWN_URL, server.url), str(SNIPPETS / name), "exec"), namespace)
    finally:
        if "client" in namespace:
            namespace["client"].close()
    return namespace


@pytest.fixture(scope="module")
def sd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """``omni-trio serve --model tiny-sd`` (Hypercorn) for the module's image snippets."""
    with run_server(
        "--model", "tiny-sd", server="hypercorn", log_dir=tmp_path_factory.mktemp("sd")
    ) as server:
        yield server


@pytest.fixture(scope="module")
def wan_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """``omni-trio serve --model tiny-wan`` (Hypercorn, jobs in memory) for the video one."""
    logs = tmp_path_factory.mktemp("wan")
    args = ("--model", "tiny-wan", "--jobs-dir", "none")
    with run_server(*args, server="hypercorn", log_dir=logs) as server:
        yield server


def test_images_sdk(sd_server: Server, capsys: pytest.CaptureFixture[str]) -> None:
    """images_sdk.py: two 64 x 64 PNGs, then a stream of events that ends completed."""
    names = run_against(sd_server, "images_sdk.py")
    assert names["png"].startswith(b"\x89PNG")
    assert [png_size(image.b64_json) for image in names["result"].data] == [(64, 64)] * 2
    printed = capsys.readouterr().out.split()
    assert printed.count("image_generation.partial_image") == 2
    assert printed[-1] == "image_generation.completed"


def test_edit_client(sd_server: Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """edit_client.py with a photo and a mask whose right half is transparent: one edit."""
    monkeypatch.chdir(tmp_path)
    PIL.Image.new("RGB", (64, 64), (90, 60, 30)).save("photo.png")
    mask = PIL.Image.new("RGBA", (64, 64), (0, 0, 0, 255))
    mask.paste((0, 0, 0, 0), (32, 0, 64, 64))
    mask.save("mask.png")
    result = run_against(sd_server, "edit_client.py")["result"]
    assert [png_size(image.b64_json) for image in result.data] == [(64, 64)]
    assert base64.b64decode(result.data[0].b64_json)


def test_video_sdk(wan_server: Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """video_sdk.py: a job that completes, its MP4 saved, the job deleted (none listed)."""
    pytest.importorskip("av")
    monkeypatch.chdir(tmp_path)
    names = run_against(wan_server, "video_sdk.py")
    assert names["video"].status == "completed"
    assert (tmp_path / "boat.mp4").read_bytes()[4:8] == b"ftyp"
    assert "job" not in names


# -- docs/scaling.md -------------------------------------------------------------------


@pytest.mark.ray
@pytest.mark.timeout(300)
@pytest.mark.skipif(not HAVE_RAY, reason="needs the ray extra: pip install 'omni_trio[ray]'")
def test_ray_deployment() -> None:
    """ray_deployment.py in a local Ray cluster on loopback: two replicas of tiny-sd, a
    handle call that makes the model's 64 x 64 image; no Ray process is left after."""
    from omni_trio.cli._ray import RAY_ENVIRONMENT
    from tests.support.cli import alive, descendants, free_port

    for variable, value in RAY_ENVIRONMENT.items():
        os.environ.setdefault(variable, value)
    with warnings.catch_warnings():
        # Ray Serve's own pydantic models use fields pydantic 2 deprecates.
        warnings.simplefilter("ignore", DeprecationWarning)
        import ray
        from ray import serve

        import omni_trio.serve.ray  # noqa: F401

    before = descendants(os.getpid())
    ray.init(_node_ip_address="127.0.0.1", include_dashboard=False, num_cpus=4, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": free_port()})
        output = run("ray_deployment.py")["output"]
        assert output.images.shape == (1, 3, 64, 64)
        serve.shutdown()
    finally:
        started = descendants(os.getpid()) - before
        ray.shutdown()
    poll_until(lambda: not alive(started), timeout=60, what="every Ray process to exit")


# -- docs/testing.md -------------------------------------------------------------------


@pytest.mark.anyio
async def test_probe_abort() -> None:
    """probe_abort.py with request "r" at step 2's gate: the abort is seen before the
    request ends, and the view says the state was released (its own asserts)."""
    runner = GatedRunner()
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner) as engine:
            async with engine.submit(req(num_steps=10), request_id="r") as handle:
                runner.release(1)
                await runner.wait_arrived(2)
                await fragment(
                    "probe_abort.py",
                    probe=probe,
                    wait_until=wait_until,
                    engine=engine,
                    runner=runner,
                    handle=handle,
                )()
                assert handle.status is ot.RequestStatus.ABORTED


@pytest.mark.anyio
async def test_assume_step_time() -> None:
    """assume_step_time.py: the estimate refuses the tight deadline (its own
    ``pytest.raises``), and the busy request then completes."""
    runner = GatedRunner()
    with anyio.fail_after(BUDGET):
        names = await fragment(
            "assume_step_time.py",
            ot=ot,
            pytest=pytest,
            runner=runner,
            req=req,
            assume_step_time=assume_step_time,
        )()
    assert names["busy"].status is ot.RequestStatus.COMPLETED


@pytest.mark.anyio
async def test_request_ledger() -> None:
    """request_ledger.py: the ledger follows a request to its end; nothing is left."""
    runner = FakeRunner()
    with anyio.fail_after(BUDGET):
        names = await fragment(
            "request_ledger.py",
            ot=ot,
            runner=runner,
            request=req(),
            RequestLedger=RequestLedger,
            assert_nothing_left=assert_nothing_left,
        )()
    assert names["handle"].status is ot.RequestStatus.COMPLETED
