"""Outputs as signed URLs on a folder store (L97), in-process over HTTP.

Determinism rules:
- every test runs on trio and asyncio inside the service's own lifespan and
  ``anyio.fail_after(BUDGET)``; requests go through ``httpx.ASGITransport``, the
  OpenAI SDK through ``httpx2.ASGITransport`` (its own client);
- the runners are instant ``FakeRunner``s (an image depends only on its request);
- expiry reads a fake wall clock (``OutputConfig.clock``) the test moves, never the
  time that passes; a sweep is called, never waited for; the sweeper's own loop is
  one trio test on ``autojump_clock``, whose virtual seconds are the fake wall clock's.
"""

from __future__ import annotations

import base64
import logging
import time
import urllib.parse
from pathlib import Path
from typing import Any

import anyio
import httpx2
import openai
import pytest
import trio

from omni_trio.serve import (
    ApiKeys,
    FolderStore,
    OutputConfig,
    OutputStore,
    Service,
)
from omni_trio.serve._output_urls import OutputUrls
from omni_trio.testing import FakeRunner
from tests.support.core import BUDGET
from tests.support.jobs import create, finished
from tests.support.outputs import (
    PATH,
    SECRET,
    START,
    WallClock,
    error_of,
    files_in,
    generate,
    image_service,
    local,
    outputs,
    with_query,
)
from tests.support.serve import ROOT, serving

pytestmark = pytest.mark.anyio

# -- images ---------------------------------------------------------------------------


async def test_an_image_asked_as_a_url_is_kept_in_the_folder_and_served(tmp_path: Path) -> None:
    """L97: ``response_format: "url"`` answers each image's signed URL; the URL serves the
    image's bytes (those base64 gives for the same request), the folder holds them whole
    under the URL's key, and no temporary file is left."""
    clock = WallClock()
    service = image_service(outputs(tmp_path, clock))
    with anyio.fail_after(BUDGET):
        async with serving(service) as client:
            inline = await generate(client, n=2)
            linked = await generate(client, n=2, response_format="url")
            assert [set(item) for item in linked] == [{"url"}, {"url"}]
            for item, expected in zip(linked, inline, strict=True):
                url = item["url"]
                assert url.startswith("http://test/v1/files/images/img-")
                query = dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(url).query))
                assert int(query["expires"]) == START + 60
                got = await client.get(local(url))
                assert got.status_code == 200
                assert got.headers["content-type"] == "image/png"
                assert got.headers["cache-control"] == "private, max-age=60"
                data = base64.b64decode(expected["b64_json"])
                assert got.content == data
                key = urllib.parse.urlsplit(url).path.removeprefix("/v1/files/")
                assert (tmp_path / key).read_bytes() == data
            assert len(files_in(tmp_path)) == 2  # no temporary file
            head = await client.head(local(linked[0]["url"]))
            assert (head.status_code, head.content) == (200, b"")


async def test_a_forged_url_is_a_403_and_an_expired_one_a_404_that_deletes_it(
    tmp_path: Path,
) -> None:
    """L97: a URL whose signature is not this secret's over its key and expiry (altered,
    missing, another key's, another secret's) is a JSON 403 that touches nothing; a
    genuine one past its expiry is a JSON 404 ``url_expired``, and its file is gone."""
    clock = WallClock()
    service = image_service(outputs(tmp_path, clock))
    other = OutputUrls(outputs(tmp_path, clock, secret=b"another secret of 32 bytes long!"))
    with anyio.fail_after(BUDGET):
        async with serving(service) as client:
            first, second = (
                item["url"] for item in await generate(client, n=2, response_format="url")
            )
            signature = dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(first).query))[
                "signature"
            ]
            key = urllib.parse.urlsplit(second).path.removeprefix("/v1/files/")
            forged = [
                with_query(first, signature=("A" if signature[0] != "A" else "B") + signature[1:]),
                with_query(first, expires=str(int(START) + 3600)),
                with_query(first, signature=None),
                with_query(first, expires=None),
                with_query(first, expires="1e9"),
                with_query(second, signature=signature),  # the first's signature
                with_query(second, signature=other.signature(key, int(START) + 60)),
                with_query(first, signature="é" * 43),
            ]
            for url in forged:
                error = error_of(await client.get(url), 403)
                assert (error["code"], error["param"]) == ("invalid_signature", "signature"), url
            assert len(files_in(tmp_path)) == 2
            clock.now = START + 60  # the second of expiry: expired
            error = error_of(await client.get(local(first)), 404)
            assert error["code"] == "url_expired"
            assert len(files_in(tmp_path)) == 1  # deleted on read
            error = error_of(await client.get(local(first)), 404)
            assert error["code"] == "url_expired"
            forged_late = with_query(second, signature=signature)
            assert error_of(await client.get(forged_late), 403)["code"] == "invalid_signature"


