"""Two servers that share nothing but PostgreSQL and a bucket: SIGKILL the one running a
video job, the other resumes it from its checkpoint and serves its MP4 as a URL (L79, L97,
L98).

Determinism rules:
- the servers are ``python -m omni_trio serve --model tiny-wan`` processes (random
  weights, one torch thread), started at once, each given the same database of the
  session's PostgreSQL (tests/support/postgres.py), the same bucket of moto's S3 server
  (tests/support/s3.py, in a thread of this process) and the same signing key, and
  nothing else: no folder, no port of the other's;
- the kill comes once the database holds the job's checkpoint of its first step or later
  (its row read straight from ``video_jobs``, polled with a deadline) and the row is
  still running; every other wait polls with a deadline too; nothing sleeps to let time
  pass;
- both servers are killed by ``run_servers`` whatever happens; PostgreSQL and the S3
  server are fixtures, stopped with the session and the module.
"""

from __future__ import annotations

import signal
from pathlib import Path

import boto3
import httpx
import pytest

from tests.support.cluster import is_mp4, job_row, node_args, owner_pid
from tests.support.postgres import PostgresServer
from tests.support.postgres import postgres as postgres
from tests.support.s3 import endpoint as endpoint
from tests.support.s3 import new_bucket
from tests.support.serve import poll_until, run_servers

#: Seconds a lease holds: short, the takeover comes within it and a third of it.
LEASE_S = 2.0
#: A job of many steps (about 10-40 ms each here): the kill lands mid-steps.
BODY = {"prompt": "a fox", "seed": 5, "size": "64x64", "num_frames": 9, "num_inference_steps": 80}
#: Seconds two tiny Wan servers may take to start at once on a loaded 2-core machine.
STARTUP_S = 150


@pytest.mark.slow
@pytest.mark.timeout(300)  # two server starts of tiny Wan at once, 15-40 s on 2 cores
def test_a_job_whose_server_is_killed_is_resumed_by_the_other_and_served_as_a_url(
    postgres: PostgresServer, endpoint: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """L79, L98, L97: servers A and B share only a PostgreSQL database and an S3 bucket
    (with one signing key). A job created on A is A's; A is SIGKILLed mid-steps, once the
    database holds its checkpoint. B takes the job over when A's lease lapses and resumes
    it from that checkpoint (``resumes`` 1, ``resumed_from_step`` > 0), completes it, and
    serves its MP4 as a signed URL into the bucket that a plain GET fetches."""
    dsn = postgres.database()
    bucket = new_bucket(endpoint)
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)  # the servers' (the fixture set the rest)
    secret = tmp_path / "url.key"
    secret.write_bytes(b"a key the two servers share, 32+")
    args = node_args(
        dsn=dsn, lease_s=LEASE_S, store=f"s3://{bucket}/omni", secret_file=secret, warm_up=False
    )
    with run_servers(args, args, server="uvicorn", log_dir=tmp_path, startup_s=STARTUP_S) as (
        a,
        b,
    ):
        created = httpx.post(f"{a.url}/v1/videos", json=BODY, timeout=30)
        assert created.status_code == 200, created.text
        job_id = created.json()["id"]

        def checkpointed() -> bool:
            row = job_row(dsn, job_id)
            return row is not None and (row["checkpoint_step"] or 0) >= 1

        poll_until(checkpointed, timeout=60, what="the job's first checkpoint in the database")
        a.process.send_signal(signal.SIGKILL)
        a.process.wait(timeout=30)
        at_kill = job_row(dsn, job_id)
        assert at_kill is not None and owner_pid(at_kill["owner"]) == a.process.pid, at_kill
        assert at_kill["status"] == "in_progress", at_kill
        assert 1 <= at_kill["checkpoint_step"] <= at_kill["step"] < BODY["num_inference_steps"]

        def ended() -> bool:
            status = httpx.get(f"{b.url}/v1/videos/{job_id}", timeout=10).json()["status"]
            return status in ("completed", "failed")

        poll_until(ended, timeout=90, what="B to take the job over and end it")
        job = httpx.get(f"{b.url}/v1/videos/{job_id}", timeout=10).json()
        assert job["status"] == "completed", job
        assert job["omni_trio"]["resumes"] == 1, job
        assert 0 < job["omni_trio"]["resumed_from_step"] <= at_kill["step"], (job, at_kill)
        final = job_row(dsn, job_id)
        assert final is not None and owner_pid(final["owner"]) in (None, b.process.pid)

        answer = httpx.get(f"{b.url}/v1/videos/{job_id}/content?response_format=url", timeout=30)
        assert answer.status_code == 200, answer.text
        url = answer.json()["url"]
        assert url.startswith(f"{b.url}/v1/files/"), url
        fetched = httpx.get(url, timeout=30)
        assert fetched.status_code == 200, fetched.text
        assert is_mp4(fetched.content)
        assert fetched.content == httpx.get(f"{b.url}/v1/videos/{job_id}/content").content
    client = boto3.session.Session().client("s3", endpoint_url=endpoint)
    try:
        keys = [o["Key"] for o in client.list_objects_v2(Bucket=bucket).get("Contents", [])]
    finally:
        client.close()
    assert len(keys) == 1 and keys[0].startswith(f"omni/videos/{job_id}/"), keys
