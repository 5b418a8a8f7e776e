"""SIGTERM and SIGINT drain the real server, under Hypercorn (trio) and Uvicorn (asyncio): L53.

Determinism rules:
- each test starts its own ``python -m omni_trio serve --model fake`` subprocess
  (``run_server``: free loopback port, log in a file, killed in a ``finally``);
- the fake model sleeps 20 ms per step: a long request (400 steps, 8 s) outlasts
  any grace period here, a short one (25 steps, 0.5 s) fits in the 1.5 s grace;
- the states are read from the server (``/metrics``, ``/health``, events), every
  wait is bounded, and the client side runs in threads joined with timeouts;
- hostile clients are raw sockets: one that stops reading (a 4 KiB receive
  buffer, a stream of about 240 KB per step: the server's writes block within a
  few steps), and ones that send half a request, or nothing, and then wait;
- what the interpreter's exit does after "stopped" is read by an ``atexit`` hook
  of the server's own process (``EXIT_PROBE``), as counts: no wall time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from omni_trio.cli._serve import add_serve_arguments
from omni_trio.cli._sockets import abort_connections
from tests.support.cli import ROOT, free_port
from tests.support.serve import PATH, SERVERS, Server, parse_sse_lines, poll_until, run_server

STEP_S = 0.02
FAKE = ["--model", "fake", "--step-seconds", str(STEP_S), "--max-steps", "1000"]


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    """Client threads; every future is waited for with a timeout."""
    with ThreadPoolExecutor(max_workers=4) as executor:
        yield executor


def stream_events(
    server: Server, body: dict[str, Any], first: threading.Event
) -> list[tuple[str, dict[str, Any]]]:
    """Stream a generation; set ``first`` at the first event; return every event."""
    events = []
    with httpx.stream("POST", f"{server.url}{PATH}", json=body, timeout=30) as response:
        if response.status_code != 200:
            first.set()
            raise AssertionError(f"{response.status_code}: {response.read().decode()}")
        for event in parse_sse_lines(response.iter_lines()):
            events.append(event)
            first.set()
    return events


def start_long_stream(
    server: Server, pool: ThreadPoolExecutor
) -> Future[list[tuple[str, dict[str, Any]]]]:
    """A streaming request that outlasts any grace period here; returns once it runs."""
    first = threading.Event()
    body = {"prompt": "long", "num_inference_steps": 400, "stream": True}
    future = pool.submit(stream_events, server, body, first)
    assert first.wait(timeout=20), "the long request never started"
    if future.done():
        future.result()  # raises what went wrong
    return future


def wait_exit(server: Server, timeout: float) -> int:
    code = server.process.wait(timeout=timeout)
    assert "engine threads left: none; other non-daemon threads: none" in server.log_text()
    assert "Traceback" not in server.log_text(), server.log_text()
    return code


@pytest.mark.parametrize("server_kind", SERVERS)
def test_sigterm_drains_then_exits_0(
    server_kind: str, tmp_path: Path, pool: ThreadPoolExecutor
) -> None:
    """L53: on SIGTERM /health turns 503 and new requests get 503; a running request
    that finishes within shutdown_grace completes, one that does not is cut (an
    ``error`` event, shutting_down); the process exits 0 with no engine thread left."""
    args = [*FAKE, "--shutdown-grace", "1.5"]
    with run_server(*args, server=server_kind, log_dir=tmp_path) as server:
        long = start_long_stream(server, pool)
        short = pool.submit(server.post, {"prompt": "short", "num_inference_steps": 25})
        poll_until(
            lambda: server.sample("omni_trio_requests_running") == 2,
            timeout=10,
            what="both requests to run",
        )
        server.process.send_signal(signal.SIGTERM)
        poll_until(lambda: server.health() == 503, timeout=5, what="/health to turn 503")
        refused = server.post({"prompt": "late"})
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "shutting_down"
        completed = short.result(timeout=20)
        assert completed.status_code == 200, completed.text
        events = long.result(timeout=20)
        event, data = events[-1]
        assert (event, data["error"]["code"]) == ("error", "shutting_down")
        steps = [d["step"] for e, d in events if e == "image_generation.progress"]
        assert steps[-1] < 400
        # The hang budget is the bound: wall time is not asserted on a shared machine.
        assert wait_exit(server, timeout=20) == 0


@pytest.mark.parametrize("server_kind", SERVERS)
def test_second_sigint_ends_the_grace_at_once(
    server_kind: str, tmp_path: Path, pool: ThreadPoolExecutor
) -> None:
    """L53: SIGINT drains like SIGTERM; a second SIGINT ends a long grace period at
    once: the running request is cut at its next step and the process exits 0. The
    second signal is logged, and so is the drain's summary (it used to skip both)."""
    args = [*FAKE, "--shutdown-grace", "60"]
    with run_server(*args, server=server_kind, log_dir=tmp_path) as server:
        long = start_long_stream(server, pool)
        server.process.send_signal(signal.SIGINT)
        poll_until(lambda: server.health() == 503, timeout=5, what="/health to turn 503")
        assert long.running()  # within its 60 s grace
        server.process.send_signal(signal.SIGINT)
        event, data = long.result(timeout=20)[-1]
        assert (event, data["error"]["code"]) == ("error", "shutting_down")
        # Exiting within the budget (20 s) is exiting before the 60 s grace ran out.
        assert wait_exit(server, timeout=20) == 0
        log = server.log_text()
        assert "SIGINT again: the grace period ends now; running requests stop" in log
        assert "drained, cut short: 0 completed, 1 aborted, 0 failed in all" in log


