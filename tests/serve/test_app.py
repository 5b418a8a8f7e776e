"""The ASGI app in-process: L50 (API), L51 (disconnects), L52 (bad input), L53 (drain).

Determinism rules:
- every test runs on trio and asyncio (``anyio_backend``), inside the app's own
  lifespan (``router.lifespan_context``), with ``anyio.fail_after(BUDGET)``;
- the runners are ``FakeRunner`` (instant) or ``GatedRunner`` (each step waits
  for the test's ``release``/``open_gate``), so "the request is at step k when the
  client goes" is exact; nothing sleeps to let time pass;
- requests go through ``httpx.ASGITransport`` (which runs the app to completion)
  or, where the test must control ``receive`` (disconnects), through ``AsgiCall``,
  which hands the app one body and then an ``http.disconnect`` when told.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from typing import Any

import anyio
import httpx
import pytest

from omni_trio.serve import ServeConfig, Service, create_app
from omni_trio.serve._config import with_defaults
from omni_trio.testing import FakeRunner, GatedRunner, assert_engine_idle, wait_until
from tests.support.core import BUDGET
from tests.support.serve import (
    BAD_BODIES,
    PATH,
    AsgiCall,
    assert_refused_and_serving,
    make_service,
    metric,
    parse_sse,
    png_size,
    serving,
)

pytestmark = pytest.mark.anyio

# -- L50: the API ----------------------------------------------------------------


async def test_generate_returns_openai_json() -> None:
    """L50: a JSON body gets OpenAI-style JSON with n base64 PNGs of the asked size."""
    service, runner = make_service()
    with anyio.fail_after(BUDGET):
        async with serving(service) as client:
            body = {"prompt": "a flower", "n": 2, "size": "64x32", "num_inference_steps": 3}
            body |= {"model": "fake", "quality": "high", "style": "vivid", "user": "u"}
            body |= {"response_format": "b64_json", "seed": 7, "guidance_scale": 5.0}
            response = await client.post(PATH, json=body)
            assert response.status_code == 200, response.text
            data = response.json()
            assert isinstance(data["created"], int)
            assert [png_size(item["b64_json"]) for item in data["data"]] == [(64, 32), (64, 32)]
            assert data["size"] == "64x32" and data["output_format"] == "png"
            assert data["omni_trio"]["steps"] == 3 and data["omni_trio"]["seed"] == 7
            assert response.headers["x-request-id"] == data["omni_trio"]["request_id"]
            assert runner.steps_run == 3
            again = await client.post(PATH, json=body)
            assert again.json()["data"] == data["data"]  # same seed, same images
            assert_engine_idle(service.engine)  # type: ignore[arg-type]


@pytest.mark.parametrize(("fmt", "magic"), [("jpeg", b"\xff\xd8\xff"), ("webp", b"RIFF")])
async def test_output_format_is_honoured(fmt: str, magic: bytes) -> None:
    """L50: output_format jpeg and webp (with output_compression) are encoded as asked."""
    service, _ = make_service()
    with anyio.fail_after(BUDGET):
        async with serving(service) as client:
            body = {"prompt": "x", "output_format": fmt, "output_compression": 50}
            response = await client.post(PATH, json=body)
            assert response.status_code == 200, response.text
            assert base64.b64decode(response.json()["data"][0]["b64_json"]).startswith(magic)


async def test_stream_sends_progress_previews_then_the_image() -> None:
    """L50: "stream": true sends one progress event per step, previews, then the result."""
    service, _ = make_service()
    with anyio.fail_after(BUDGET):
        async with serving(service) as client:
            body = {"prompt": "x", "num_inference_steps": 4, "stream": True, "preview_every": 2}
            response = await client.post(PATH, json=body)
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            events = parse_sse(response.text)
            progress = [d["step"] for e, d in events if e == "image_generation.progress"]
            partial = [d for e, d in events if e == "image_generation.partial_image"]
            completed = [d for e, d in events if e == "image_generation.completed"]
            assert progress == [1, 2, 3, 4]
            assert [d["step"] for d in partial] == [2, 4]
            assert [d["partial_image_index"] for d in partial] == [0, 1]
            # A preview is at the latents' size: what it says is what its PNG is.
            assert [(d["size"], png_size(d["b64_json"])) for d in partial] == [("8x8", (8, 8))] * 2
            assert all(d["total"] == 4 for e, d in events if e == "image_generation.progress")
            assert len(completed) == 1 and png_size(completed[0]["b64_json"]) == (64, 64)
            assert events[-1][0] == "image_generation.completed"
            assert all(d["type"] == e for e, d in events)


async def test_partial_images_spreads_previews() -> None:
    """L50: OpenAI's partial_images=k sends at most k previews, spread over the steps."""
    service, _ = make_service()
    with anyio.fail_after(BUDGET):
        async with serving(service) as client:
            body = {"prompt": "x", "num_inference_steps": 9, "stream": True, "partial_images": 2}
            events = parse_sse((await client.post(PATH, json=body)).text)
            steps = [d["step"] for e, d in events if e == "image_generation.partial_image"]
            assert steps == [4, 8]


