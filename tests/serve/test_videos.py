"""``/v1/videos`` in-process (L73): jobs, their progress, deletes, expiry, paging, the SDK.

Determinism rules:
- every test runs on trio and asyncio inside the service's own lifespan and
  ``anyio.fail_after(BUDGET)``;
- the runners are ``FakeRunner``/``GatedRunner`` with a frame rule (4k + 1), so
  "the job is at step k" or "in its decode" is exact; one test runs the tiny Wan
  pipeline (seeded weights, one torch thread) end to end through the OpenAI SDK;
- expiry reads a fake clock the test moves, never the time that passes;
- requests go through ``httpx.ASGITransport``, the OpenAI SDK through
  ``httpx2.ASGITransport`` (its own client), and the event stream through
  ``AsgiCall``, which shows what the app sent while it is still sending.
"""

from __future__ import annotations

import dataclasses
import io
import json
from typing import Any

import anyio
import httpx
import httpx2
import openai
import PIL.Image
import pytest

import omni_trio as ot
from omni_trio.runners import DiffusersRunner, RunnerCapabilities, tiny_pipeline
from omni_trio.serve import ApiError, ServeConfig, Service, VideoConfig
from omni_trio.serve._config import Admission
from omni_trio.serve._video_body import frames_for, video_body, video_spec
from omni_trio.serve.jobs import VideoJob
from omni_trio.testing import (
    FakeRunner,
    GatedRunner,
    assert_engine_idle,
    live_objects,
    wait_until,
)
from tests.support.core import BUDGET
from tests.support.jobs import create, finished, serving
from tests.support.serve import AsgiCall, PixelWork, metric, parse_sse

pytestmark = pytest.mark.anyio

RULE = (4, 1)
FPS = 8.0
SIZE = 16