async def test_the_sweep_deletes_what_expired_and_nothing_else(tmp_path: Path) -> None:
    """L97: a sweep deletes the objects whose time-to-live passed (their URL then answers
    404 ``file_not_found`` had it not expired, ``url_expired`` as it has) and keeps the
    others and any file it did not make."""
    clock = WallClock()
    service = image_service(outputs(tmp_path, clock))
    (tmp_path / "notes.txt").write_text("not an output")
    with anyio.fail_after(BUDGET):
        async with serving(service) as client:
            old = (await generate(client, response_format="url"))[0]["url"]
            clock.now += 30
            new = (await generate(client, response_format="url"))[0]["url"]
            assert service.outputs is not None
            assert await service.outputs.sweep() == 0
            clock.now += 31  # the first is 61 s old, the second 31
            assert await service.outputs.sweep() == 1
            assert len(files_in(tmp_path)) == 2  # the second, and notes.txt
            assert (await client.get(local(new))).status_code == 200
            assert error_of(await client.get(local(old)), 404)["code"] == "url_expired"
            # A genuine URL whose object is gone (swept by another replica first, say).
            key = urllib.parse.urlsplit(new).path.removeprefix("/v1/files/")
            (tmp_path / key).unlink()
            assert error_of(await client.get(local(new)), 404)["code"] == "file_not_found"
    assert (tmp_path / "notes.txt").read_text() == "not an output"


async def test_two_servers_sharing_the_folder_and_the_secret_serve_each_others_urls(
    tmp_path: Path,
) -> None:
    """L97: any replica that shares the store and the secret serves a URL another made
    (behind a load balancer, the download lands anywhere); a replica with another
    secret refuses it (403)."""
    clock = WallClock()
    maker = image_service(outputs(tmp_path, clock))
    server = image_service(outputs(tmp_path, clock))
    stranger = image_service(outputs(tmp_path, clock, secret=b"x" * 32))
    with anyio.fail_after(BUDGET):
        async with (
            serving(maker) as made,
            serving(server) as served,
            serving(stranger) as strange,
        ):
            item = (await generate(made, seed=5, response_format="url"))[0]
            inline = (await generate(made, seed=5))[0]
            got = await served.get(local(item["url"]))
            assert got.status_code == 200
            assert got.content == base64.b64decode(inline["b64_json"])
            assert error_of(await strange.get(local(item["url"])), 403)["code"] == (
                "invalid_signature"
            )


async def test_without_a_secret_the_server_says_its_urls_die_with_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """L97: with no secret given, one is drawn at start and the log says its URLs do not
    survive a restart nor work on another replica; each such server signs differently."""
    clock = WallClock()
    caplog.set_level(logging.INFO, "omni_trio.serve")
    first = image_service(outputs(tmp_path, clock, secret=None))
    second = image_service(outputs(tmp_path, clock, secret=None))
    with anyio.fail_after(BUDGET):
        async with serving(first) as client, serving(second) as other:
            url = (await generate(client, response_format="url"))[0]["url"]
            assert (await client.get(local(url))).status_code == 200
            assert (await other.get(local(url))).status_code == 403
    warned = [r for r in caplog.records if "restarts" in r.getMessage()]
    assert len(warned) == 2 and all(r.levelno == logging.WARNING for r in warned)
    assert "OutputConfig.secret" in warned[0].getMessage()


async def test_a_streamed_generation_ends_with_urls(tmp_path: Path) -> None:
    """L97: streaming with ``response_format: "url"``: each ``completed`` event carries
    its image's URL instead of its base64."""
    service = image_service(outputs(tmp_path, WallClock()))
    body = {"prompt": "a fox", "stream": True, "n": 2, "response_format": "url"}
    with anyio.fail_after(BUDGET):
        async with serving(service) as client:
            text = (await client.post(PATH, json=body)).text
    completed = [line for line in text.splitlines() if '"image_generation.completed"' in line]
    assert len(completed) == 2
    assert all('"url":"http://test/v1/files/images/' in line for line in completed)
    assert not any("b64_json" in line for line in completed)


