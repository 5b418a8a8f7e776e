"""Two servers that share nothing but PostgreSQL: SIGKILL the one running a video job and
time the other's takeover (L79, L98). Prints one JSON line per run.

Starts a PostgreSQL server as the tests do (tests/support/postgres.py: Debian's
binaries, 127.0.0.1, a temporary folder), then two ``omni-trio serve --model tiny-wan
--jobs-db ... --jobs-lease LEASE --checkpoint-every 0`` processes; creates a job of 60
steps on the first, kills it (SIGKILL) once the job is 30 % done, and polls the job on
the second every 10 ms: the time from the kill to its takeover (``resumes`` 1), to its
first step after that, and to its end, and the steps it lost.

Usage: .venv/bin/python scripts/measure_takeover.py [LEASE_S] [RUNS]   (from the repo root)
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.support.cli import free_port  # noqa: E402
from tests.support.postgres import start_server  # noqa: E402

STEPS = 60


def serve(port: int, dsn: str, lease_s: float, log: Path) -> subprocess.Popen[bytes]:
    """A server of tiny Wan keeping its jobs in ``dsn``, shared (its log in ``log``)."""
    argv = [
        *(sys.executable, "-m", "omni_trio", "serve", "--model", "tiny-wan"),
        *("--port", str(port), "--jobs-db", dsn, "--jobs-lease", str(lease_s)),
        *("--checkpoint-every", "0", "--log-level", "warning"),
    ]
    with log.open("w") as err:
        return subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err)


def wait_up(port: int) -> None:
    for _ in range(1200):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise SystemExit(f"the server on port {port} did not start")


def job_of(port: int, job_id: str) -> dict[str, Any]:
    found: dict[str, Any] = httpx.get(f"http://127.0.0.1:{port}/v1/videos/{job_id}").json()
    return found


def one_run(dsn: str, lease_s: float, folder: Path) -> dict[str, Any]:
    """Two servers, a job on the first, the first killed at 30 %: the figures."""
    first, second = free_port(), free_port()
    a = serve(first, dsn, lease_s, folder / "a.log")
    b = serve(second, dsn, lease_s, folder / "b.log")
    try:
        wait_up(first)
        wait_up(second)
        body = {"prompt": "a fox", "seed": 1, "seconds": "2", "size": "64x64"}
        body["num_inference_steps"] = STEPS
        job_id = httpx.post(f"http://127.0.0.1:{first}/v1/videos", json=body).json()["id"]
        while (job := job_of(second, job_id))["progress"] < 30:
            time.sleep(0.02)
        a.send_signal(signal.SIGKILL)
        a.wait()
        killed = time.monotonic()
        taken = stepped = None
        while (job := job_of(second, job_id))["status"] not in ("completed", "failed"):
            now = time.monotonic()
            if taken is None and job["omni_trio"]["resumes"]:
                taken, progress = now, job["progress"]
            elif taken is not None and stepped is None and job["progress"] > progress:
                stepped = now
            time.sleep(0.01)
        ended = time.monotonic()
        return {
            "lease_s": lease_s,
            "status": job["status"],
            "kill_to_takeover_s": None if taken is None else round(taken - killed, 3),
            "kill_to_first_step_s": None if stepped is None else round(stepped - killed, 3),
            "kill_to_end_s": round(ended - killed, 3),
            "resumed_from_step": job["omni_trio"]["resumed_from_step"],
            "steps_lost": job["omni_trio"]["steps_lost"],
        }
    finally:
        for server in (a, b):
            if server.poll() is None:
                server.send_signal(signal.SIGTERM)
                server.wait(timeout=60)


def main() -> None:
    lease_s = float(sys.argv[1]) if len(sys.argv) > 1 else 2.0
    runs = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    postgres = start_server()
    try:
        dsn = postgres.dsn(postgres.database())
        for _ in range(runs):
            with tempfile.TemporaryDirectory() as folder:
                sys.stdout.write(json.dumps(one_run(dsn, lease_s, Path(folder))) + "\n")
                sys.stdout.flush()
            dsn = postgres.dsn(postgres.database())  # a fresh database per run
    finally:
        postgres.stop()


if __name__ == "__main__":
    main()