class FakeClock:
    """Monotonic seconds that move only when the test says."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_service(
    runner: FakeRunner | None = None,
    *,
    max_jobs: int = 8,
    ttl_s: float = 60.0,
    grace: float = 0.0,
    max_priority: int = 0,
    **video: Any,
) -> tuple[Service, FakeRunner]:
    """A video service on ``runner`` (an instant 4k + 1 FakeRunner by default), 16x16, 4 steps."""
    runner = runner if runner is not None else FakeRunner(frames=RULE)
    config = ServeConfig(
        model_name="fake-video",
        default_width=SIZE,
        default_height=SIZE,
        default_steps=4,
        max_priority=max_priority,
    )
    videos = VideoConfig(fps=FPS, max_jobs=max_jobs, ttl_s=ttl_s, **video)
    service = Service(
        runner, engine_config=ot.EngineConfig(max_height=64, max_width=64, shutdown_grace=grace),
        config=config,
        video_config=videos,
    )  # fmt: skip
    return service, runner


def mp4_frames(data: bytes) -> list[tuple[int, int]]:
    """The (width, height) of each frame PyAV decodes from MP4 ``data``."""
    import av

    with av.open(io.BytesIO(data), mode="r") as container:
        return [(frame.width, frame.height) for frame in container.decode(video=0)]


def error_of(response: httpx.Response) -> dict[str, Any]:
    error: dict[str, Any] = response.json()["error"]
    return error


# -- the life of a job ---------------------------------------------------------------


async def test_a_job_is_queued_progresses_and_completes_with_an_mp4() -> None:
    """L73: POST answers at once with the job queued; it turns in_progress when the worker
    takes it, its progress follows the steps (25, 50, 75), then it completes (100) and its
    content is an MP4 of its frames; the finished job holds the MP4 bytes only: no output
    or video tensor of it is alive and the engine holds nothing.
    """
    runner = GatedRunner(frames=RULE)
    service, _ = make_service(runner)
    with anyio.fail_after(BUDGET):
        async with serving(service) as client:
            job = await create(client, seconds="1", seed=3)
            assert (job["status"], job["progress"], job["object"]) == ("queued", 0, "video")
            assert job["omni_trio"]["num_frames"] == 9  # 1 s at 8 fps: 8, so 4k + 1 gives 9
            assert (job["seconds"], job["size"], job["model"]) == ("1", "16x16", "fake-video")
            vid = job["id"]
            stored = service.videos.get(vid)
            await runner.wait_arrived(1)
            got = (await client.get(f"/v1/videos/{vid}")).json()
            assert (got["status"], got["progress"]) == ("in_progress", 0)
            seen = []
            for step in (1, 2, 3):
                runner.release(1)
                await wait_until(lambda step=step: stored.progress == 25 * step)  # type: ignore[misc]
                seen.append((await client.get(f"/v1/videos/{vid}")).json()["progress"])
            assert seen == [25, 50, 75]
            runner.open_gate()
            done = await finished(client, vid)
            assert (done["status"], done["progress"], done["error"]) == ("completed", 100, None)
            assert done["completed_at"] >= done["created_at"]
            assert done["expires_at"] == done["completed_at"] + 60
            content = await client.get(f"/v1/videos/{vid}/content")
            assert content.status_code == 200
            assert content.headers["content-type"] == "video/mp4"
            assert mp4_frames(content.content) == [(SIZE, SIZE)] * 9
            assert done["omni_trio"]["bytes"] == len(content.content) == service.videos.held_bytes()
            assert live_objects(ot.GenerationOutput, request_id=vid) == []
            engine = service.engine
            assert engine is not None
            assert_engine_idle(engine)
            assert runner.live_states == 0
            text = (await client.get("/metrics")).text
            assert metric(text, "omni_trio_video_jobs", status="completed") == 1
            assert metric(text, "omni_trio_video_bytes") == len(content.content)
            assert metric(text, "omni_trio_requests_total", outcome="completed") == 1


async def test_a_suspended_job_stays_in_progress_and_its_progress_never_goes_back() -> None:
    """L73 (amended): a job suspended early in its run by a higher-priority job (L61: one
    step of 200 done, so its progress rounds to 0, and its handle reads WAITING again)
    reads in_progress on GET, in the list and on its event stream, whose statuses and
    progress only move forward; it resumes and completes.
    """
    runner = GatedRunner(frames=RULE, max_batch_size=1)  # the urgent job cannot join: it preempts
    service, _ = make_service(runner, max_priority=1)
    with anyio.fail_after(BUDGET):
        async with serving(service) as client:
            engine = service.engine
            assert engine is not None
            vid = (await create(client, num_frames=5, num_inference_steps=200))["id"]
            stored = service.videos.get(vid)
            watcher = events_call(vid)
            async with anyio.create_task_group() as tg:
                tg.start_soon(watcher.run, service)
                await runner.wait_arrived(1)  # its step 1 of 200 held at the gate
                await create(client, num_frames=5, num_inference_steps=2, priority=1)
                runner.release(1)  # at the boundary after step 1, the urgent job suspends it
                await runner.wait_arrived(2)  # the urgent job's first step at the gate
                await wait_until(lambda: engine.statistics().suspended == 1)
                assert stored.handle is not None
                assert stored.handle.status is ot.RequestStatus.WAITING
                # Its step 1 reached the job (its task, then its stream), and stays counted.
                await wait_until(
                    lambda: (
                        [d["status"] for _, d in parse_sse(watcher.body.decode())][-1:]
                        == ["in_progress"]
                    )
                )
                got = (await client.get(f"/v1/videos/{vid}")).json()
                assert (got["status"], got["progress"]) == ("in_progress", 0)
                listed = (await client.get("/v1/videos")).json()["data"]
                assert [job["status"] for job in listed if job["id"] == vid] == ["in_progress"]
                text = (await client.get("/metrics")).text
                assert metric(text, "omni_trio_video_jobs", status="in_progress") == 2
                assert metric(text, "omni_trio_video_jobs", status="queued") == 0
                runner.open_gate()
            done = await finished(client, vid)
    assert done["status"] == "completed"
    events = [data for _, data in parse_sse(watcher.body.decode())]
    order = ["queued", "in_progress", "completed"]
    ranks = [order.index(data["status"]) for data in events]
    progress = [data["progress"] for data in events]
    assert ranks == sorted(ranks) and progress == sorted(progress), events
    assert ranks[-1] == 2 and progress[-1] == 100


async def test_the_event_stream_says_in_progress_once_any_reader_saw_it() -> None:
    """L73: a job whose request is running reads ``in_progress`` before its first step
    ends (which rounds to 0 %); once a GET read it so, its event stream says it too,
    without waiting for a progress to change. (The first reader latched the status
    without waking the stream, which stayed at ``queued``: a race once seen by
    test_a_suspended_job_stays_in_progress_and_its_progress_never_goes_back.)"""
    runner = GatedRunner(frames=RULE, max_batch_size=1)
    service, _ = make_service(runner)
    with anyio.fail_after(BUDGET):
        async with serving(service) as client:
            first = (await create(client, num_frames=5, num_inference_steps=1))["id"]
            await runner.wait_arrived(1)  # the first job holds the worker
            vid = (await create(client, num_frames=5, num_inference_steps=200))["id"]
            watcher = events_call(vid)
            async with anyio.create_task_group() as tg:
                tg.start_soon(watcher.run, service)

                def statuses() -> list[str]:
                    return [d["status"] for _, d in parse_sse(watcher.body.decode())]

                await wait_until(lambda: statuses() == ["queued"])
                runner.release(1)  # the first job ends; this one's step 1 held at the gate
                await runner.wait_arrived(2)
                got = (await client.get(f"/v1/videos/{vid}")).json()
                assert (got["status"], got["progress"]) == ("in_progress", 0)
                await wait_until(lambda: statuses()[-1:] == ["in_progress"])
                runner.open_gate()
            assert (await finished(client, first))["status"] == "completed"
            assert (await finished(client, vid))["status"] == "completed"


async def test_a_jobs_progress_never_decreases() -> None:
    """L73 (amended): a step event behind the job's progress leaves it where it is, and the
    first step starts the job even when it rounds to 0 %."""
    service, _ = make_service()
    spec = video_spec(
        video_body(b'{"prompt": "a fox", "num_frames": 5}', None),
        service.config,
        fps=FPS,
        default_seconds=4.0,
        rule=RULE,
    )
    job = VideoJob(job_id="video_1", seq=1, model="fake-video", spec=spec)
    assert (job.status, job.progress) == ("queued", 0)
    job.stepped(1, 200)
    assert (job.status, job.progress) == ("in_progress", 0)
    job.stepped(100, 200)
    job.stepped(10, 200)
    assert (job.status, job.progress) == ("in_progress", 50)


async def test_delete_while_running_aborts_the_request_and_answers_at_once() -> None:
    """L73: DELETE of a running job answers at once (the worker is still inside a step),
    the job is gone (404), and the engine's abort lands at the next boundary: the request
    is aborted, never decoded, and nothing of it is left in the engine or the runner.
    """
    runner = GatedRunner(frames=RULE)
    service, _ = make_service(runner)
    with anyio.fail_after(BUDGET):
        async with serving(service) as client:
            vid = (await create(client, num_frames=5))["id"]
            runner.release(1)
            await runner.wait_arrived(2)  # step 1 done, step 2 held inside the runner
            response = await client.delete(f"/v1/videos/{vid}")
            assert response.json() == {"id": vid, "object": "video.deleted", "deleted": True}
            assert runner.steps_run == 1 and runner.live_states == 1  # answered before release
            assert (await client.get(f"/v1/videos/{vid}")).status_code == 404
            assert len(service.videos) == 0
            runner.release(1)
            engine = service.engine
            assert engine is not None
            await wait_until(lambda: engine.statistics().aborted == 1 and runner.live_states == 0)
            await wait_until(lambda: job_tasks() == [])  # it closed the handle: nothing open
            assert_engine_idle(engine)
            assert (runner.steps_run, runner.decodes) == (2, 0)
            text = (await client.get("/metrics")).text
            assert metric(text, "omni_trio_requests_total", outcome="aborted") == 1
            assert metric(text, "omni_trio_video_jobs", status="in_progress") == 0
            assert (await client.delete(f"/v1/videos/{vid}")).status_code == 404


async def test_delete_during_the_decode_keeps_nothing() -> None:
    """L73: a job deleted while its frames are decoded is gone at once; when the decode
    ends, no output, MP4 or engine state of it is left.
    """
    runner = GatedRunner(frames=RULE, gate_decodes=True)
    runner.open_gate()
    service, _ = make_service(runner)
    with anyio.fail_after(BUDGET):
        async with serving(service) as client:
            vid = (await create(client, num_frames=5))["id"]
            await wait_until(lambda: runner.decodes_arrived == 1)
            assert (await client.delete(f"/v1/videos/{vid}")).status_code == 200
            runner.release_decode(1)
            engine = service.engine
            assert engine is not None
            await wait_until(lambda: engine.statistics().running == 0 and runner.live_states == 0)
            await wait_until(lambda: job_tasks() == [])
            assert_engine_idle(engine)
            assert live_objects(ot.GenerationOutput, request_id=vid) == []
            assert (len(service.videos), service.videos.held_bytes()) == (0, 0)
            assert (await client.get(f"/v1/videos/{vid}/content")).status_code == 404


def job_tasks() -> list[str]:
    """The names of the video jobs' tasks still running."""
    return [t.name for t in anyio.get_running_tasks() if t.name and "video job" in t.name]


