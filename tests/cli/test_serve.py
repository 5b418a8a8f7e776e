"""``omni-trio serve`` as a user runs it: one-line errors, exit statuses, variables, logs.

Each test runs the command in a subprocess and asserts on its stderr and exit status.
The servers use the fake model on a free loopback port; a busy port is one this test
binds first.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from omni_trio.cli._loadtest import PATH
from tests.support.cli import ROOT, busy_port, free_port, one_line_error, serve

SERVERS = ["hypercorn", "uvicorn"]


@pytest.mark.parametrize(
    ("args", "text"),
    [
        (["--default-size", "64"], "argument --default-size: expected WIDTHxHEIGHT"),
        (["--default-size", "60x64"], "--default-size: the model refuses it: width: must be a"),
        (["--default-size", "4096x64"], "--default-size: the model refuses it: width: must be <="),
        (["--default-steps", "500"], "--default-steps: the model refuses it: num_steps"),
        (["--max-batch-size", "0"], "argument --max-batch-size: expected an integer >= 1"),
        (["--port", "http"], "argument --port: expected an integer from 0 to 65535"),
        (["--shutdown-grace", "-1"], "argument --shutdown-grace: expected a number of seconds"),
        (["--default-guidance", "nan"], "argument --default-guidance: expected a finite number"),
        (["--max-priority", "-1"], "argument --max-priority: expected an integer from 0 to"),
        (["--cache", "fast"], "argument --cache: expected KIND[:THRESHOLD], cache: kind: must"),
        (["--cache", "first-block:0.1"], "--cache: the model refuses it: cache: this runner"),
    ],
)
def test_a_bad_option_is_one_line_and_status_2(args: list[str], text: str) -> None:
    """Options are checked at start (defaults against the model too): one line, status 2."""
    one_line_error(serve("--model", "fake", "--port", "0", *args), 2, text)


def test_a_model_that_is_not_a_diffusers_folder_is_one_line(tmp_path: Path) -> None:
    """A path that does not exist, or a folder without model_index.json: one line, status 2."""
    one_line_error(serve("--model", str(tmp_path / "nope")), 2, "--model: no such folder")
    one_line_error(serve("--model", str(tmp_path)), 2, "is not a diffusers folder")


@pytest.mark.parametrize("server", SERVERS)
def test_a_port_in_use_is_one_line_and_debug_adds_the_traceback(server: str) -> None:
    """A port in use (Hypercorn's and Uvicorn's alike): one line, status 1; --debug adds
    the traceback before it."""
    with busy_port() as port:
        args = ("--model", "fake", "--server", server, "--port", str(port))
        one_line_error(serve(*args), 1, f"cannot listen on 127.0.0.1:{port}: the port is in use")
        debug = serve(*args, "--debug")
    assert debug.returncode == 1 and debug.stderr.startswith("Traceback"), debug.stderr
    assert debug.stderr.endswith("the port is in use\n")


def test_options_come_from_the_environment_and_the_command_line_wins() -> None:
    """OMNI_TRIO_<OPTION> sets an option; a bad value names the variable; an option given
    on the command line wins over its variable (whose value is then never read)."""
    bad = serve(env={"OMNI_TRIO_MODEL": "fake", "OMNI_TRIO_MAX_WAITING": "many"})
    one_line_error(bad, 2, "OMNI_TRIO_MAX_WAITING: expected an integer >= 0, got 'many'")
    high = serve(env={"OMNI_TRIO_MODEL": "fake", "OMNI_TRIO_MAX_PRIORITY": "high"})
    one_line_error(high, 2, "OMNI_TRIO_MAX_PRIORITY: expected an integer from 0 to 2147483647")
    flag = serve(env={"OMNI_TRIO_MODEL": "fake", "OMNI_TRIO_NO_ACCESS_LOG": "perhaps"})
    one_line_error(flag, 2, "OMNI_TRIO_NO_ACCESS_LOG: expected 1 or 0")
    with busy_port() as port:
        env = {"OMNI_TRIO_MODEL": "fake", "OMNI_TRIO_PORT": str(port)}
        one_line_error(serve(env=env), 1, f"127.0.0.1:{port}: the port is in use")
        wins = serve("--port", str(port), env={**env, "OMNI_TRIO_PORT": "not a port"})
        one_line_error(wins, 1, f"127.0.0.1:{port}: the port is in use")
    helped = serve("--help")
    assert "[OMNI_TRIO_MAX_BATCH_SIZE]" in " ".join(helped.stdout.split())


@pytest.mark.parametrize("server", SERVERS)
def test_json_logs_are_one_object_per_line_with_one_access_line_per_request(
    server: str, tmp_path: Path
) -> None:
    """--log-format json: every stderr line is a JSON object (the library's, the server's,
    the access log); a finished request's line carries its request_id; each request has
    exactly one access line (no phantom line without a status); SIGINT drains, logged."""
    port = free_port()
    command = [sys.executable, "-m", "omni_trio", "serve", "--model", "fake", "--server", server]
    command += ["--port", str(port), "--log-format", "json", "--step-seconds", "0"]
    log = tmp_path / "stderr.txt"
    with log.open("w") as err:
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=err, cwd=ROOT)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        ids = []
        for _ in range(3):
            with httpx.Client(headers={"Connection": "close"}) as client:
                response = client.post(f"{url}{PATH}", json={"prompt": "x"}, timeout=30)
            assert response.status_code == 200
            ids.append(response.headers["x-request-id"])
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)
    entries = [json.loads(line) for line in log.read_text().splitlines()]
    assert all({"time", "level", "logger", "message"} <= set(e) for e in entries)
    finished = {e["request_id"]: e for e in entries if e["logger"] == "omni_trio.engine"}
    assert sorted(finished) == sorted(ids)
    assert all(" completed: steps 20/20" in e["message"] for e in finished.values())
    access = [e["message"] for e in entries if e["logger"].endswith(".access")]
    posts = [m for m in access if "POST /v1/images/generations" in m]
    # Hypercorn: '... 1.1" 200 972 "-" "ua"'; Uvicorn: '... HTTP/1.1" 200'.
    assert [m.split('" ')[1].split()[0] for m in posts] == ["200"] * 3, access
    messages = [e["message"] for e in entries if e["logger"] == "omni_trio.serve"]
    assert any(m.startswith("draining: ") for m in messages)
    assert any(m.startswith("drained: 3 completed") for m in messages)
