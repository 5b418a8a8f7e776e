"""Outputs as signed URLs on an S3-compatible bucket (L97), through boto3.

Determinism rules:
- the S3-compatible server is moto's (``moto[server]``'s ``ThreadedMotoServer``), started
  once for this module (tests/support/s3.py's ``endpoint``) on 127.0.0.1 and an ephemeral
  port, in a thread of this process; boto3 reaches it over HTTP as it would a MinIO or
  AWS, with credentials from the standard ``AWS_*`` variables (set by the fixture; no
  profile or instance role is read, nothing leaves the host);
- each test has a bucket of its own; the services run in their own lifespan inside
  ``anyio.fail_after(BUDGET)`` on trio and asyncio, over ``httpx.ASGITransport``;
- expiry reads a fake wall clock the test moves; a sweep is called, never waited for.
"""

from __future__ import annotations

import base64
import pickle
from typing import Any

import anyio
import pytest

pytest.importorskip("boto3", reason="the s3 extra")
pytest.importorskip("moto.server", reason="moto[server], of the test extra")

import boto3

from omni_trio.serve import OutputConfig, OutputStoreError, S3Store
from tests.support.core import BUDGET
from tests.support.jobs import create, finished
from tests.support.outputs import (
    SECRET,
    START,
    WallClock,
    error_of,
    generate,
    image_service,
    local,
)
from tests.support.s3 import endpoint as endpoint
from tests.support.s3 import new_bucket
from tests.support.serve import serving

pytestmark = pytest.mark.anyio


@pytest.fixture
def bucket(endpoint: str) -> str:
    """A new, empty bucket."""
    return new_bucket(endpoint)


def objects(endpoint: str, bucket: str) -> dict[str, bytes]:
    """Every object of ``bucket`` (whole keys, the prefix included) and its bytes."""
    client = boto3.session.Session().client("s3", endpoint_url=endpoint)
    try:
        listed = client.list_objects_v2(Bucket=bucket).get("Contents", [])
        return {
            entry["Key"]: client.get_object(Bucket=bucket, Key=entry["Key"])["Body"].read()
            for entry in listed
        }
    finally:
        client.close()


def s3_outputs(endpoint: str, bucket: str, clock: WallClock, **fields: Any) -> OutputConfig:
    store = S3Store(bucket, "omni/outputs", endpoint_url=endpoint)
    return OutputConfig(store=store, secret=SECRET, ttl_s=60.0, clock=clock, **fields)


def test_the_bucket_store_writes_reads_lists_and_deletes(endpoint: str, bucket: str) -> None:
    """L97: an ``S3Store`` writes an object whole under its prefix (one PUT), reads it
    back, lists its keys by prefix (the prefix stripped, foreign objects left out) and
    deletes them; a missing key reads ``None``; a pickled store (a Ray replica's) makes
    its own client."""
    store = S3Store(bucket, "/omni/outputs/", endpoint_url=endpoint)
    store.open()
    try:
        store.put("images/img-1/100-0.png", b"png")
        store.put("videos/video_1/100-video.mp4", b"mp4")
        assert objects(endpoint, bucket) == {
            "omni/outputs/images/img-1/100-0.png": b"png",
            "omni/outputs/videos/video_1/100-video.mp4": b"mp4",
        }
        found = store.get("images/img-1/100-0.png")
        assert found is not None and found.size == 3
        try:
            assert found.reader.read(2) + found.reader.read(10) == b"png"
        finally:
            found.reader.close()
        assert store.get("images/img-2/100-0.png") is None
        assert sorted(store.list_keys()) == [
            "images/img-1/100-0.png",
            "videos/video_1/100-video.mp4",
        ]
        assert store.list_keys("videos/") == ["videos/video_1/100-video.mp4"]
        copy = pickle.loads(pickle.dumps(store))
        assert copy.list_keys("images/") == ["images/img-1/100-0.png"]
        copy.close()
        store.delete(["images/img-1/100-0.png", "images/none/1-0.png"])
        assert store.list_keys() == ["videos/video_1/100-video.mp4"]
        with pytest.raises(ValueError, match="not an output key"):
            store.put("../escape", b"")
    finally:
        store.close()


