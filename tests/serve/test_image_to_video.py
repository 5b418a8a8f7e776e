"""``/v1/videos`` with ``input_reference`` (L69, L4 amended): image to video over HTTP.

Determinism: tiny Wan image-to-video (seeded weights, one torch thread); the
reference output is the engine's for the same request made in-process; uploads that
must be refused are counted by ``PixelWork`` (no decode, no resize). The real
servers (``serve --model FOLDER``, a subprocess on a free loopback port) are polled
until the job ends, within a budget.
"""

from __future__ import annotations

import io
import re
from pathlib import Path
from typing import Any

import anyio
import httpx
import httpx2
import openai
import PIL.Image
import pytest
import torch

import omni_trio as ot
from omni_trio.runners import DiffusersRunner, tiny_pipeline
from omni_trio.serve import ServeConfig, Service, UploadLimits, VideoConfig
from omni_trio.serve.jobs import encode_mp4
from tests.support.core import BUDGET
from tests.support.serve import PixelWork, poll_until, run_server

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("one_torch_thread")]

SIZE = 32
#: Each kind's frame count (Wan 4k + 1, LTX-Video 8k + 1).
FRAMES = {"wan-i2v": 5, "ltx-i2v": 9}


@pytest.fixture(scope="module")
def pipe() -> Any:
    return tiny_pipeline("wan-i2v")


def png(width: int, height: int, seed: int = 1) -> bytes:
    pixels = torch.rand(height, width, 3, generator=torch.Generator().manual_seed(seed))
    data = io.BytesIO()
    PIL.Image.fromarray((pixels * 255).to(torch.uint8).numpy()).save(data, format="PNG")
    return data.getvalue()


def service(pipe: Any, **uploads: Any) -> Service:
    return Service(
        DiffusersRunner(pipe),
        config=ServeConfig(
            model_name="tiny-wan-i2v", default_width=SIZE, default_height=SIZE, default_steps=2
        ),
        upload_limits=UploadLimits(**uploads),
        video_config=VideoConfig(fps=8.0),
    )


@pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")
async def test_the_openai_sdk_makes_a_video_from_an_input_reference(pipe: Any) -> None:
    """L69: the OpenAI SDK's videos.create with input_reference (a multipart file) makes a
    video from the image on an image-to-video model; an image of another size is resized
    to the video's; its MP4 holds the frames the engine makes for the same request."""
    served = service(pipe)
    http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=served.app), base_url="http://t")
    client = openai.AsyncOpenAI(base_url="http://t/v1", api_key="x", http_client=http)
    with anyio.fail_after(BUDGET):
        async with served.lifespan():
            video = await client.videos.create(
                prompt="a fox",
                input_reference=("fox.png", png(SIZE, SIZE), "image/png"),
                extra_body={"num_frames": 5, "seed": 4, "guidance_scale": 5.0},
            )
            done = await client.videos.poll(video.id, poll_interval_ms=5)
            assert done.status == "completed", done
            mp4 = (await client.videos.download_content(video.id)).read()
            resized = await client.videos.create(
                prompt="a fox",
                input_reference=("big.png", png(48, 40), "image/png"),
                extra_body={"num_frames": 5, "seed": 4},
            )
            finished = await client.videos.poll(resized.id, poll_interval_ms=5)
            assert str(finished.size) == "32x32"
        await http.aclose()
    with PIL.Image.open(io.BytesIO(png(SIZE, SIZE))) as image:
        request = ot.GenerationRequest(
            prompt="a fox", image=image.convert("RGB"), width=SIZE, height=SIZE, num_frames=5,
            num_steps=2, guidance_scale=5.0, seed=4,
        )  # fmt: skip
    async with ot.open_engine(DiffusersRunner(pipe)) as engine:
        expected = await engine.generate(request)
    assert expected.video is not None and expected.video.shape == (1, 5, 3, SIZE, SIZE)
    assert mp4 == encode_mp4(expected, 8.0)


