"""The real server, as a subprocess, under Hypercorn (trio) and Uvicorn (asyncio): L50-L52.

Determinism rules:
- each server is ``python -m omni_trio serve --model fake`` on a free loopback port
  (bound to port 0 first), its log in a file (never a pipe that could fill up);
  it is killed in a ``finally`` whatever happens;
- the fake model sleeps a fixed time per step, so "mid-way" is a step count read
  from the server's own ``/metrics`` or its progress events, never a guess;
- every wait is a bounded poll (``poll_until``) or an HTTP call with a timeout,
  and pytest-timeout bounds each test;
- one server per backend serves this whole module (``max_batch_size`` 1,
  ``max_waiting`` 1): each test leaves it idle (``wait_idle``).
"""

from __future__ import annotations

import base64
import http.client
import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.support.serve import (
    BAD_BODIES,
    HOSTILE_BODIES,
    PATH,
    ROOT,
    SERVERS,
    Server,
    metric,
    nested,
    parse_sse,
    parse_sse_lines,
    png_size,
    poll_until,
    run_server,
)

STEP_S = 0.01

#: The shared server: one request runs, one waits; limits match test_app's.
SHARED = [
    "--model", "fake", "--model-name", "fake", "--step-seconds", str(STEP_S),
    "--max-batch-size", "1", "--max-waiting", "1", "--max-steps", "1000",
    "--max-size", "256", "--max-n", "4", "--max-body-bytes", "16384",
    "--default-steps", "4", "--default-size", "64x64", "--shutdown-grace", "0",
]  # fmt: skip


@pytest.fixture(scope="module", params=SERVERS)
def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    """One fake-model server per backend for the whole module."""
    log_dir = tmp_path_factory.mktemp("serve")
    with run_server(*SHARED, server=request.param, log_dir=log_dir) as running:
        yield running
        assert "Traceback" not in running.log_text(), running.log_text()


def raw_post(server: Server, headers: dict[str, str], body: bytes = b"") -> socket.socket:
    """Open a connection and send a POST by hand (headers as given, ``body`` as is)."""
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    head = f"POST {PATH} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
    sock.sendall(head.encode() + body)
    return sock


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """Read one HTTP response from ``sock``."""
    response = http.client.HTTPResponse(sock)
    response.begin()
    return response.status, dict(response.getheaders()), response.read()


def wait_server_close(sock: socket.socket) -> None:
    """Read until the server closes the connection (it answered ``Connection: close``).

    Closing first, while the request body is unfinished, races Hypercorn: its reader
    answers the truncated request with a 400 while the app's task still finishes its
    response, and it logs a ``BusyResourceError`` (the client got its response).
    """
    while sock.recv(65536):
        pass


# -- L50 ---------------------------------------------------------------------------


def test_generate_and_stream(server: Server) -> None:
    """L50: JSON with n PNGs, and a server-sent event stream of progress then the image."""
    response = server.post({"prompt": "a flower", "n": 2, "size": "64x32", "seed": 3})
    assert response.status_code == 200, response.text
    assert [png_size(d["b64_json"]) for d in response.json()["data"]] == [(64, 32)] * 2
    assert response.headers["x-request-id"].startswith("img-")
    body = {"prompt": "a flower", "num_inference_steps": 3, "stream": True, "preview_every": 1}
    with httpx.stream("POST", f"{server.url}{PATH}", json=body, timeout=30) as streamed:
        assert streamed.headers["content-type"].startswith("text/event-stream")
        events = parse_sse(streamed.read().decode())
    names = [event for event, _ in events]
    assert names == [
        *["image_generation.progress", "image_generation.partial_image"] * 3,
        "image_generation.completed",
    ]
    assert png_size(events[-1][1]["b64_json"]) == (64, 64)
    models = httpx.get(f"{server.url}/v1/models", timeout=5).json()
    assert [m["id"] for m in models["data"]] == ["fake"]