async def test_finished_jobs_expire_after_their_time_to_live_and_the_store_is_bounded() -> None:
    """L73: with max_jobs 2, a third job gets 429 (one line, Retry-After) and never reaches
    the engine; a finished job is kept ttl_s after it finished, then dropped with its MP4
    (404, no bytes held), which makes room again.
    """
    clock = FakeClock()
    service, _ = make_service(max_jobs=2, ttl_s=60.0, clock=clock)
    with anyio.fail_after(BUDGET):
        async with serving(service) as client:
            first = (await create(client, num_frames=5))["id"]
            await finished(client, first)
            clock.now += 30
            second = (await create(client, num_frames=5))["id"]
            await finished(client, second)
            full = await client.post("/v1/videos", json={"prompt": "a third", "num_frames": 5})
            assert full.status_code == 429
            assert full.headers["retry-after"] == "1"
            error = error_of(full)
            assert error["code"] == "video_jobs_full" and "\n" not in error["message"]
            engine = service.engine
            assert engine is not None
            assert engine.statistics().admitted == 2
            clock.now += 29.5  # the first finished 59.5 s ago: kept
            assert (await client.get(f"/v1/videos/{first}")).status_code == 200
            clock.now += 1  # 60.5 s: dropped, the second (30.5 s) kept
            assert (await client.get(f"/v1/videos/{first}")).status_code == 404
            assert (await client.get(f"/v1/videos/{second}")).status_code == 200
            held = service.videos.held_bytes()
            assert len(service.videos) == 1 and held > 0
            third = (await create(client, num_frames=5))["id"]
            await finished(client, third)
            clock.now += 61
            assert (len(service.videos), service.videos.held_bytes()) == (0, 0)
            assert (await client.get("/v1/videos")).json()["data"] == []