async def test_models_health_and_metrics() -> None:
    """L50: /v1/models lists the model, /health is 200 when ready, /metrics is Prometheus text."""
    service, _ = make_service()
    with anyio.fail_after(BUDGET):
        assert not service.is_ready
        async with serving(service) as client:
            models = (await client.get("/v1/models")).json()
            assert models["object"] == "list"
            assert [m["id"] for m in models["data"]] == ["fake"]
            assert (await client.get("/v1/models/fake")).json()["id"] == "fake"
            missing = await client.get("/v1/models/other")
            assert missing.status_code == 404
            assert missing.json()["error"]["code"] == "model_not_found"
            health = await client.get("/health")
            assert (health.status_code, health.json()["status"]) == (200, "ok")
            await client.post(PATH, json={"prompt": "x"})
            text = (await client.get("/metrics")).text
            assert metric(text, "omni_trio_requests_total", outcome="completed") == 1
            assert metric(text, "omni_trio_queue_wait_seconds_count") == 1
            assert metric(text, "omni_trio_execution_seconds_count") == 1
            assert metric(text, "omni_trio_step_seconds_count") == 1
            assert metric(text, "omni_trio_requests_running") == 0
            assert metric(text, "omni_trio_requests_waiting") == 0
            assert metric(text, "omni_trio_engine_steps_total") == 4
        assert not service.is_ready and service.is_draining


async def test_each_app_has_its_own_registry() -> None:
    """L50: two apps in one process count separately (no global Prometheus registry)."""
    first, _ = make_service()
    second, _ = make_service()
    with anyio.fail_after(BUDGET):
        async with serving(first) as one, serving(second) as two:
            await one.post(PATH, json={"prompt": "x"})
            text = (await two.get("/metrics")).text
            assert metric(text, "omni_trio_requests_total", outcome="completed") == 0
    assert create_app(FakeRunner()).state.service.config.model_name == "omni-trio"


async def test_unknown_routes_and_methods_get_openai_errors() -> None:
    """L52: 404 and 405 answer with an OpenAI-style error object too."""
    service, _ = make_service()
    with anyio.fail_after(BUDGET):
        async with serving(service) as client:
            for method, path, status in [("GET", "/nope", 404), ("GET", PATH, 405)]:
                response = await client.request(method, path)
                assert response.status_code == status
                assert set(response.json()["error"]) == {"message", "type", "param", "code"}