def stalled_stream(server: Server) -> socket.socket:
    """Start a large streaming answer whose client reads its first bytes, then stops reading."""
    sock = socket.socket()
    # Before connecting, so the advertised window stays that small.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(10)
    sock.connect(("127.0.0.1", server.port))
    # 4 previews of 128x128 per step: about 240 KB of events per step.
    body = {"prompt": "stall", "num_inference_steps": 400, "stream": True}
    body |= {"preview_every": 1, "size": "1024x1024", "n": 4}
    data = json.dumps(body).encode()
    head = f"POST {PATH} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {len(data)}\r\n\r\n"
    sock.sendall(head.encode() + data)
    assert sock.recv(64).startswith(b"HTTP/1.1 200")
    return sock


HALF_REQUESTS = [
    b"",  # connects, sends nothing
    b"POST /v1/images/generations HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Le",
    b"POST /v1/images/generations HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n\r\n{",
]


@pytest.mark.parametrize("client", ["stops-reading", "half-requests"])
@pytest.mark.parametrize("server_kind", SERVERS)
def test_shutdown_is_bounded_whatever_clients_do(
    server_kind: str, client: str, tmp_path: Path
) -> None:
    """L53: after the grace period and --close-timeout, connections still open are
    aborted and the process exits 0, even when a client stopped reading a stream
    (Hypercorn writes in a shielded scope: nothing else ends that write) or holds
    half a request, or an idle connection; nothing is logged as a crash."""
    args = [*FAKE, "--max-size", "1024", "--shutdown-grace", "0.5", "--close-timeout", "1"]
    with run_server(*args, server=server_kind, log_dir=tmp_path) as server:
        if client == "stops-reading":
            socks = [stalled_stream(server)]
            # 40 steps: about 10 MB of events for a client that took 64 bytes, far
            # more than the kernel buffers, so the server's write is blocked by now.
            poll_until(
                lambda: server.sample("omni_trio_engine_steps_total") >= 40,
                timeout=20,
                what="40 steps of the stalled stream",
            )
        else:
            socks = [socket.create_connection(("127.0.0.1", server.port)) for _ in HALF_REQUESTS]
            for sock, data in zip(socks, HALF_REQUESTS, strict=True):
                sock.sendall(data)
            poll_until(lambda: server.health() == 200, timeout=5, what="/health")
        try:
            server.process.send_signal(signal.SIGTERM)
            # Without the bounded close the process never exits (Hypercorn's shielded
            # write waits for the stalled reader forever): the budget is the bound.
            assert wait_exit(server, timeout=30) == 0
        finally:
            for sock in socks:
                sock.close()
        if client == "stops-reading":
            assert "aborted 1 connection(s) still open 1 s after the drain" in server.log_text()