async def test_the_sweeper_drops_expired_jobs_without_being_asked() -> None:
    """L73: an expired job's MP4 is freed by the sweeper at its expiry, with no request."""
    service, _ = make_service(ttl_s=0.001)
    with anyio.fail_after(BUDGET):
        async with serving(service) as client:
            vid = (await create(client, num_frames=5))["id"]
            job = service.videos.get(vid)
            await wait_until(lambda: job.removed)
            assert job.mp4 is None and service.videos._jobs == {}


async def test_list_pages_newest_first_and_its_cursor_survives_a_delete() -> None:
    """L73: GET /v1/videos is OpenAI's list (object, data, first_id, last_id, has_more),
    newest first; limit and after page through it (also once the cursor's job is
    deleted), order=asc reverses it; a bad limit, order or after is a 400 naming it.
    """
    service, _ = make_service()
    with anyio.fail_after(BUDGET):
        async with serving(service) as client:
            ids = [(await create(client, num_frames=5, seed=i))["id"] for i in range(5)]
            page = (await client.get("/v1/videos", params={"limit": 2})).json()
            assert [v["id"] for v in page["data"]] == ids[:2:-1][:2] == [ids[4], ids[3]]
            assert (page["object"], page["has_more"]) == ("list", True)
            assert (page["first_id"], page["last_id"]) == (ids[4], ids[3])
            await client.delete(f"/v1/videos/{ids[3]}")
            page = (await client.get("/v1/videos", params={"limit": 2, "after": ids[3]})).json()
            assert [v["id"] for v in page["data"]] == [ids[2], ids[1]] and page["has_more"]
            page = (await client.get("/v1/videos", params={"after": ids[1]})).json()
            assert [v["id"] for v in page["data"]] == [ids[0]] and not page["has_more"]
            page = (await client.get("/v1/videos", params={"order": "asc", "limit": 3})).json()
            assert [v["id"] for v in page["data"]] == [ids[0], ids[1], ids[2]]
            for params, param in [
                ({"limit": "0"}, "limit"),
                ({"limit": "101"}, "limit"),
                ({"limit": "x"}, "limit"),
                ({"order": "up"}, "order"),
                ({"after": "img-1"}, "after"),
            ]:
                response = await client.get("/v1/videos", params=params)
                assert response.status_code == 400 and error_of(response)["param"] == param


async def test_the_event_stream_follows_the_job_and_a_watcher_leaving_stops_only_it() -> None:
    """L73: GET /v1/videos/{id}/events sends the job after each change (video.progress)
    and video.completed at the end; a watcher that disconnects ends its stream only: the
    job goes on and completes.
    """
    runner = GatedRunner(frames=RULE)
    service, _ = make_service(runner)
    with anyio.fail_after(BUDGET):
        async with serving(service) as client:
            vid = (await create(client, num_frames=5))["id"]
            watcher, leaver = events_call(vid), events_call(vid)
            left = anyio.Event()

            async def leave() -> None:
                await leaver.run(service)
                left.set()

            async with anyio.create_task_group() as tg:
                tg.start_soon(watcher.run, service)
                tg.start_soon(leave)
                await wait_until(lambda: len(parse_sse(watcher.body.decode())) == 1)
                await wait_until(lambda: len(parse_sse(leaver.body.decode())) == 1)
                leaver.disconnect.set()
                await left.wait()  # its stream ended; the job goes on
                for step in (1, 2, 3):
                    runner.release(1)
                    await wait_until(
                        lambda n=step: len(parse_sse(watcher.body.decode())) == n + 1  # type: ignore[misc]
                    )
                runner.open_gate()
            events = parse_sse(watcher.body.decode())
            names = [name for name, _ in events]
            progress = [data["progress"] for _, data in events]
            assert names[:4] == ["video.progress"] * 4 and progress[:4] == [0, 25, 50, 75]
            # The last step makes 99 (100 only once encoded): seen unless the end came first.
            assert names[4:] in (["video.completed"], ["video.progress", "video.completed"])
            assert progress[4:] in ([100], [99, 100])
            assert all(data["id"] == vid and data["object"] == "video" for _, data in events)
            assert watcher.status == 200
            assert (await client.get(f"/v1/videos/{vid}")).json()["status"] == "completed"
            done = events_call(vid)  # a finished job: its last state, and the stream ends
            await done.run(service)
            assert [name for name, _ in parse_sse(done.body.decode())] == ["video.completed"]