# -- L52: bad input ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [case[1:] for case in BAD_BODIES],
    ids=[case[0] for case in BAD_BODIES],
)
async def test_bad_input_gets_400_naming_the_field(
    body: bytes | dict[str, Any], param: str | None, code: str
) -> None:
    """L52: malformed JSON, wrong types, unknown fields and values over limits get 400,
    an OpenAI-style error naming the field, and change nothing else."""
    service, runner = make_service()
    with anyio.fail_after(BUDGET):
        async with serving(service) as client:
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            response = await client.post(PATH, content=content)
            await assert_refused_and_serving(client, service, runner, response, param, code)
            text = (await client.get("/metrics")).text
            assert metric(text, "omni_trio_requests_total", outcome="invalid") == 1


async def test_a_form_sent_to_generations_is_told_to_send_json() -> None:
    """L52: a ``multipart/form-data`` body (as ``curl -F`` or an edit call sends) to
    /v1/images/generations is a 400 ``invalid_content_type`` naming application/json, not
    "not valid JSON"; a JSON body without its content type is still read as JSON."""
    service, runner = make_service()
    with anyio.fail_after(BUDGET):
        async with serving(service) as client:
            form = await client.post(PATH, files={"prompt": (None, "x")})
            await assert_refused_and_serving(
                client, service, runner, form, None, "invalid_content_type"
            )
            message = form.json()["error"]["message"]
            assert "application/json" in message and "multipart/form-data" in message
            untyped = await client.post(
                PATH, content=b'{"prompt": "x"}', headers={"content-type": "text/plain"}
            )
            assert untyped.status_code == 200, untyped.text


class Chunks(httpx.AsyncByteStream):
    """``count`` chunks of ``size`` spaces, as a request body without a length."""

    def __init__(self, count: int, size: int) -> None:
        self.left = count
        self.size = size

    def __aiter__(self) -> Chunks:
        return self

    async def __anext__(self) -> bytes:
        if self.left == 0:
            raise StopAsyncIteration
        self.left -= 1
        return b" " * self.size


async def test_body_over_the_limit_is_refused_before_parsing() -> None:
    """L52: a body over max_body_bytes gets 413, from Content-Length or while reading."""
    service, _ = make_service()

    with anyio.fail_after(BUDGET):
        async with serving(service) as client:
            declared = await client.post(PATH, content=b" " * 5000)
            # No Content-Length: refused while reading. A plain iterator, not an async
            # generator: the server stops reading it, and an unfinished generator
            # would warn whenever the garbage collector happens to find it.
            request = httpx.Request("POST", f"http://test{PATH}", stream=Chunks(10, 1000))
            streamed = await client.send(request)
            for response in (declared, streamed):
                assert response.status_code == 413
                assert response.json()["error"]["code"] == "request_too_large"
            assert "content-length" not in streamed.request.headers
            text = (await client.get("/metrics")).text
            assert metric(text, "omni_trio_requests_total", outcome="too_large") == 2


async def test_queue_full_gets_429_with_retry_after() -> None:
    """L52: when max_waiting requests wait, the next gets 429 with Retry-After."""
    runner = GatedRunner()
    service, _ = make_service(runner, max_batch_size=1, max_waiting=1)
    running, waiting = AsgiCall({"prompt": "a"}), AsgiCall({"prompt": "b"})
    with anyio.fail_after(BUDGET):
        async with serving(service) as client, anyio.create_task_group() as tg:
            engine = service.engine
            assert engine is not None
            tg.start_soon(running.run, service)
            await wait_until(lambda: engine.statistics().running == 1)
            tg.start_soon(waiting.run, service)
            await wait_until(lambda: engine.statistics().waiting == 1)
            refused = await client.post(PATH, json={"prompt": "c"})
            assert refused.status_code == 429
            assert refused.headers["retry-after"] == "1"
            assert refused.json()["error"]["code"] == "queue_full"
            runner.open_gate()
        assert (running.status, waiting.status) == (200, 200)