#: ``serve``, with an ``atexit`` hook that logs what the exit's garbage collections would
#: walk: the objects the collector tracks, and those frozen out of it.
EXIT_PROBE = """\
import atexit, gc, sys
from omni_trio.cli import main


def probe():
    tracked, frozen = len(gc.get_objects()), gc.get_freeze_count()
    print(f"exit probe: tracked {tracked} frozen {frozen}", file=sys.stderr, flush=True)


atexit.register(probe)
sys.exit(main(sys.argv[1:]))
"""


def test_the_exit_after_stopped_has_nothing_to_collect(tmp_path: Path) -> None:
    """L53: once the server logged "stopped", the interpreter's exit walks no object: all
    of them are frozen out of the garbage collector. The exit's full collections walked
    every object the model libraries and the servers made, 1 to 3 s after "stopped" with
    tiny SD on a 2-core machine; the hook runs where they begin (``atexit``)."""
    port = free_port()
    command = [sys.executable, "-c", EXIT_PROBE, "serve", "--model", "fake"]
    command += ["--port", str(port), "--no-access-log"]
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    server = Server(process, f"http://127.0.0.1:{port}", port, log)
    try:
        poll_until(
            lambda: process.poll() is not None or server.health() == 200,
            timeout=60,
            what="the server to start",
        )
        assert server.health() == 200, server.log_text()
        process.send_signal(signal.SIGTERM)
        assert wait_exit(server, timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=30)
    *_, stopped, probed = server.log_text().splitlines()
    assert "stopped; engine threads left: none" in stopped
    found = re.fullmatch(r"exit probe: tracked (\d+) frozen (\d+)", probed)
    assert found is not None, probed
    tracked, frozen = int(found[1]), int(found[2])
    assert tracked * 100 < frozen, (tracked, frozen)


def listener() -> socket.socket:
    sock = socket.create_server(("127.0.0.1", 0))
    sock.settimeout(10)
    return sock


def test_abort_connections_resets_only_the_servers_connections() -> None:
    """L53: abort_connections resets exactly the TCP connections accepted on the given
    port: not its listener (which still accepts), not a connection accepted on another
    port, not this process's own outgoing connection to that port."""
    with contextlib.ExitStack() as stack:
        server, other = stack.enter_context(listener()), stack.enter_context(listener())
        port = server.getsockname()[1]
        client = stack.enter_context(socket.create_connection(("127.0.0.1", port), timeout=10))
        accepted = stack.enter_context(server.accept()[0])
        other_client = stack.enter_context(
            socket.create_connection(other.getsockname(), timeout=10)
        )
        other_accepted = stack.enter_context(other.accept()[0])
        assert abort_connections({port}) == 1
        assert client.recv(16) == b""  # the server's end shut down: end of stream
        with pytest.raises(BrokenPipeError):
            accepted.sendall(b"x")
        other_client.sendall(b"still")
        assert other_accepted.recv(16) == b"still"
        accepted.close()  # as the server does with an aborted connection
        later = stack.enter_context(socket.create_connection(("127.0.0.1", port), timeout=10))
        stack.enter_context(server.accept()[0])  # the listener still accepts
        assert abort_connections({port}) == 1
        assert later.recv(16) == b""


@pytest.mark.parametrize("text", ["-1", "nan", "inf", "soon"])
def test_close_timeout_must_be_seconds(text: str) -> None:
    """--close-timeout takes a finite number of seconds >= 0."""
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    assert parser.parse_args(["--model", "fake", "--close-timeout", "0.5"]).close_timeout == 0.5
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "fake", "--close-timeout", text])