async def test_urls_need_no_api_key_but_the_routes_still_do(tmp_path: Path) -> None:
    """L97, L55: with API keys, a signed URL is its own credential: it is served without
    a key (a browser fetches it as it is); generating still needs one."""
    keys = ApiKeys.from_keys(["sk-test-0123456789abcdef"])
    service = image_service(outputs(tmp_path, WallClock()), keys=keys)
    auth = {"Authorization": "Bearer sk-test-0123456789abcdef"}
    with anyio.fail_after(BUDGET):
        async with serving(service) as client:
            assert (await client.post(PATH, json={"prompt": "x"})).status_code == 401
            response = await client.post(
                PATH, json={"prompt": "x", "response_format": "url"}, headers=auth
            )
            url = response.json()["data"][0]["url"]
            assert (await client.get(local(url))).status_code == 200
            assert (await client.post(local(url))).status_code == 401


async def test_the_sdk_reads_an_images_url(tmp_path: Path) -> None:
    """L97: the OpenAI SDK's ``images.generate(response_format="url")`` gets ``data[0].url``,
    at ``public_url`` when one is set (a load balancer's address)."""
    config = outputs(tmp_path, WallClock(), public_url="https://img.example/base/")
    service = image_service(config)
    http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=service.app), base_url="http://t")
    client = openai.AsyncOpenAI(
        base_url="http://t/v1", api_key="x", http_client=http, max_retries=0
    )
    with anyio.fail_after(BUDGET):
        async with service.lifespan(), http:
            result = await client.images.generate(prompt="a fox", response_format="url")
            assert result.data is not None
            url = result.data[0].url
            assert url is not None and url.startswith("https://img.example/base/v1/files/images/")
            # The load balancer sends /base/... here as /...
            got = await http.get(local(url).removeprefix("/base"))
            assert got.status_code == 200 and got.content.startswith(b"\x89PNG")


async def test_without_a_store_url_is_a_400_naming_what_to_set() -> None:
    """L97: a server without an output store answers ``url`` with a 400 naming
    ``response_format`` and the setting; ``/v1/files/`` does not exist there."""
    service = image_service(None)
    with anyio.fail_after(BUDGET):
        async with serving(service) as client:
            response = await client.post(PATH, json={"prompt": "x", "response_format": "url"})
            error = error_of(response, 400)
            assert (error["param"], error["code"]) == ("response_format", "unsupported_value")
            assert "ServeConfig.outputs" in error["message"]
            files = await client.get("/v1/files/images/x/1-0.png?expires=1&signature=x")
            assert error_of(files, 404)["code"] == "not_found"
            assert service.engine is not None and service.engine.statistics().admitted == 0


