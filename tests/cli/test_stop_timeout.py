"""A step that never returns: the server's shutdown is still bounded (L37, L53).

Determinism rules:
- each test starts its own ``python -m omni_trio serve --model fake`` subprocess
  (``run_server``: free loopback port, log in a file, killed in a ``finally``)
  whose fake model sleeps a day in its one step, in one call: no cancel point, no
  boundary, as a model stuck inside one attention block;
- the request streams, so its id arrives in the response's headers at once; the
  client runs in a thread that ends when the server does;
- the only wait is the process's exit, bounded by a generous hang budget (the
  stated bound is 0.5 + 1 + 2 s here): wall time is not asserted on a shared machine.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.support.serve import PATH, SERVERS, Server, poll_until, run_server

#: The fake model's step: a day, far beyond any budget here.
STUCK_STEP_S = 86_400
#: The hang budget for the exit: the bound (3.5 s) with room for a loaded machine.
EXIT_BUDGET_S = 60


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(max_workers=1) as executor:
        yield executor


def stream_until_the_end(server: Server, request_id: list[str], started: threading.Event) -> None:
    """Stream a generation; record its id from the headers; return when the server dies."""
    try:
        body = {"prompt": "stuck", "stream": True}
        with httpx.stream("POST", f"{server.url}{PATH}", json=body, timeout=None) as response:
            request_id.append(response.headers["x-request-id"])
            started.set()
            for _ in response.iter_lines():
                pass
    except httpx.HTTPError:
        pass  # the server is gone: the end this test waits for
    finally:
        started.set()


@pytest.mark.parametrize("server_kind", SERVERS)
def test_a_step_that_never_returns_ends_the_process_with_status_1(
    server_kind: str, tmp_path: Path, pool: ThreadPoolExecutor
) -> None:
    """L37, L53: SIGTERM while a step never returns: after the grace and ``--stop-timeout``
    the engine logs the worker and the request it holds; 2 s later the server logs them
    again and exits with status 1, whatever the step does."""
    args = ["--model", "fake", "--step-seconds", str(STUCK_STEP_S)]
    args += ["--shutdown-grace", "0.5", "--stop-timeout", "1"]
    with run_server(*args, server=server_kind, log_dir=tmp_path) as server:
        request_id: list[str] = []
        started = threading.Event()
        client = pool.submit(stream_until_the_end, server, request_id, started)
        assert started.wait(timeout=30) and request_id, server.log_text()
        poll_until(
            lambda: server.sample("omni_trio_requests_running") == 1,
            timeout=10,
            what="the request to run",
        )
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(timeout=EXIT_BUDGET_S) == 1
        client.result(timeout=30)
        log = server.log_text()
    [held] = request_id
    assert "has not exited 1 s after shutdown cut its requests" in log, log
    assert f"it holds {held} (step 1 of" in log
    assert f"shutdown: worker omni-trio-0 still holds {held}" in log
    [left] = [line for line in log.splitlines() if "exiting with status 1" in line]
    assert "engine threads left:" in left and "omni-trio-0-worker" in left
