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
from collections.abc import Sequence
from typing import Any

import anyio
import httpx
import pytest

import omni_trio as ot
from omni_trio.testing import FakeRunner, FakeState

from .test_serve_app import PATH, make_service, metric, parse_sse, serving
from .util import BUDGET

pytestmark = pytest.mark.anyio

#: A string that must never appear in anything a client receives.
SECRET = "s3cr3t-model-internals-0xDEADBEEF"


class SecretRunner(FakeRunner):
    """Raises at its second step an exception whose text carries ``SECRET``."""

    def step(self, states: Sequence[FakeState]) -> None:
        if any(state.steps_done == 1 for state in states):
            raise RuntimeError(f"CUDA error in {SECRET}")
        super().step(states)


class WorkerKilled(BaseException):
    """Not an Exception: raised from the runner, it kills the engine's worker (L23)."""


class DyingRunner(FakeRunner):
    """Kills the worker at its first step with ``SECRET`` in the exception's text."""

    def step(self, states: Sequence[FakeState]) -> None:
        raise WorkerKilled(f"device lost: {SECRET}")


def traceback_text(record: logging.LogRecord) -> str:
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
    """L52: when the model raises, the client gets a generic 500 (or ``error`` event)
    naming its request id, with none of the exception's text; the server log gets the
    traceback at ERROR, on the ``omni_trio.serve`` logger; the next request runs."""
    service, _ = make_service(SecretRunner())
    with anyio.fail_after(BUDGET), caplog.at_level(logging.ERROR, "omni_trio.serve"):
        async with serving(service) as client:
            response, error = await post_and_read_error(client, stream)
            assert SECRET not in response.text
            request_id = response.headers["x-request-id"]
            assert request_id in error["message"]
            assert (error["type"], error["code"]) == ("server_error", "generation_failed")
            if not stream:
                assert response.status_code == 500
            records = [r for r in caplog.records if r.name == "omni_trio.serve"]
            assert [(r.levelno, request_id in r.getMessage()) for r in records] == [
                (logging.ERROR, True)
            ]
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
    with anyio.fail_after(BUDGET), caplog.at_level(logging.ERROR, "omni_trio.serve"):
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
        records = [r for r in caplog.records if r.name == "omni_trio.serve"]
        assert records and all(r.levelno == logging.ERROR for r in records)
        assert SECRET in traceback_text(records[0])