def events_call(video_id: str) -> AsgiCall:
    call = AsgiCall({})
    path = f"/v1/videos/{video_id}/events"
    call.scope.update(method="GET", path=path, raw_path=path.encode(), headers=[])
    return call


# -- errors ----------------------------------------------------------------------------


#: A body's fields, the field a 400 must name, and words its message must hold.
Refusals = list[tuple[dict[str, Any], str, str]]


async def refused_by_name(client: httpx.AsyncClient, cases: Refusals) -> None:
    """Each case's ``/v1/videos`` body is a 400 naming its field, in one line with its words."""
    for fields, param, words in cases:
        response = await client.post("/v1/videos", json={"prompt": "a fox", **fields})
        assert response.status_code == 400, (fields, response.text)
        error = error_of(response)
        assert error["param"] == param, (fields, error)
        assert words in error["message"] and "\n" not in error["message"], error


async def test_bad_input_gets_a_400_naming_the_field_and_changes_nothing() -> None:
    """L73, L52: bad seconds, both seconds and num_frames, frames off the rule, a bad size,
    an unknown field, an input_reference or another model's id get a 400 naming the field,
    in one line; nothing reaches the engine.
    """
    service, _ = make_service()
    cases: Refusals = [
        ({"seconds": "four"}, "seconds", "positive number"),
        ({"seconds": "0"}, "seconds", "> 0"),
        ({"seconds": "1e9"}, "seconds", "positive number"),
        ({"seconds": 1e9}, "seconds", "<= 540"),
        ({"seconds": True}, "seconds", "a string or a number"),
        ({"seconds": "1", "num_frames": 5}, "num_frames", "not both"),
        ({"num_frames": 6}, "num_frames", "4k + 1"),
        ({"num_frames": 0}, "num_frames", ">= 1"),
        ({"size": "16"}, "size", "WIDTHxHEIGHT"),
        ({"size": "12x12"}, "size", "multiple of 8"),
        ({"fps": 8}, "fps", "Unrecognized"),
        ({"input_reference": "x"}, "input_reference", "not supported"),
        ({"model": "sora-2"}, "model", "fake-video"),
        ({"num_inference_steps": "4"}, "num_inference_steps", "an integer"),
        ({"priority": 1}, "priority", "<= 0"),
    ]
    with anyio.fail_after(BUDGET):
        async with serving(service) as client:
            await refused_by_name(client, cases)
            response = await client.post(
                "/v1/videos", content=b"{", headers={"content-type": "application/json"}
            )
            assert error_of(response)["code"] == "invalid_json"
            form = await client.post(
                "/v1/videos", files={"input_reference": b"x"}, data={"prompt": "p"}
            )
            assert error_of(form)["param"] == "input_reference"
            engine = service.engine
            assert engine is not None
            assert engine.statistics().admitted == 0 and len(service.videos) == 0
            missing = await client.get("/v1/videos/video_00000001ffffffffffffffffffffffff")
            assert missing.status_code == 404 and error_of(missing)["code"] == "video_not_found"


#: ``seconds`` as JSON literals that are no length this server makes (8 fps: 0 < s <= 540):
#: integers past a float's range (``float()`` of them overflowed: a 500), past the digits
#: Python converts, floats past the limit or not finite, text, other types.
def video_form(**fields: str) -> dict[str, tuple[None, str]]:
    """A ``multipart/form-data`` body of text fields, as the OpenAI SDK sends (``files=``)."""
    return {name: (None, text) for name, text in {"prompt": "a fox", **fields}.items()}


BAD_JSON_SECONDS = [
    "0", "-1", "541", "540.0001", "-0.0", "1e308", "1e400", "-1e400", "Infinity", "NaN",
    "2" + "0" * 308, "1" + "0" * 400, "-1" + "0" * 400, "9" * 5000, str(2**1024), "true",
    '"541"', '"9' + "9" * 39 + '"', '"9' + "9" * 400 + '"', '"1e5"', '""', '" 4"', '"4."',
    '"0x10"', '"inf"', '"nan"', '"\u0664"', "[4]", '{"s": 4}',
]  # fmt: skip

