"""``omni-trio serve`` as a user runs it: one-line errors, exit statuses, variables, logs.

Each test runs the command in a subprocess and asserts on its stderr and exit status.
The servers use the fake model on a free loopback port; a busy port is one this test
binds first.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from omni_trio.cli._loadtest import PATH
from omni_trio.serve._warmup import WARM_UP_STEPS
from tests.support.cli import ROOT, busy_port, free_port, one_line_error, serve
from tests.support.serve import run_server

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
        (["--torch-threads", "0"], "argument --torch-threads: expected an integer from 1 to 4096"),
        (["--cache", "fast"], "argument --cache: expected KIND[:THRESHOLD], cache: kind: must"),
        (["--cache", "first-block:0.1"], "--cache: the model refuses it: cache: this runner"),
    ],
)
def test_a_bad_option_is_one_line_and_status_2(args: list[str], text: str) -> None:
    """Options are checked at start (defaults against the model too): one line, status 2."""
    one_line_error(serve("--model", "fake", "--port", "0", *args), 2, text)


@pytest.mark.parametrize(
    ("args", "text"),
    [
        (["--model", "fake", "--replicas", "2"], "--replicas: applies with --ray only"),
        (["--model", "fake", "--replica-gpus", "1"], "--replica-gpus: applies with --ray only"),
        (["--model", "fake", "--ray-address", "h:1"], "--ray-address: applies with --ray only"),
        (
            ["--model", "fake", "--ray", "--server", "uvicorn"],
            "--server: does not apply with --ray",
        ),
        (["--model", "fake", "--ray", "--close-timeout", "1"], "--close-timeout: does not apply"),
        (["--model", "fake", "--ray", "--no-access-log"], "--no-access-log: does not apply with"),
        (
            ["--model", "tiny-sd", "--step-seconds", "0.1"],
            "--step-seconds: applies to --model fake",
        ),
        (["--model", "fake", "--no-warm-up"], "--no-warm-up: applies to a real model"),
        # Found once the model loaded: what it is decides.
        (["--model", "fake", "--video-fps", "10"], "--video-fps: applies to video models only"),
        (["--model", "fake", "--video-jobs", "2"], "--video-jobs: applies to video models only"),
        (["--model", "fake", "--video-ttl", "2"], "--video-ttl: applies to video models only"),
        (["--model", "fake", "--decode-tile-above", "never"], "--decode-tile-above: applies to"),
        (
            ["--model", "tiny-wan", "--decode-framewise-above", "8"],
            "--decode-framewise-above: applies to LTX-Video models only",
        ),
    ],
)
def test_an_option_that_does_not_apply_is_refused(args: list[str], text: str) -> None:
    """An option that the run would ignore (its mode, its model) is one line, status 2:
    ``--replicas 2`` without ``--ray`` used to serve one replica without a word."""
    one_line_error(serve("--port", "0", *args), 2, text)


def test_a_variable_that_does_not_apply_is_ignored_and_logged() -> None:
    """OMNI_TRIO_REPLICAS without --ray, OMNI_TRIO_VIDEO_FPS with an image model: one
    environment may serve several servers, so a variable that does not apply is no error;
    the log says it is ignored (here the run then stops at a default the model refuses)."""
    env = {"OMNI_TRIO_MODEL": "fake", "OMNI_TRIO_REPLICAS": "2", "OMNI_TRIO_VIDEO_FPS": "10"}
    result = serve("--port", "0", "--default-size", "60x64", env=env)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.splitlines()
    assert lines[-1].startswith("omni-trio: error: --default-size: the model refuses it")
    assert "OMNI_TRIO_REPLICAS ignored: --replicas applies with --ray only" in lines[0]
    assert "OMNI_TRIO_VIDEO_FPS ignored: --video-fps applies to video models only" in lines[1]
    assert len(lines) == 3, lines


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


#: A line of the text log (``cli._logs``'s format).
TEXT_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR) [\w.]+: ")


@pytest.fixture(scope="module")
def tiny_sd_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny SD pipeline saved with ``save_pretrained``, as a user's model folder is."""
    from omni_trio.runners import tiny_pipeline

    folder = tmp_path_factory.mktemp("models") / "tiny-sd"
    tiny_pipeline("sd").save_pretrained(folder)
    return folder


@pytest.mark.parametrize(
    ("model", "log_format", "extra"),
    [("folder", "json", ["--workers", "2"]), ("tiny-sd", "json", []), ("folder", "text", [])],
)
def test_every_log_line_is_a_record_with_a_real_model(
    tmp_path: Path, tiny_sd_folder: Path, model: str, log_format: str, extra: list[str]
) -> None:
    """With a model folder (loaded once per worker) or a tiny model, every line on stderr
    is a JSON object (--log-format json) or a text record: diffusers' "Loading pipeline
    components" and transformers' "Loading weights" bars, and their notices, used to be
    printed raw among them."""
    spec = str(tiny_sd_folder) if model == "folder" else model
    args = ["--model", spec, "--log-format", log_format, *extra]
    with run_server(*args, server="hypercorn", log_dir=tmp_path) as server:
        assert server.post({"prompt": "x", "num_inference_steps": 2}).status_code == 200
        server.process.send_signal(signal.SIGINT)
        assert server.process.wait(timeout=60) == 0
    lines = server.log_text().splitlines()
    if log_format == "json":
        messages = [json.loads(line)["message"] for line in lines]
    else:
        assert [line for line in lines if not TEXT_LINE.match(line)] == []
        messages = lines
    assert any("serving tiny-sd (" in m for m in messages), messages
    # A real model warms up before it answers (L4: --max-step-time holds from the first
    # client): one cold step, then the warm ones the bound reads.
    warm_up = f"warm-up: {WARM_UP_STEPS} step(s) of 64x64 in "
    assert any(warm_up in m for m in messages), messages
    assert any("stopped; engine threads left: none" in m for m in messages), messages


def test_an_error_after_the_log_began_is_a_json_record_too(tmp_path: Path) -> None:
    """--log-format json: a model that does not load (found once the log began) is an ERROR
    record, not a raw 'omni-trio: error:' line; exit 1 all the same."""
    folder = tmp_path / "broken"
    folder.mkdir()
    (folder / "model_index.json").write_text("{not json")
    result = serve("--model", str(folder), "--port", "0", "--log-format", "json")
    assert result.returncode == 1, result.stderr
    entries = [json.loads(line) for line in result.stderr.splitlines()]
    assert entries[-1]["level"] == "ERROR" and entries[-1]["logger"] == "omni_trio.cli"
    assert entries[-1]["message"].startswith(f"omni-trio: error: --model: cannot load '{folder}'")