# -- L51: disconnects --------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_disconnect_aborts_at_the_next_step(stream: bool) -> None:
    """L51: a client that disconnects mid-way (streaming or not) aborts its request at
    the next step boundary, with no decode; the worker is released, and the next
    request runs alone at full speed (each of its steps a batch of one)."""
    runner = GatedRunner()
    service, _ = make_service(runner)
    call = AsgiCall({"prompt": "x", "num_inference_steps": 40, "stream": stream})
    with anyio.fail_after(BUDGET):
        async with serving(service) as client:
            engine = service.engine
            assert engine is not None
            async with anyio.create_task_group() as tg:
                tg.start_soon(call.run, service)
                runner.release(3)
                await wait_until(lambda: runner.steps_run == 3 and runner.arrived == 4)
                call.disconnect.set()
                await wait_until(lambda: call.disconnect_delivered)
                # The worker waits inside step 4; the abort lands when that step returns.
                runner.open_gate()
            assert runner.steps_run == 4 and runner.decodes == 0 and runner.live_states == 0
            assert_engine_idle(engine)
            if stream:
                assert call.status == 200
                assert b"image_generation.progress" in call.body
                assert b"completed" not in call.body
            else:
                assert call.sent == []
            text = (await client.get("/metrics")).text
            assert metric(text, "omni_trio_requests_total", outcome="disconnected") == 1
            assert metric(text, "omni_trio_abort_latency_seconds_count") == 1
            # The step in flight when the client left: the only one run after it.
            assert metric(text, "omni_trio_steps_after_abort_total") == 1
            before = (runner.steps_run, runner.batch_steps)
            response = await client.post(PATH, json={"prompt": "y", "num_inference_steps": 5})
            assert response.status_code == 200
            assert (runner.steps_run - before[0], runner.batch_steps - before[1]) == (5, 5)


async def test_disconnect_while_waiting_withdraws_the_request() -> None:
    """L51: a client that leaves while its request waits ends it at once; it never runs."""
    runner = GatedRunner()
    service, _ = make_service(runner, max_batch_size=1)
    first, second = AsgiCall({"prompt": "a"}), AsgiCall({"prompt": "b"})
    with anyio.fail_after(BUDGET):
        async with serving(service), anyio.create_task_group() as tg:
            engine = service.engine
            assert engine is not None
            tg.start_soon(first.run, service)
            await wait_until(lambda: engine.statistics().running == 1)
            tg.start_soon(second.run, service)
            await wait_until(lambda: engine.statistics().waiting == 1)
            second.disconnect.set()
            await wait_until(lambda: engine.statistics().aborted == 1)  # at once: L6
            assert runner.prepares == 1
            runner.open_gate()
        assert first.status == 200 and second.sent == []


# -- failures and L53: drain ---------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_runner_failure_is_a_500_or_an_error_event(stream: bool) -> None:
    """L52: a model that raises fails only its request: 500 or an ``error`` event."""
    service, _ = make_service(FakeRunner(fail_at_step=2))
    with anyio.fail_after(BUDGET):
        async with serving(service) as client:
            response = await client.post(PATH, json={"prompt": "x", "stream": stream})
            if stream:
                event, data = parse_sse(response.text)[-1]
                assert (response.status_code, event) == (200, "error")
                error = data["error"]
            else:
                assert response.status_code == 500
                error = response.json()["error"]
            assert (error["type"], error["code"]) == ("server_error", "generation_failed")
            text = (await client.get("/metrics")).text
            assert metric(text, "omni_trio_requests_total", outcome="failed") == 1