#: ``seconds`` as form text (what the OpenAI SDK sends) that is no length this server makes.
BAD_FORM_SECONDS = [
    "0", "-1", "541", "540.0001", "1e308", "1e400", "inf", "nan", "Infinity",
    "2" + "0" * 308, "9" * 40, "9" * 5000, "", " 4", "4.", "0x10", "\u0664", "4s",
]  # fmt: skip


async def test_seconds_out_of_range_get_a_400_naming_seconds_in_json_and_in_a_form() -> None:
    """L73, L52: ``seconds`` past what the server makes (an integer over 1.8e308 too, which
    made ``float()`` overflow: a 500), not finite, or not a number get a 400 naming
    ``seconds``, in one line, as JSON and as form text; the longest stated length, 540 s
    at 8 fps, is taken (4317 frames: the longest count on the rule, not one over the
    limit), and nothing refused reaches the engine.
    """
    runner = GatedRunner(frames=RULE)
    service, _ = make_service(runner)
    with anyio.fail_after(BUDGET):
        async with serving(service) as client:
            answers = [
                await client.post(
                    "/v1/videos",
                    content=b'{"prompt": "a fox", "seconds": ' + literal.encode() + b"}",
                    headers={"content-type": "application/json"},
                )
                for literal in BAD_JSON_SECONDS
            ]
            answers += [
                await client.post("/v1/videos", files=video_form(seconds=text))
                for text in BAD_FORM_SECONDS
            ]
            for answer in answers:
                assert answer.status_code == 400, answer.text
                error = error_of(answer)
                assert error["param"] == "seconds" and "\n" not in error["message"], error
                assert len(answer.content) < 1000
            engine = service.engine
            assert engine is not None
            assert engine.statistics().admitted == 0
            longest = await client.post("/v1/videos", files=video_form(seconds="540"))
            assert longest.status_code == 200, longest.text
            job = longest.json()
            assert (job["seconds"], job["omni_trio"]["num_frames"]) == ("540", 4317)
            await client.delete(f"/v1/videos/{job['id']}")
            runner.open_gate()
            await wait_until(lambda: engine.statistics().aborted == 1)
    for seconds in (540, 540.0, "540", "539.9"):
        body = json.dumps({"prompt": "a fox", "seconds": seconds}).encode()
        spec = video_spec(
            video_body(body, None), service.config, fps=FPS, default_seconds=4.0, rule=RULE
        )
        assert spec.request.num_frames == 4317  # MAX_NUM_FRAMES (4320) is not 4k + 1
    assert frames_for(270, 16, RULE) == 4317 and frames_for(4, 16, RULE) == 65


