"""Hostile input to the ASGI app in-process: failures leak nothing, odd bodies get 400 (L52).

Determinism rules:
- every test runs on trio and asyncio, inside the app's lifespan, with
  ``anyio.fail_after(BUDGET)``; the runners are instant ``FakeRunner`` subclasses
  whose failures are fixed by step number;
- bodies are exact bytes (JSON integer literals, encodings, nesting), never
  re-encoded by the client;
- each hostile request is followed by a normal one that must succeed, and the
  engine must not have admitted the refused one.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from typing import Any

import anyio
import httpx
import pytest

import omni_trio as ot
from omni_trio.testing import FakeRunner, FakeState
from tests.support.core import BUDGET, WorkerKilled
from tests.support.serve import (
    HOSTILE_BODIES,
    PATH,
    assert_refused_and_serving,
    make_service,
    metric,
    nested,
    parse_sse,
    serving,
)

pytestmark = pytest.mark.anyio

#: A string that must never appear in anything a client receives.
SECRET = "s3cr3t-model-internals-0xDEADBEEF"


class SecretRunner(FakeRunner):
    """Raises at its second step an exception whose text carries ``SECRET``."""

    def step(self, states: Sequence[FakeState]) -> None:
        if any(state.steps_done == 1 for state in states):
            raise RuntimeError(f"CUDA error in {SECRET}")
        super().step(states)


class DyingRunner(FakeRunner):
    """Kills the worker at its first step with ``SECRET`` in the exception's text."""

    def step(self, states: Sequence[FakeState]) -> None:
        raise WorkerKilled(f"device lost: {SECRET}")


