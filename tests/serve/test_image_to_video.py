"""``/v1/videos`` with ``input_reference`` (L69, L4 amended): image to video over HTTP.

Determinism: tiny Wan image-to-video (seeded weights, one torch thread); the
reference output is the engine's for the same request made in-process; uploads that
must be refused are counted by ``PixelWork`` (no decode, no resize). The pipeline's
prompt cleaning needs ``ftfy``, absent here: a stand-in returns the text.
"""

from __future__ import annotations

import io
import types
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
from omni_trio.serve._video_jobs import encode_mp4
from tests.support.core import BUDGET
from tests.support.serve import PixelWork

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("one_torch_thread")]

SIZE = 32


@pytest.fixture(scope="module")
def pipe() -> Any:
    return tiny_pipeline("wan-i2v")


@pytest.fixture(autouse=True)
def _ftfy_stand_in(monkeypatch: pytest.MonkeyPatch) -> None:
    module = pytest.importorskip("diffusers.pipelines.wan.pipeline_wan_i2v")
    if not hasattr(module, "ftfy"):
        monkeypatch.setattr(
            module, "ftfy", types.SimpleNamespace(fix_text=lambda t: t), raising=False
        )


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