async def test_an_input_reference_is_checked_before_it_is_decoded(
    pipe: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """L4 (amended), L69: an image-to-video model needs an input_reference (400 naming it);
    one over the upload's pixel limit (413), not a file (400), or sent with a request the
    engine refuses (a bad num_frames: 400 naming it) is refused from its header, never
    decoded nor resized."""
    served = service(pipe, max_pixels=40 * 40)
    transport = httpx.ASGITransport(app=served.app)
    with anyio.fail_after(BUDGET):
        async with (
            served.lifespan(),
            httpx.AsyncClient(transport=transport, base_url="http://t") as client,
        ):
            work = PixelWork(monkeypatch)
            bare = await client.post("/v1/videos", json={"prompt": "a fox", "num_frames": 5})
            assert (bare.status_code, bare.json()["error"]["param"]) == (400, "input_reference")
            cases = [
                ({"num_frames": "5"}, png(64, 64), 413, "input_reference"),
                ({"num_frames": "6"}, png(SIZE, SIZE), 400, "num_frames"),
            ]
            for data, file, status, param in cases:
                response = await client.post(
                    "/v1/videos",
                    data={"prompt": "a fox", **data},
                    files={"input_reference": ("a.png", file, "image/png")},
                )
                assert response.status_code == status, response.text
                assert response.json()["error"]["param"] == param
            text = await client.post(
                "/v1/videos", json={"prompt": "a fox", "num_frames": 5, "input_reference": "x"}
            )
            assert (text.status_code, text.json()["error"]["param"]) == (400, "input_reference")
            assert work.done == (0, 0)
            assert served.engine is not None and served.engine.statistics().admitted == 0


@pytest.fixture(scope="module")
def folders(pipe: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny image-to-video pipelines, saved with ``save_pretrained`` as a user's are."""
    saved = {}
    for kind in FRAMES:
        saved[kind] = tmp_path_factory.mktemp("models") / kind
        (pipe if kind == "wan-i2v" else tiny_pipeline(kind)).save_pretrained(saved[kind])
    return saved


@pytest.mark.timeout(240)  # a server start of a tiny model folder, 10 to 30 s on 2 cores
@pytest.mark.parametrize(("kind", "server"), [("wan-i2v", "hypercorn"), ("ltx-i2v", "uvicorn")])
def test_serve_a_saved_image_to_video_folder_makes_a_video_from_an_image(
    folders: dict[str, Path], kind: str, server: str, tmp_path: Path
) -> None:
    """L69: ``serve --model FOLDER`` of a saved Wan or LTX-Video image-to-video pipeline
    starts (its defaults are checked, and it warms up, with an image as the model needs)
    and makes a job of an input_reference into an MP4 of the frames and size asked for."""
    import av

    args = ("--model", str(folders[kind]), "--torch-threads", "1", "--jobs-dir", "none")
    with run_server(*args, server=server, log_dir=tmp_path) as handle:
        form = {"prompt": "a fox", "num_frames": str(FRAMES[kind]), "size": f"{SIZE}x{SIZE}",
                "num_inference_steps": "2", "seed": "4"}  # fmt: skip
        created = httpx.post(
            f"{handle.url}/v1/videos",
            data=form,
            files={"input_reference": ("fox.png", png(SIZE, SIZE), "image/png")},
            timeout=BUDGET,
        )
        assert created.status_code == 200, created.text
        job = f"{handle.url}/v1/videos/{created.json()['id']}"

        def ended() -> bool:
            return httpx.get(job, timeout=BUDGET).json()["status"] in ("completed", "failed")

        poll_until(ended, timeout=120, what="the job to end")
        assert httpx.get(job, timeout=BUDGET).json()["status"] == "completed"
        content = httpx.get(f"{job}/content", timeout=BUDGET)
        log = handle.log_text()
    assert re.search(r"warm-up: \d+ step\(s\) of \d+x\d+ in ", log), log
    assert content.headers["content-type"] == "video/mp4"
    with av.open(io.BytesIO(content.content), mode="r") as container:
        shapes = [frame.to_ndarray(format="rgb24").shape for frame in container.decode(video=0)]
    assert shapes == [(SIZE, SIZE, 3)] * FRAMES[kind]