def test_a_bucket_that_cannot_be_reached_is_one_line(endpoint: str) -> None:
    """L97: a bucket that does not exist is an ``OutputStoreError`` at open, one line that
    names it and the server's code, no credential."""
    store = S3Store("no-such-bucket", endpoint_url=endpoint)
    with pytest.raises(OutputStoreError) as raised:
        store.open()
    store.close()
    message = str(raised.value)
    assert "s3://no-such-bucket/" in message and "\n" not in message
    assert "testing" not in message


async def test_an_image_url_streams_from_the_bucket(endpoint: str, bucket: str) -> None:
    """L97: with a bucket store, ``response_format: "url"`` keeps the image in the bucket
    and answers the server's own signed URL, which streams it from there (a JSON 403
    when forged, 404 once expired, which deletes it); another replica with the same
    bucket and secret serves it too."""
    clock = WallClock()
    maker = image_service(s3_outputs(endpoint, bucket, clock))
    replica = image_service(s3_outputs(endpoint, bucket, clock))
    with anyio.fail_after(BUDGET):
        async with serving(maker) as client, serving(replica) as other:
            url = (await generate(client, seed=4, response_format="url"))[0]["url"]
            inline = (await generate(client, seed=4))[0]["b64_json"]
            data = base64.b64decode(inline)
            stored = objects(endpoint, bucket)
            assert list(stored.values()) == [data]
            (name,) = stored
            assert name.startswith("omni/outputs/images/img-")
            for server in (client, other):
                got = await server.get(local(url))
                assert (got.status_code, got.headers["content-type"]) == (200, "image/png")
                assert got.content == data
            forged = local(url).replace("signature=", "signature=x")
            assert error_of(await other.get(forged), 403)["code"] == "invalid_signature"
            clock.now = START + 60
            assert error_of(await other.get(local(url)), 404)["code"] == "url_expired"
            assert objects(endpoint, bucket) == {}


async def test_the_sweep_empties_the_bucket_of_what_expired(endpoint: str, bucket: str) -> None:
    """L97: a sweep deletes the bucket's expired objects (any replica's), keeps the
    others and every object it did not make."""
    clock = WallClock()
    service = image_service(s3_outputs(endpoint, bucket, clock))
    client_s3 = boto3.session.Session().client("s3", endpoint_url=endpoint)
    client_s3.put_object(Bucket=bucket, Key="omni/outputs/readme.txt", Body=b"mine")
    client_s3.close()
    with anyio.fail_after(BUDGET):
        async with serving(service) as client:
            await generate(client, n=2, response_format="url")
            clock.now += 30
            kept = (await generate(client, response_format="url"))[0]["url"]
            clock.now += 31
            assert service.outputs is not None
            assert await service.outputs.sweep() == 2
            left = objects(endpoint, bucket)
            assert len(left) == 2 and left["omni/outputs/readme.txt"] == b"mine"
            assert (await client.get(local(kept))).status_code == 200


async def test_a_video_url_in_the_bucket_goes_with_its_job(endpoint: str, bucket: str) -> None:
    """L97: a video job's content URL keeps its MP4 in the bucket, served through this
    server; deleting the job deletes the object (404 ``file_not_found``)."""
    import time

    service = image_service(
        s3_outputs(endpoint, bucket, WallClock(float(int(time.time())))), ttl_s=60.0
    )
    with anyio.fail_after(BUDGET):
        async with serving(service) as client:
            job = await finished(client, (await create(client, seconds="1"))["id"])
            path = f"/v1/videos/{job['id']}/content"
            mp4 = (await client.get(path)).content
            answer = (await client.get(path, params={"response_format": "url"})).json()
            assert list(objects(endpoint, bucket).values()) == [mp4]
            assert (await client.get(local(answer["url"]))).content == mp4
            assert (await client.delete(f"/v1/videos/{job['id']}")).status_code == 200
            assert objects(endpoint, bucket) == {}
            error = error_of(await client.get(local(answer["url"])), 404)
            assert error["code"] == "file_not_found"