async def test_a_video_the_engine_refuses_never_takes_a_place_nor_decodes_a_file(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """L4 (amended), L73: a size over the engine's limits (64 px here) or off the runner's
    rule is a 400 naming ``size`` even when the store is full (checked before the job takes
    a place: a 429 would say to retry what can never run), and an ``input_reference`` file
    (an image) is refused by name, never decoded.
    """
    runner = GatedRunner(frames=RULE)
    service, _ = make_service(runner, max_jobs=1)
    picture = io.BytesIO()
    PIL.Image.new("RGB", (16, 16)).save(picture, format="PNG")
    with anyio.fail_after(BUDGET):
        async with serving(service) as client:
            vid = (await create(client, num_frames=5))["id"]  # the store is full
            work = PixelWork(monkeypatch)
            for size, words in (("128x16", "<= 64"), ("12x16", "multiple of 8")):
                response = await client.post("/v1/videos", json={"prompt": "a fox", "size": size})
                assert response.status_code == 400, response.text
                error = error_of(response)
                assert error["param"] == "size" and words in error["message"], error
            reference = await client.post(
                "/v1/videos",
                files={**video_form(), "input_reference": ("a.png", picture.getvalue())},
            )
            assert error_of(reference)["param"] == "input_reference"
            assert work.done == (0, 0)
            full = await client.post("/v1/videos", json={"prompt": "a fox"})
            assert (full.status_code, error_of(full)["code"]) == (429, "video_jobs_full")
            engine = service.engine
            assert engine is not None and engine.statistics().admitted == 1
            await client.delete(f"/v1/videos/{vid}")
            runner.open_gate()


class AtMostNineFrames(RunnerCapabilities):
    """A video runner's rules that also refuse more than 9 frames, as an engine limit would."""

    __slots__ = ()

    def check_request(self, request: ot.GenerationRequest) -> None:
        super().check_request(request)
        if request.num_frames is not None and request.num_frames > 9:
            raise ot.InvalidRequestError(
                f"must be <= 9 here, got {request.num_frames}", field="num_frames"
            )


def test_a_frame_count_refused_for_the_seconds_sent_names_seconds() -> None:
    """L73: when the engine's limits refuse the frame count made from the ``seconds`` sent,
    the 400 names ``seconds`` (the client never sent ``num_frames``) and says how many
    frames they made; a ``num_frames`` sent is named as it is."""
    admission = Admission(
        engine=ot.EngineConfig(), capabilities=AtMostNineFrames(size_multiple=8, frames=RULE)
    )
    config = ServeConfig(model_name="fake-video", default_width=SIZE, default_height=SIZE)

    def refusal(body: dict[str, Any]) -> ApiError:
        data = json.dumps({"prompt": "a fox", **body}).encode()
        with pytest.raises(ApiError) as caught:
            video_spec(
                video_body(data, None),
                config,
                fps=FPS,
                default_seconds=2.0,
                rule=RULE,
                admission=admission,
            )
        return caught.value

    error = refusal({"seconds": "2"})
    assert (error.status, error.param) == (400, "seconds")
    assert error.message == (
        "seconds: 2 s at 8 frames per second is 17 frames, and num_frames: must be <= 9 here,"
        " got 17"
    )
    assert refusal({"num_frames": 13}).param == "num_frames"
    assert refusal({}).param == "num_frames"  # the default length: no seconds were sent


class FromTwoSteps(FakeRunner):
    """An instant 4k + 1 video runner that runs 2 steps or more, as LTX-Video does."""

    def __init__(self) -> None:
        super().__init__(frames=RULE)
        self._capabilities = dataclasses.replace(self._capabilities, min_steps=2)


async def test_steps_the_model_cannot_run_and_too_many_frame_pixels_are_400s() -> None:
    """L4 (amended), L73: over HTTP, a step count under the runner's fewest is a 400 naming
    ``num_inference_steps``, and a video over ``max_frame_pixels`` a 400 naming the field
    sent (``num_frames``, or ``seconds`` when the length came from it) and the bound;
    nothing reaches the engine, and what is within both runs.
    """
    config = ServeConfig(
        model_name="fake-video", default_width=SIZE, default_height=SIZE, default_steps=4
    )
    bound = SIZE * SIZE * 9  # 9 frames of 16 x 16
    service = Service(
        FromTwoSteps(),
        engine_config=ot.EngineConfig(max_height=64, max_width=64, max_frame_pixels=bound),
        config=config,
        video_config=VideoConfig(fps=FPS),
    )
    cases: Refusals = [
        ({"num_inference_steps": 1, "num_frames": 9}, "num_inference_steps", "at least 2 steps"),
        ({"num_frames": 13}, "num_frames", f"max_frame_pixels of {bound:,}"),
        ({"seconds": "2"}, "seconds", f"max_frame_pixels of {bound:,}"),
    ]
    with anyio.fail_after(BUDGET):
        async with serving(service) as client:
            await refused_by_name(client, cases)
            engine = service.engine
            assert engine is not None and engine.statistics().admitted == 0
            job = await create(client, num_frames=9, num_inference_steps=2)
            assert (await finished(client, job["id"]))["status"] == "completed"


async def test_a_failed_job_reports_a_generic_error_and_has_no_content() -> None:
    """L73, L54: a job whose model raises fails with generation_failed and a message that
    names the job, never the model's text; its content is a 400 video_not_ready.
    """
    service, _ = make_service(FakeRunner(frames=RULE, fail_at_step=2))
    with anyio.fail_after(BUDGET):
        async with serving(service) as client:
            vid = (await create(client, num_frames=5))["id"]
            done = await finished(client, vid)
            assert done["status"] == "failed" and done["error"]["code"] == "generation_failed"
            assert vid in done["error"]["message"] and "FakeRunner" not in str(done)
            content = await client.get(f"/v1/videos/{vid}/content")
            assert content.status_code == 400 and error_of(content)["code"] == "video_not_ready"
            thumbnail = await client.get(
                f"/v1/videos/{vid}/content", params={"variant": "thumbnail"}
            )
            assert error_of(thumbnail)["param"] == "variant"


async def test_each_route_refuses_the_other_kind_of_model_in_one_line() -> None:
    """L73: image routes on a video model and /v1/videos on an image model answer 400
    unsupported_model, naming the route to use.
    """
    video, _ = make_service()
    image = Service(FakeRunner(), config=ServeConfig(model_name="fake", default_width=16))
    with anyio.fail_after(BUDGET):
        async with serving(video) as client:
            response = await client.post("/v1/images/generations", json={"prompt": "x"})
            assert response.status_code == 400
            assert error_of(response)["code"] == "unsupported_model"
            assert "POST /v1/videos" in error_of(response)["message"]
        async with serving(image) as client:
            response = await client.post("/v1/videos", json={"prompt": "x"})
            assert response.status_code == 400
            assert "POST /v1/images/generations" in error_of(response)["message"]


async def test_shutdown_ends_every_job_and_leaves_no_task() -> None:
    """L73: leaving the lifespan drains the engine: the running job finishes within the grace
    period (its MP4 encoded), the waiting one fails shutting_down; no job's task is left.
    """
    runner = GatedRunner(frames=RULE, max_batch_size=1)  # the second job waits
    service, _ = make_service(runner, grace=BUDGET)

    async def open_when_draining() -> None:
        await wait_until(lambda: service.is_draining)
        runner.open_gate()  # the running job ends within its grace period

    with anyio.fail_after(BUDGET):
        async with anyio.create_task_group() as tg:
            async with serving(service) as client:
                running = service.videos.get((await create(client, num_frames=5))["id"])
                waiting = service.videos.get((await create(client, num_frames=5))["id"])
                await runner.wait_arrived(1)
                tg.start_soon(open_when_draining)
            assert job_tasks() == []
    assert running.status == "completed" and running.mp4 is not None
    assert waiting.status == "failed"
    assert waiting.error is not None and waiting.error["code"] == "shutting_down"


# -- the OpenAI SDK and a real model -----------------------------------------------------


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")
async def test_the_openai_sdk_round_trip_on_tiny_wan() -> None:
    """L73: the OpenAI SDK's videos.create (a multipart form, seconds as text, the
    extensions in extra_body), retrieve, list (auto-paging), download_content and delete
    work unchanged against tiny Wan; the MP4 reads back with PyAV: 9 frames of 32x32.
    """
    runner = DiffusersRunner(tiny_pipeline("wan"))
    service = Service(
        runner,
        config=ServeConfig(model_name="tiny-wan", default_width=32, default_height=32,
                           default_steps=2),
        video_config=VideoConfig(fps=FPS),
    )  # fmt: skip
    http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=service.app), base_url="http://t")
    client = openai.AsyncOpenAI(
        base_url="http://t/v1", api_key="x", http_client=http, max_retries=0
    )
    with anyio.fail_after(BUDGET):
        async with service.lifespan():
            # The SDK's types list only OpenAI's own lengths and sizes; any text goes.
            video = await client.videos.create(
                prompt="a red fox",
                seconds="1",  # type: ignore[arg-type]
                size="32x32",  # type: ignore[arg-type]
                extra_body={"seed": 5},
            )
            assert (video.status, video.progress, video.seconds) == ("queued", 0, "1")
            other = await client.videos.create(prompt="a cat", extra_body={"num_frames": 5})
            done = await client.videos.poll(video.id, poll_interval_ms=5)
            assert (done.status, done.progress, done.size) == ("completed", 100, "32x32")
            content = await client.videos.download_content(video.id)
            assert (
                mp4_frames(content.read())
                == [(32, 32)] * frames_for(1, FPS, (4, 1))
                == [(32, 32)] * 9
            )
            listed = [v.id async for v in client.videos.list(limit=1)]
            assert listed == [other.id, video.id]
            deleted = await client.videos.delete(video.id)
            assert (deleted.id, deleted.deleted, deleted.object) == (
                video.id,
                True,
                "video.deleted",
            )
            with pytest.raises(openai.NotFoundError):
                await client.videos.retrieve(video.id)
            await client.videos.delete(other.id)
        await http.aclose()