def test_openai_sdk_is_a_client(server: Server) -> None:
    """L50: the official OpenAI Python SDK works unchanged: generate, stream, errors, models."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=30)
    with client:
        result = client.images.generate(
            model="fake",
            prompt="a flower",
            n=2,
            size="64x64",
            quality="high",
            style="vivid",
            user="someone",
            response_format="b64_json",
            extra_body={"num_inference_steps": 3, "seed": 1},
        )
        assert result.data is not None and len(result.data) == 2
        assert all(png_size(image.b64_json or "") == (64, 64) for image in result.data)
        stream = client.images.generate(
            prompt="a flower", stream=True, partial_images=1, extra_body={"num_inference_steps": 4}
        )
        kinds: list[str] = [event.type for event in stream]
        assert kinds[-1] == "image_generation.completed"
        assert kinds.count("image_generation.partial_image") == 1
        assert kinds.count("image_generation.progress") == 4
        with pytest.raises(openai.BadRequestError) as raised:
            client.images.generate(prompt="a flower", size="60x64")
        assert (raised.value.param, raised.value.code) == ("size", "invalid_value")
        assert [model.id for model in client.models.list()] == ["fake"]


# -- L52 ---------------------------------------------------------------------------


def test_bad_input_gets_400_and_changes_nothing(server: Server) -> None:
    """L52: every bad body gets 400 with an OpenAI-style error naming the field; the
    server admits none of them and serves the next request normally."""
    invalid = server.outcome("invalid")
    steps = server.sample("omni_trio_engine_steps_total")
    for name, body, param, code in BAD_BODIES:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        response = httpx.post(f"{server.url}{PATH}", content=content, timeout=10)
        assert response.status_code == 400, (name, response.text)
        error = response.json()["error"]
        assert (error["param"], error["code"]) == (param, code), name
    for method, path, status in [("GET", "/nope", 404), ("GET", PATH, 405)]:
        response = httpx.request(method, f"{server.url}{path}", timeout=10)
        assert response.status_code == status
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    assert server.outcome("invalid") == invalid + len(BAD_BODIES)
    assert server.sample("omni_trio_engine_steps_total") == steps
    assert server.post({"prompt": "x"}).status_code == 200


def test_hostile_bodies_get_400_from_the_servers(server: Server) -> None:
    """L52: on the real servers' deeper stacks too, huge integer literals, bodies not in
    UTF-8, nesting beyond the recursion limit and lone surrogates get a 400 naming the
    field (the bodies that fit the 16 KiB limit, and 8000 nested arrays)."""
    invalid = server.outcome("invalid")
    cases = [*HOSTILE_BODIES, ("nested 8000 deep", nested(8000, "prompt"), None, "invalid_json")]
    cases = [case for case in cases if len(case[1]) <= 16384]
    for name, body, param, code in cases:
        response = httpx.post(f"{server.url}{PATH}", content=body, timeout=10)
        assert response.status_code == 400, (name, response.text)
        error = response.json()["error"]
        assert (error["param"], error["code"]) == (param, code), name
    assert server.outcome("invalid") == invalid + len(cases)
    assert server.post({"prompt": "x"}).status_code == 200


def test_body_over_the_limit_is_refused_before_parsing(server: Server) -> None:
    """L52: 413 from Content-Length alone (no body sent), and for a chunked body as soon
    as the bytes read pass the limit (16 KiB here)."""
    too_large = server.outcome("too_large")
    with raw_post(server, {"Content-Length": "100000000"}) as sock:
        status, headers, body = read_response(sock)
        assert headers["connection"] == "close"
        wait_server_close(sock)
    assert status == 413 and json.loads(body)["error"]["code"] == "request_too_large"
    # 16385 bytes in two chunks, no terminating chunk: the limit is passed by the last byte.
    chunks = b"2000\r\n" + b" " * 0x2000 + b"\r\n" + b"2001\r\n" + b" " * 0x2001 + b"\r\n"
    with raw_post(server, {"Transfer-Encoding": "chunked"}, chunks) as sock:
        status, _, body = read_response(sock)
        wait_server_close(sock)
    assert status == 413 and json.loads(body)["error"]["code"] == "request_too_large"
    assert server.outcome("too_large") == too_large + 2
    assert server.post({"prompt": "x"}).status_code == 200


def test_queue_full_gets_429_with_retry_after(server: Server) -> None:
    """L52: with one request running and max_waiting (1) waiting, the next gets 429 with
    Retry-After; the waiting one, whose client then leaves, is withdrawn at once."""
    body = {"prompt": "x", "num_inference_steps": 500, "stream": True}
    with httpx.stream("POST", f"{server.url}{PATH}", json=body, timeout=30) as running:
        lines = running.iter_lines()
        next(lines)  # the first event: it runs (keep ``lines``: dropping it closes the stream)
        waiting_body = json.dumps({"prompt": "y", "num_inference_steps": 500}).encode()
        headers = {"Content-Type": "application/json", "Content-Length": str(len(waiting_body))}
        with raw_post(server, headers, waiting_body):
            poll_until(
                lambda: server.sample("omni_trio_requests_waiting") == 1,
                timeout=10,
                what="a waiting request",
            )
            refused = server.post({"prompt": "z"})
            assert refused.status_code == 429
            assert refused.headers["retry-after"] == "1"
            assert refused.json()["error"]["code"] == "queue_full"
    server.wait_idle()


# -- L51 ---------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_disconnect_aborts_and_the_next_request_runs_at_full_speed(
    server: Server, stream: bool
) -> None:
    """L51: a client that disconnects mid-way aborts its request at the next step; /metrics
    shows the abort, at most one step ran for it after the abort was asked, the worker
    holds nothing of it, and the next request runs all its steps.

    Exact, from the server's own counters: the outcome is counted once the request is
    terminal, which is once the worker released it (L8), so nothing runs afterwards.
    """
    steps = 20
    gone = server.outcome("disconnected")
    aborts = server.sample("omni_trio_abort_latency_seconds_count")
    after_abort = server.sample("omni_trio_steps_after_abort_total")
    started = server.sample("omni_trio_engine_steps_total")
    body = {"prompt": "b", "num_inference_steps": 1000, "stream": stream}
    if stream:
        with httpx.stream("POST", f"{server.url}{PATH}", json=body, timeout=30) as response:
            for _, data in parse_sse_lines(response.iter_lines()):
                if data.get("step", 0) >= 10:
                    break
    else:
        content = json.dumps(body).encode()
        with raw_post(server, {"Content-Length": str(len(content))}, content):
            poll_until(
                lambda: server.sample("omni_trio_engine_steps_total") >= started + 10,
                timeout=10,
                what="10 steps of the long request",
            )
    poll_until(lambda: server.outcome("disconnected") == gone + 1, timeout=10, what="the abort")
    text = server.metrics()
    assert metric(text, "omni_trio_abort_latency_seconds_count") == aborts + 1
    # L7: at most one more step for it once the abort was asked.
    assert metric(text, "omni_trio_steps_after_abort_total") - after_abort <= 1
    # Released: nothing of it runs or waits, and its steps stopped short of 1000.
    assert metric(text, "omni_trio_requests_running") == 0
    assert metric(text, "omni_trio_requests_waiting") == 0
    ran = metric(text, "omni_trio_engine_steps_total")
    assert ran - started < 1000
    # Full speed: the next request's steps are the only ones the worker runs meanwhile.
    after = server.post({"prompt": "c", "num_inference_steps": steps})
    assert after.status_code == 200
    assert after.json()["omni_trio"]["steps"] == steps
    assert server.sample("omni_trio_engine_steps_total") == ran + steps


# -- the example client --------------------------------------------------------------


def test_example_client_streams_and_saves(server: Server, tmp_path: Path) -> None:
    """L50: examples/client.py streams progress from a server URL and saves the PNG."""
    out = tmp_path / "out.png"
    command = [sys.executable, str(ROOT / "examples" / "client.py"), server.url]
    command += ["--steps", "5", "--size", "64x32", "--out", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "step 5/5" in result.stderr and "saved" in result.stdout
    assert png_size(base64.b64encode(out.read_bytes()).decode()) == (64, 32)