async def test_drain_turns_health_503_and_cuts_requests() -> None:
    """L53: drain() turns /health to 503, refuses new requests with 503, ends waiting
    requests at once and running ones at their next step (shutdown_grace 0)."""
    runner = GatedRunner()
    service, _ = make_service(runner, max_batch_size=1)
    running = AsgiCall({"prompt": "a", "stream": True, "num_inference_steps": 40})
    waiting = AsgiCall({"prompt": "b"})
    with anyio.fail_after(BUDGET):
        async with serving(service) as client:
            engine = service.engine
            assert engine is not None
            async with anyio.create_task_group() as tg:
                tg.start_soon(running.run, service)
                runner.release(2)
                await wait_until(lambda: runner.steps_run == 2)
                tg.start_soon(waiting.run, service)
                await wait_until(lambda: engine.statistics().waiting == 1)
                tg.start_soon(service.drain)
                await wait_until(lambda: service.is_draining)
                health = await client.get("/health")
                assert (health.status_code, health.json()["status"]) == (503, "draining")
                refused = await client.post(PATH, json={"prompt": "c"})
                assert refused.status_code == 503
                assert refused.json()["error"]["code"] == "shutting_down"
                await wait_until(lambda: waiting.status is not None)
                assert waiting.status == 503
                assert json.loads(waiting.body)["error"]["code"] == "shutting_down"
                runner.open_gate()
            event, data = parse_sse(running.body.decode())[-1]
            assert (event, data["error"]["code"]) == ("error", "shutting_down")
            assert runner.steps_run <= 3 and runner.decodes == 0
            text = (await client.get("/metrics")).text
            assert metric(text, "omni_trio_requests_total", outcome="shutdown") == 2
            assert metric(text, "omni_trio_requests_total", outcome="unavailable") == 1
            assert metric(text, "omni_trio_draining") == 1


async def test_a_request_that_leaves_fields_out_gets_the_servers_defaults() -> None:
    """L50: ``with_defaults``, the one place defaults are filled (the HTTP bodies and the
    Ray handle's ``generate``): a field absent or ``None`` gets the server's (the model's)
    default, never ``GenerationRequest``'s own (512x512, 30 steps); a field given is kept;
    a video model's frames are filled only when given a default. A body that leaves them
    out over HTTP gets the same."""
    config = ServeConfig(
        model_name="fake", default_width=64, default_height=32, default_steps=3,
        default_guidance_scale=2.5,
    )  # fmt: skip
    filled = with_defaults({"prompt": "x", "num_steps": None, "width": 16}, config)
    assert filled == {
        "prompt": "x", "num_steps": 3, "width": 16, "height": 32, "guidance_scale": 2.5
    }  # fmt: skip
    assert with_defaults({}, config, num_frames=9)["num_frames"] == 9
    assert with_defaults({"num_frames": 5}, config, num_frames=9)["num_frames"] == 5
    assert "num_frames" not in with_defaults({}, config)
    service = Service(FakeRunner(), config=config)
    with anyio.fail_after(BUDGET):
        async with serving(service) as client:
            answer = (await client.post(PATH, json={"prompt": "x"})).json()
    assert (answer["size"], answer["omni_trio"]["steps"]) == ("64x32", 3)
    assert png_size(answer["data"][0]["b64_json"]) == (64, 32)


def test_serve_config_is_validated() -> None:
    """ServeConfig refuses values that could never work, naming the field."""
    bad: list[Callable[[], ServeConfig]] = [
        lambda: ServeConfig(model_name=""),
        lambda: ServeConfig(default_steps=0),
        lambda: ServeConfig(max_body_bytes=-1),
        lambda: ServeConfig(default_guidance_scale=float("nan")),
        lambda: ServeConfig(retry_after_s=-1),
    ]
    for make in bad:
        with pytest.raises(ValueError, match=r"^\w+: "):
            make()


def test_image_service_is_the_deprecated_old_name_of_service() -> None:
    """``ImageService`` (the name before 0.2.0) is ``Service``, with a ``DeprecationWarning``."""
    import omni_trio.serve as serve

    with pytest.warns(
        DeprecationWarning, match=r"ImageService is deprecated.*use omni_trio\.serve\.Service"
    ):
        alias = serve.ImageService
    assert alias is serve.Service
    with pytest.warns(DeprecationWarning, match="0.3.0"):
        from omni_trio.serve import ImageService
    assert ImageService is serve.Service
    assert "Service" in serve.__all__ and "ImageService" not in serve.__all__
    assert not hasattr(serve, "NoSuchName")