@pytest.mark.usefixtures("one_torch_thread")
async def test_serve_tiny_wan_takes_the_video_options() -> None:
    """L73: ``serve --model tiny-wan`` loads the tiny Wan pipeline (16 fps, 4k + 1 frames);
    --video-jobs, --video-ttl and --video-fps reach the jobs' config, a bad one is a
    one-line usage error; the model card states fps, default length and frame rule.
    """
    import argparse

    from omni_trio.cli._errors import UsageError
    from omni_trio.cli._options import make_service as cli_service
    from omni_trio.cli._options import service_options
    from omni_trio.cli._serve import add_serve_arguments
    from omni_trio.serve._models import load_model

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    model = load_model("tiny-wan", step_seconds=0.0)
    assert model.fps == 16.0 and model.runners[0].capabilities.frames == (4, 1)
    args = parser.parse_args(["--model", "tiny-wan", "--video-jobs", "3", "--video-ttl", "5"])
    service = cli_service(service_options(args), model)
    config = service.videos.config
    assert (config.max_jobs, config.ttl_s, config.fps, service.frames) == (3, 5.0, 16.0, (4, 1))
    args = parser.parse_args(["--model", "tiny-wan", "--video-fps", "10000"])
    with pytest.raises(UsageError, match="--video-fps: the model refuses it"):
        # The default 4 s would be 40001 frames, over MAX_NUM_FRAMES.
        cli_service(service_options(args), model)
    with anyio.fail_after(BUDGET):
        options = service_options(parser.parse_args(["--model", "tiny-wan"]))
        async with serving(cli_service(options, model)) as client:
            card = (await client.get("/v1/models")).json()["data"][0]
    assert (card["fps"], card["default_seconds"], card["frames"]) == (16.0, "4", "4k + 1")
