"""An S3-compatible server on 127.0.0.1 for the output store's tests and benchmarks (L97).

The server is moto's (``moto[server]``), reached over HTTP as boto3 would reach a MinIO or
AWS, with dummy credentials from the standard ``AWS_*`` variables (no profile, no shared
files, no instance metadata: nothing leaves the host):

- ``threaded_s3``: moto's ``ThreadedMotoServer`` in a thread of this process (the tests:
  nothing to start but a thread);
- ``s3_process``: moto's server in a process of its own (a benchmark's: its work takes
  no time from the process that measures);
- ``AWS_VARIABLES`` and ``CLEARED``: the variables to set and to clear, in this process
  (``pytest.MonkeyPatch``) or in a server's (``aws_environment``, with the endpoint);
- ``new_bucket``: a new, empty bucket;
- the module-scoped fixture ``endpoint``: ``threaded_s3``'s URL, this process's ``AWS_*``
  variables set for as long (a test module imports it).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

__all__ = [
    "AWS_VARIABLES",
    "CLEARED",
    "aws_environment",
    "endpoint",
    "new_bucket",
    "s3_process",
    "threaded_s3",
]

#: What boto3 reads: dummy credentials, a region, and no file or metadata service.
AWS_VARIABLES = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_CONFIG_FILE": "/nonexistent/aws-config",
    "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/aws-credentials",
    "AWS_EC2_METADATA_DISABLED": "true",
}
#: Variables of the environment that would send boto3 elsewhere, cleared.
CLEARED = ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN")

#: Seconds moto's server may take to answer once started.
START_S = 60.0


def aws_environment(endpoint: str) -> dict[str, str]:
    """This process's environment for a server process whose output store is a bucket
    of ``endpoint`` (``--output-store s3://...``): the dummy credentials, the endpoint."""
    env = {name: value for name, value in os.environ.items() if name not in CLEARED}
    return {**env, **AWS_VARIABLES, "AWS_ENDPOINT_URL": endpoint}


@contextmanager
def threaded_s3() -> Iterator[str]:
    """moto's server in a thread of this process, on 127.0.0.1: its URL (the ``AWS_*``
    variables of this process are the caller's to set)."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        yield f"http://{host}:{port}"
    finally:
        server.stop()


@pytest.fixture(scope="module")
def endpoint() -> Iterator[str]:
    """An S3-compatible server on 127.0.0.1 for the module; its URL. The ``AWS_*``
    variables boto3 reads are set for as long (``AWS_VARIABLES``; ``CLEARED`` cleared), so
    that a server process the module starts inherits them too."""
    with pytest.MonkeyPatch.context() as patch:
        for name in CLEARED:
            patch.delenv(name, raising=False)
        for name, value in AWS_VARIABLES.items():
            patch.setenv(name, value)
        with threaded_s3() as url:
            yield url


@contextmanager
def s3_process(port: int) -> Iterator[str]:
    """moto's server in a process of its own on 127.0.0.1:``port``: its URL, once it
    answers; stopped at the end, whatever happens.

    Raises:
        RuntimeError: it exited, or did not answer within ``START_S``.
    """
    import httpx

    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + START_S
        while True:
            try:
                httpx.get(f"{url}/moto-api/", timeout=2)
                break
            except httpx.TransportError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto's S3 server did not start on {url}") from None
                time.sleep(0.05)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


def new_bucket(endpoint: str) -> str:
    """A new, empty bucket on ``endpoint``: its name (the ``AWS_*`` variables set, or
    passed: the credentials are the dummy ones)."""
    import boto3

    name = f"outputs-{uuid.uuid4().hex[:12]}"
    session = boto3.session.Session(
        aws_access_key_id=AWS_VARIABLES["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=AWS_VARIABLES["AWS_SECRET_ACCESS_KEY"],
        region_name=AWS_VARIABLES["AWS_DEFAULT_REGION"],
    )
    client = session.client("s3", endpoint_url=endpoint)
    try:
        client.create_bucket(Bucket=name)
    finally:
        client.close()
    return name
