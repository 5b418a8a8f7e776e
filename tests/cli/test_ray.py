"""``omni-trio serve --ray``: N replicas behind Ray Serve's proxy, and a SIGTERM, to the
process or to its whole process group, that leaves no Ray process behind.

Determinism rules:
- the server is a subprocess with a local Ray cluster of its own (loopback, usage
  stats off), in a session of its own (so that its process group is its alone),
  killed in a ``finally``; its log goes to a file;
- every wait is a bounded poll; pytest-timeout bounds the test;
- a Ray process is a descendant of the server's process, found in /proc; none may be
  alive afterwards.

An option Ray would refuse is refused before any Ray process starts, in this process.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from omni_trio.cli import main
from omni_trio.cli._loadtest import PATH
from omni_trio.serve._ray_ingress import REPLICA_HEADER
from tests.support.cli import ROOT, alive, descendants, free_port
from tests.support.serve import poll_until

HAVE_RAY = importlib.util.find_spec("ray") is not None

STEP_S = 0.01
STARTUP_S = 150.0
#: The bound on the stop after a SIGTERM: the replicas drain (idle here), Ray stops
#: (about 3 s here). A group SIGTERM that kills Ray's own processes first makes Ray
#: Serve's controller wait 30 s for them, and the whole stop about 37 s.
STOP_S = 25.0


@pytest.mark.skipif(not HAVE_RAY, reason="needs the ray extra: pip install 'omni_trio[ray]'")
def test_a_port_ray_cannot_use_is_refused_before_ray_starts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``--ray --port 0``: Ray Serve's proxy needs a fixed port: one line, status 2,
    checked before the model, the port or the logging."""
    assert main(["serve", "--ray", "--model", "fake", "--port", "0"]) == 2
    assert capsys.readouterr().err == (
        "omni-trio: error: --port: Ray Serve's proxy needs a fixed port with --ray, not 0\n"
    )


@pytest.mark.timeout(240)
@pytest.mark.ray
@pytest.mark.skipif(not HAVE_RAY, reason="needs the ray extra: pip install 'omni_trio[ray]'")
@pytest.mark.parametrize("target", ["process", "group"])
def test_serve_ray_serves_replicas_and_sigterm_leaves_no_ray_process(
    tmp_path: Path, target: str
) -> None:
    """L45, L47: ``omni-trio serve --ray --replicas 2`` serves the API behind Ray's proxy; SIGTERM
    deletes the app, stops the local cluster and exits 0 with no Ray process left, within
    ``STOP_S``, whether it reaches the process or its whole process group (as ``timeout``
    and supervisors send it): Ray's own processes are not in that group."""
    port = free_port()
    log = tmp_path / "serve-ray.log"
    command = [sys.executable, "-m", "omni_trio", "serve", "--ray", "--replicas", "2"]
    command += ["--model", "fake", "--port", str(port), "--step-seconds", str(STEP_S)]
    with log.open("wb") as out:
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    seen: set[int] = set()
    try:

        def ready() -> bool:
            assert process.poll() is None, log.read_text(errors="replace")
            seen.update(descendants(process.pid))
            try:
                return httpx.get(f"{url}/health", timeout=2).status_code == 200
            except httpx.TransportError:
                return False

        poll_until(ready, timeout=STARTUP_S, what="serve --ray to answer /health")
        answer = httpx.post(
            url + PATH, json={"prompt": "a flower", "num_inference_steps": 2}, timeout=30
        )
        assert answer.status_code == 200, answer.text
        assert answer.headers[REPLICA_HEADER]
        seen.update(descendants(process.pid))
        assert len(seen) >= 4, seen  # gcs_server, raylet, the controller, the replicas...
        if target == "group":
            os.killpg(process.pid, signal.SIGTERM)
        else:
            process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=STOP_S) == 0, log.read_text(errors="replace")
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)
    poll_until(lambda: not alive(seen), timeout=10, what="every Ray process to exit")
    text = log.read_text(errors="replace")
    assert "Traceback" not in text
    assert "Controller failed to shut down" not in text, text