async def test_a_store_that_cannot_keep_an_image_fails_that_answer_alone(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """L97, L54: a write the store refuses is a 500 ``storage_error`` naming the request,
    with none of the store's text; the log has it; the server goes on serving."""
    service = image_service(outputs(tmp_path / "outputs", WallClock()))
    with anyio.fail_after(BUDGET):
        async with serving(service) as client:
            (tmp_path / "outputs" / "images").write_text("not a folder")
            response = await client.post(PATH, json={"prompt": "x", "response_format": "url"})
            error = error_of(response, 500)
            assert error["code"] == "storage_error"
            assert response.headers["x-request-id"] in error["message"]
            assert "folder" not in error["message"]
            assert (await client.post(PATH, json={"prompt": "x"})).status_code == 200
    assert any(r.levelno == logging.ERROR and "images" in r.getMessage() for r in caplog.records)


async def test_a_store_that_cannot_open_stops_the_start(tmp_path: Path) -> None:
    """L97: an output folder that cannot be made is an ``OutputStoreError`` before the
    service serves, in one line naming it."""
    from omni_trio.serve import OutputStoreError

    (tmp_path / "taken").write_text("a file")
    service = image_service(outputs(tmp_path / "taken" / "outputs", WallClock()))
    with anyio.fail_after(BUDGET), pytest.raises(OutputStoreError, match="taken"):
        async with service.lifespan():
            pass


# -- videos ---------------------------------------------------------------------------


async def test_a_video_jobs_content_as_a_url_goes_with_its_job(tmp_path: Path) -> None:
    """L97: ``GET /v1/videos/{id}/content?response_format=url`` answers JSON with the
    MP4's signed URL, expiring no later than the job; asked again it reuses the object;
    the URL serves the MP4's bytes; deleting the job deletes it (404 ``file_not_found``)."""
    clock = WallClock(float(int(wall_now())))
    service = image_service(outputs(tmp_path, clock, ttl_s=7200.0), ttl_s=60.0)
    with anyio.fail_after(BUDGET):
        async with serving(service) as client:
            job = await finished(client, (await create(client, seconds="1"))["id"])
            path = f"/v1/videos/{job['id']}/content"
            mp4 = (await client.get(path)).content
            answer = (await client.get(path, params={"response_format": "url"})).json()
            assert set(answer) == {"id", "object", "url", "expires_at"}
            assert (answer["id"], answer["object"]) == (job["id"], "video.content")
            assert answer["expires_at"] == job["expires_at"]  # the job's, sooner than 2 h
            again = (await client.get(path, params={"response_format": "url"})).json()
            assert again["url"] == answer["url"]
            assert len(files_in(tmp_path)) == 1
            got = await client.get(local(answer["url"]))
            assert (got.status_code, got.headers["content-type"]) == (200, "video/mp4")
            assert got.content == mp4
            assert (await client.delete(f"/v1/videos/{job['id']}")).status_code == 200
            assert files_in(tmp_path) == []
            error = error_of(await client.get(local(answer["url"])), 404)
            assert error["code"] == "file_not_found"


@pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")
async def test_the_sdk_downloads_a_videos_url(tmp_path: Path) -> None:
    """L97: ``client.videos.download_content(id, extra_query={"response_format": "url"})``
    carries the JSON answer (``.json()``); a bad value is a 400 naming the parameter."""
    service = image_service(outputs(tmp_path, WallClock(float(int(wall_now())))), ttl_s=60.0)
    http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=service.app), base_url="http://t")
    client = openai.AsyncOpenAI(
        base_url="http://t/v1", api_key="x", http_client=http, max_retries=0
    )
    with anyio.fail_after(BUDGET):
        async with service.lifespan(), http:
            video = await client.videos.create(prompt="a fox", seconds="4")
            video = await client.videos.poll(video.id, poll_interval_ms=1)
            assert video.status == "completed"
            content = await client.videos.download_content(
                video.id, extra_query={"response_format": "url"}
            )
            url = content.json()["url"]
            assert (await http.get(local(url))).content[4:8] == b"ftyp"  # an MP4
            with pytest.raises(openai.BadRequestError) as refused:
                await client.videos.download_content(
                    video.id, extra_query={"response_format": "b64_json"}
                )
            assert refused.value.param == "response_format"


async def test_without_a_store_a_videos_url_is_a_400() -> None:
    """L97: without an output store, ``?response_format=url`` is a 400 naming it."""
    service = image_service(None, ttl_s=60.0)
    with anyio.fail_after(BUDGET):
        async with serving(service) as client:
            job = await finished(client, (await create(client, seconds="1"))["id"])
            response = await client.get(
                f"/v1/videos/{job['id']}/content", params={"response_format": "url"}
            )
            error = error_of(response, 400)
            assert (error["param"], error["code"]) == ("response_format", "unsupported_value")


def wall_now() -> float:
    """Now, on the wall clock: a video job's expiry is on it (``VideoConfig``'s clock is
    monotonic), so a fake output clock for a video starts there, and stays."""
    return time.time()


# -- the pieces -----------------------------------------------------------------------