async def test_an_unexpected_error_gets_a_generic_json_500(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """L54: a bug in the app (here: the image encoder raising) answers JSON, no exception text."""

    async def broken_encoder(*args: object, **kwargs: object) -> list[str]:
        raise RuntimeError(f"encoder bug: {SECRET}")

    monkeypatch.setattr("omni_trio.serve._images.encode_images", broken_encoder)
    service, _ = make_service()
    transport = httpx.ASGITransport(app=service.app, raise_app_exceptions=False)
    with anyio.fail_after(BUDGET):
        async with (
            service.app.router.lifespan_context(service.app),
            httpx.AsyncClient(transport=transport, base_url="http://test") as client,
        ):
            response = await client.post(PATH, json={"prompt": "x"})
            assert response.status_code == 500
            assert response.json()["error"]["code"] == "internal_error"
            assert SECRET not in response.text
            assert (await client.get("/health")).status_code == 200


def traceback_text(record: logging.LogRecord) -> str:
    """The traceback a record carries: formatted in the engine thread, or by a formatter."""
    if record.exc_text:
        return record.exc_text
    assert record.exc_info is not None
    return logging.Formatter().formatException(record.exc_info)


async def post_and_read_error(
    client: httpx.AsyncClient, stream: bool
) -> tuple[httpx.Response, dict[str, Any]]:
    """Post a generation; return the response and its error object (JSON or ``error`` event)."""
    response = await client.post(PATH, json={"prompt": "x", "stream": stream})
    if stream:
        event, data = parse_sse(response.text)[-1]
        assert (response.status_code, event) == (200, "error")
        return response, data["error"]
    return response, response.json()["error"]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_a_runner_failure_leaks_nothing_and_is_logged(
    stream: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """L54: when the model raises, the client gets a generic 500 (or ``error`` event)
    naming its request id, with none of the exception's text; the server log gets the
    traceback at ERROR, once, on the ``omni_trio.engine`` logger; the next request runs."""
    service, _ = make_service(SecretRunner())
    with anyio.fail_after(BUDGET), caplog.at_level(logging.ERROR, "omni_trio"):
        async with serving(service) as client:
            response, error = await post_and_read_error(client, stream)
            assert SECRET not in response.text
            request_id = response.headers["x-request-id"]
            assert request_id in error["message"]
            assert (error["type"], error["code"]) == ("server_error", "generation_failed")
            if not stream:
                assert response.status_code == 500
            records = [r for r in caplog.records if r.levelno >= logging.ERROR]
            assert [(r.name, getattr(r, "request_id", None)) for r in records] == [
                ("omni_trio.engine", request_id)
            ]
            assert request_id in records[0].getMessage()
            assert SECRET in traceback_text(records[0])
            good = await client.post(PATH, json={"prompt": "y", "num_inference_steps": 1})
            assert good.status_code == 200
            text = (await client.get("/metrics")).text
            assert metric(text, "omni_trio_requests_total", outcome="failed") == 1


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_a_dead_worker_leaks_nothing_and_is_logged(
    stream: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """L52: when the worker dies, the request gets a generic 503 ``engine_dead`` (or an
    ``error`` event) naming it, with none of the exception's text; the traceback is
    logged; /health says ``dead``; the lifespan's end raises EngineDeadError (L23)."""
    service, _ = make_service(DyingRunner())
    with anyio.fail_after(BUDGET), caplog.at_level(logging.ERROR, "omni_trio"):
        with pytest.raises(ot.EngineDeadError):
            async with serving(service) as client:
                response, error = await post_and_read_error(client, stream)
                assert SECRET not in response.text
                assert response.headers["x-request-id"] in error["message"]
                assert (error["type"], error["code"]) == ("server_error", "engine_dead")
                if not stream:
                    assert response.status_code == 503
                health = await client.get("/health")
                assert (health.status_code, health.json()["status"]) == (503, "dead")
                refused = await client.post(PATH, json={"prompt": "y"})
                assert refused.status_code == 503 and SECRET not in refused.text
        records = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert [r.name for r in records] == ["omni_trio.engine"]  # once, by the engine
        assert SECRET in traceback_text(records[0])


# -- bodies that do not fit ------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [case[1:] for case in HOSTILE_BODIES],
    ids=[case[0] for case in HOSTILE_BODIES],
)
async def test_hostile_bodies_get_400_naming_the_field(
    body: bytes, param: str | None, code: str
) -> None:
    """L52: integers too large for a float or an int64 (written as JSON integer
    literals, beyond Python's own conversion limit too), bodies that are not UTF-8
    (UTF-16, UTF-32, Latin-1, a byte-order mark), JSON nested beyond the parser's
    recursion limit, and text with lone surrogates all get a 400 naming the field,
    never a 500; nothing is admitted; the answer is short."""
    service, runner = make_service(max_body_bytes=1 << 20)
    with anyio.fail_after(BUDGET):
        async with serving(service) as client:
            response = await client.post(PATH, content=body)
            assert len(response.content) < 400
            await assert_refused_and_serving(client, service, runner, response, param, code)


#: Where deep nesting goes, and the 400 it gets when the parser accepts it (None: 200).
NEAR_LIMIT = {"body": "invalid_json", "prompt": "invalid_type", "colour": "unknown_parameter"}


@pytest.mark.parametrize("where", [*NEAR_LIMIT, "svg"])
async def test_nesting_near_the_recursion_limit_gets_400_or_is_ignored(where: str) -> None:
    """L52: JSON nested just under, at and just over the recursion limit (whether the
    parser accepts it depends on the stack it runs on) gets a 400: invalid_json when
    the parser refuses it, else what the value deserves; as the value of ``svg``
    (an object, type-checked, then ignored) it is served when it parses."""
    service, _ = make_service(max_body_bytes=1 << 20)
    limit = sys.getrecursionlimit()
    outcomes: set[int | str] = set()
    with anyio.fail_after(BUDGET):
        async with serving(service) as client:
            for depth in range(limit - 100, limit + 20, 10):
                body = nested(depth, where, objects=where == "svg")
                response = await client.post(PATH, content=body)
                if where == "svg" and response.status_code == 200:
                    outcomes.add(200)
                    continue
                assert response.status_code == 400, (depth, response.text)
                code = response.json()["error"]["code"]
                assert code in {"invalid_json", NEAR_LIMIT.get(where)}, (depth, code)
                outcomes.add(code)
    assert "invalid_json" in outcomes  # the limit was reached


async def test_surrogate_pairs_are_text() -> None:
    """L52: a surrogate pair escaped in JSON (an emoji) is valid text and is served."""
    service, runner = make_service()
    with anyio.fail_after(BUDGET):
        async with serving(service) as client:
            body = b'{"prompt": "a \\ud83d\\ude00 flower", "negative_prompt": "\\u00e9"}'
            response = await client.post(PATH, content=body)
            assert response.status_code == 200, response.text
            assert runner.prepares == 1