async def test_the_docs_output_store_snippet(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/snippets/output_store.py: a service whose ``url`` images are files of the folder
    ``outputs``, signed with the secret file's bytes."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "output.secret").write_bytes(SECRET)
    snippet = ROOT / "docs" / "snippets" / "output_store.py"
    names: dict[str, Any] = {"runner": FakeRunner()}
    exec(compile(snippet.read_text(), str(snippet), "exec"), names)
    service: Service = names["service"]
    with anyio.fail_after(BUDGET):
        async with serving(service) as client:
            body = {"prompt": "a fox", "size": "16x16", "response_format": "url"}
            url = (await client.post(PATH, json=body)).json()["data"][0]["url"]
            got = await client.get(local(url))
            assert got.status_code == 200
    (stored,) = (tmp_path / "outputs").rglob("*.png")
    assert stored.read_bytes() == got.content
    assert service.outputs is not None
    assert service.outputs.signature("k", 1) == OutputUrls(
        outputs(tmp_path, WallClock())
    ).signature("k", 1)


def test_output_config_checks_its_fields(tmp_path: Path) -> None:
    """L97: an output configuration out of range is a ``ValueError`` naming the field."""
    cases: list[tuple[dict[str, Any], str]] = [
        ({"store": ""}, "store"),
        ({"store": 3}, "store"),
        ({"store": "s3://"}, "bucket"),
        ({"store": tmp_path, "ttl_s": 0}, "ttl_s"),
        ({"store": tmp_path, "ttl_s": float("nan")}, "ttl_s"),
        ({"store": tmp_path, "sweep_every_s": True}, "sweep_every_s"),
        ({"store": tmp_path, "secret": b"short"}, "secret"),
        ({"store": tmp_path, "secret": "text of thirty-two characters.."}, "secret"),
        ({"store": tmp_path, "public_url": "img.example"}, "public_url"),
    ]
    for fields, name in cases:
        with pytest.raises(ValueError, match=name):
            OutputConfig(**fields)
    config = OutputConfig(store=tmp_path, secret=SECRET)
    assert "secret" not in repr(config) and SECRET.decode() not in repr(config)
    assert isinstance(OutputUrls(config).store, FolderStore)
    assert isinstance(FolderStore(tmp_path), OutputStore)


def test_the_folder_store_writes_atomically_lists_and_deletes(tmp_path: Path) -> None:
    """L97: a folder store's ``put`` leaves the whole file under its key and nothing else
    (a temporary file is renamed); keys list by prefix; a bad key is refused; a stale
    temporary file is removed at open."""
    import os

    store = FolderStore(tmp_path / "out")
    store.open()
    store.put("videos/video_1/100-video.mp4", b"mp4")
    store.put("images/img-1/100-0.png", b"png")
    store.put("images/img-1/100-0.png", b"png again")
    assert files_in(tmp_path / "out") == ["images/img-1/100-0.png", "videos/video_1/100-video.mp4"]
    assert sorted(store.list_keys("images/")) == ["images/img-1/100-0.png"]
    found = store.get("images/img-1/100-0.png")
    assert found is not None and found.size == 9
    try:
        assert found.reader.read() == b"png again"
    finally:
        found.reader.close()
    assert store.get("images/none/1-0.png") is None
    for key in ("../escape", "images/../x", ".hidden", "a//b", "/abs", "a\nb"):
        with pytest.raises(ValueError, match="not an output key"):
            store.put(key, b"")
    stale = tmp_path / "out" / "images" / ".100-0.png.x.tmp"
    stale.write_bytes(b"half")
    os.utime(stale, (0, 0))
    assert "images/.100-0.png.x.tmp" not in store.list_keys()
    store.open()
    assert not stale.exists()
    store.delete(["images/img-1/100-0.png", "images/img-1/100-1.png"])
    assert store.list_keys() == ["videos/video_1/100-video.mp4"]


@pytest.mark.trio
async def test_the_sweeper_deletes_expired_outputs_on_its_own(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """L97: the sweeper deletes an expired object with no request, never before its
    expiry (virtual seconds are the fake wall clock's; a thread's work may let them run
    on, so only the order is asserted)."""
    config = OutputConfig(
        store=tmp_path,
        secret=SECRET,
        ttl_s=100.0,
        sweep_every_s=30.0,
        clock=lambda: START + trio.current_time(),
    )
    urls = OutputUrls(config)
    await urls.open()
    async with trio.open_nursery() as nursery:
        await nursery.start(urls.serve)
        expires = urls.expiry()
        keys = await urls.keep("images/img-a", [("0.png", b"png")], expires=expires)
        while urls.store.list_keys() == keys:  # pytest-timeout bounds it
            await trio.sleep(1)
        # Gone, and not early: the sweep that deleted it began at or after its expiry.
        assert urls.store.list_keys() == []
        assert START + trio.current_time() >= expires
        urls.close()
    await urls.aclose()
