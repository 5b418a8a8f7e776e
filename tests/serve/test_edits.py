"""``POST /v1/images/edits`` in-process (L76): the OpenAI SDK, streaming, hostile uploads.

Determinism: the tiny SD pipeline (seeded weights) at 64x64 and a few steps, one
torch thread; the app runs in its own lifespan; the OpenAI SDK talks to it through
``httpx2.ASGITransport`` (the SDK's own HTTP client, in-process), the hostile
uploads go through ``httpx.ASGITransport``. Every test runs on trio and asyncio
inside ``anyio.fail_after(BUDGET)``. The file runs in about ten seconds.
"""

from __future__ import annotations

import base64
import io
import struct
import zlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import cache
from typing import Any

import anyio
import httpx
import httpx2
import numpy as np
import openai
import pytest
import torch
from PIL import Image

import omni_trio as ot
from omni_trio.runners import DiffusersRunner, tiny_pipeline
from omni_trio.serve import ServeConfig, Service, UploadLimits
from tests.support.core import BUDGET
from tests.support.serve import PixelWork

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("one_torch_thread")]

PATH = "/v1/images/edits"
SIZE = 64


@cache
def pipe() -> Any:
    return tiny_pipeline("sd")


def png(image: Image.Image) -> bytes:
    data = io.BytesIO()
    image.save(data, format="PNG")
    return data.getvalue()


def picture(seed: int = 0) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def openai_mask() -> Image.Image:
    """An OpenAI-style mask: opaque, the right half fully transparent (repainted)."""
    mask = Image.new("RGBA", (SIZE, SIZE), (0, 0, 0, 255))
    mask.paste((0, 0, 0, 0), (SIZE // 2, 0, SIZE, SIZE))
    return mask


def png_header(width: int, height: int) -> bytes:
    """A PNG whose header declares ``width`` x ``height`` RGB pixels, with 1 KB of data."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)

    def chunk(kind: bytes, payload: bytes) -> bytes:
        crc = zlib.crc32(kind + payload)
        return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", crc)

    idat = zlib.compress(b"\0" * 1024)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def decoded(b64_json: str | None) -> torch.Tensor:
    image = Image.open(io.BytesIO(base64.b64decode(b64_json or "")))
    return torch.from_numpy(np.asarray(image.convert("RGB"), dtype=np.float32) / 255)


@asynccontextmanager
async def serving(**limits: int) -> AsyncIterator[Service]:
    service = Service(
        DiffusersRunner(pipe()),
        engine_config=ot.EngineConfig(max_height=256, max_width=256, max_num_images=2),
        config=ServeConfig(
            model_name="tiny-sd", default_width=SIZE, default_height=SIZE, default_steps=4
        ),
        upload_limits=UploadLimits(**limits),
    )
    async with service.lifespan():
        yield service


def sdk(service: Service) -> openai.AsyncOpenAI:
    http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=service.app), base_url="http://t")
    return openai.AsyncOpenAI(base_url="http://t/v1", api_key="x", http_client=http, max_retries=0)


async def test_the_openai_sdk_edits_with_and_without_a_mask() -> None:
    """L76: ``client.images.edit`` works unchanged: img2img (strength and steps as extra
    fields), inpainting with an OpenAI-style transparent mask (the kept half equals the
    engine's own inpainting of the same request, the repainted half differs), ``n``.
    """
    with anyio.fail_after(BUDGET):
        async with serving() as service:
            client = sdk(service)
            varied = await client.images.edit(
                image=("photo.png", png(picture()), "image/png"),
                prompt="a cat",
                response_format="b64_json",
                extra_body={"strength": 0.5, "num_inference_steps": 10, "seed": 1},
            )
            painted = await client.images.edit(
                image=("photo.png", png(picture()), "image/png"),
                mask=("mask.png", png(openai_mask()), "image/png"),
                prompt="a cat",
                n=2,
                size="64x64",
                extra_body={"seed": 2, "strength": 1.0},
            )
            engine = service.engine
            assert engine is not None
            white_right = Image.new("L", (SIZE, SIZE), 0)
            white_right.paste(255, (SIZE // 2, 0, SIZE, SIZE))
            own = await engine.generate(
                ot.GenerationRequest(
                    prompt="a cat",
                    num_steps=4,
                    height=SIZE,
                    width=SIZE,
                    seed=2,
                    num_images=2,
                    image=picture(),
                    mask=white_right,
                    strength=1.0,
                )
            )
    assert varied.data is not None and len(varied.data) == 1
    assert (varied.model_extra or {})["omni_trio"]["steps"] == 5  # 10 x 0.5
    assert decoded(varied.data[0].b64_json).shape == (SIZE, SIZE, 3)
    assert painted.data is not None and len(painted.data) == 2
    expected = own.images[0].permute(1, 2, 0)
    got = decoded(painted.data[0].b64_json)
    assert (got - expected).abs().max() <= 1 / 255 + 1e-6  # PNG's 8 bits
    source = torch.from_numpy(np.asarray(picture(), dtype=np.float32) / 255)
    assert not torch.allclose(got[:, SIZE // 2 :], source[:, SIZE // 2 :], atol=0.05)


async def test_a_streamed_edit_reports_the_steps_that_run() -> None:
    """L76: ``stream=True`` sends ``image_edit.progress`` events for the steps that run
    (8 steps at strength 0.5: 4), a partial image, then ``image_edit.completed``.
    """
    with anyio.fail_after(BUDGET):
        async with serving() as service:
            stream = await sdk(service).images.edit(
                image=("photo.png", png(picture()), "image/png"),
                prompt="a cat",
                stream=True,
                partial_images=1,
                extra_body={"strength": 0.5, "num_inference_steps": 8},
            )
            events = [event async for event in stream]
    kinds = [event.type for event in events]
    # One partial image spread over the 4 steps that run: at step 4 // 2 + 1 = 3.
    assert kinds == [
        *["image_edit.progress"] * 3,
        "image_edit.partial_image",
        "image_edit.progress",
        "image_edit.completed",
    ]
    totals = {(event.model_extra or {}).get("total") for event in events[:-1]}
    assert totals == {4}


def form(image: bytes | None = None, mask: bytes | None = None, **fields: str) -> dict[str, Any]:
    files: list[tuple[str, tuple[str, bytes, str]]] = []
    if image is not None:
        files.append(("image", ("image.png", image, "image/png")))
    if mask is not None:
        files.append(("mask", ("mask.png", mask, "image/png")))
    return {"files": files, "data": {"prompt": "a cat", **fields}}


def truncated_png() -> bytes:
    whole = png(picture())
    return whole[: len(whole) * 2 // 3]


HOSTILE: list[tuple[dict[str, Any], int, str | None, str]] = [
    (form(b"GIF89a" + b"\0" * 64), 400, "image", "invalid_image"),
    (form(b"\x89PNG\r\n\x1a\n" + b"\0" * 40), 400, "image", "invalid_image"),
    (form(truncated_png()), 400, "image", "invalid_image"),
    (form(png_header(100_000, 100_000)), 413, "image", "image_too_large"),
    (form(png_header(5_000, 5_000)), 413, "image", "image_too_large"),
    (form(png(picture()), png_header(64, 64 * 4097)), 413, "mask", "image_too_large"),
    (form(png(picture()), png(Image.new("L", (32, 32)))), 400, "mask", "invalid_value"),
    (form(mask=png(picture())), 400, "image", "missing_required_parameter"),
    (form(png(picture()), strength="0"), 400, "strength", "invalid_value"),
    (form(png(picture()), strength="1.5"), 400, "strength", "invalid_value"),
    (form(png(picture()), strength="nan"), 400, "strength", "invalid_type"),
    (form(png(picture()), strength="0.01"), 400, "strength", "invalid_value"),
    (form(png(picture()), n="two"), 400, "n", "invalid_type"),
    (form(png(picture()), n="9" * 400), 400, "n", "invalid_value"),
    (form(png(picture()), stream="yes"), 400, "stream", "invalid_type"),
    (form(png(picture()), size="60x64"), 400, "size", "invalid_value"),
    (form(png(picture()), size="9000x9000"), 413, "size", "image_too_large"),
    (form(png(picture()), colour="red"), 400, "colour", "unknown_parameter"),
    (form(png(picture()), prompt="a\x00cat"), 400, "prompt", "invalid_value"),
]


@pytest.mark.parametrize(("request_form", "status", "param", "code"), HOSTILE)
async def test_hostile_uploads_are_refused_before_anything_is_allocated(
    request_form: dict[str, Any], status: int, param: str | None, code: str
) -> None:
    """L76: not an image, a corrupt or truncated PNG, decompression bombs (a small file
    declaring 100,000 x 100,000 pixels: refused from its header, never decoded), a mask
    of another size, bad strengths and fields: a 4xx JSON error naming the field; the
    server serves on (a good edit after it succeeds).
    """
    with anyio.fail_after(BUDGET):
        async with serving(max_pixels=4096 * 4096) as service:
            transport = httpx.ASGITransport(app=service.app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                response = await client.post(PATH, **request_form)
                good = await client.post(PATH, **form(png(picture())))
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"]) == (param, code), error
    assert good.status_code == 200, good.text


async def test_a_body_over_the_byte_limit_is_refused_before_parsing() -> None:
    """L76: a body larger than ``UploadLimits.max_bytes`` gets 413 from its
    ``Content-Length``, and a form that is not multipart gets 400, both before parsing.
    """
    with anyio.fail_after(BUDGET):
        async with serving(max_bytes=4096) as service:
            transport = httpx.ASGITransport(app=service.app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                big = await client.post(PATH, **form(b"\x89PNG\r\n\x1a\n" + bytes(8192)))
                json_body = await client.post(PATH, json={"prompt": "a cat"})
    assert big.status_code == 413
    assert big.json()["error"]["code"] == "request_too_large"
    assert json_body.status_code == 400
    assert json_body.json()["error"]["code"] == "invalid_content_type"


#: Edits the engine refuses (256 px, n <= 2, 1000 steps; SD's sides multiples of 8):
#: (form, the field named). The first is the issue's: a small PNG asking for 4096x4096,
#: which was upscaled and copied in float before the engine refused it.
OVER_THE_ENGINES_LIMITS: list[tuple[dict[str, Any], str]] = [
    (form(png(picture()), size="4096x4096"), "size"),
    (form(png(picture()), size="264x256"), "size"),
    (form(png(picture()), size="100x64"), "size"),
    (form(png(picture()), n="3"), "n"),
    (form(png(picture()), num_inference_steps="1001"), "num_inference_steps"),
    (form(png_header(1024, 1024)), "image"),  # no size: the image's own, over 256
    (form(png_header(1024, 1024), size="auto"), "image"),
    (form(png(picture()), png_header(32, 32)), "mask"),  # another size, from its header
]


async def test_an_edit_the_engine_refuses_decodes_resizes_and_copies_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """L4 (amended), L76: a requested size, ``n`` or step count over the engine's limits or
    off the runner's rules, an image whose own size (no ``size`` sent) is over them, and a
    mask of another size are refused with a 400 naming the field before any pixel is
    decoded or resized (the image's header says its size); nothing reaches the engine. A
    good edit after them decodes (the count counts) and succeeds.
    """
    with anyio.fail_after(BUDGET):
        async with serving() as service:
            transport = httpx.ASGITransport(app=service.app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                work = PixelWork(monkeypatch)
                for request_form, param in OVER_THE_ENGINES_LIMITS:
                    response = await client.post(PATH, **request_form)
                    assert response.status_code == 400, response.text
                    error = response.json()["error"]
                    assert (error["param"], error["code"]) == (param, "invalid_value"), error
                    assert work.done == (0, 0), (param, error)
                    assert param != "image" or "send a size" in error["message"], error
                engine = service.engine
                assert engine is not None and engine.statistics().admitted == 0
                good = await client.post(PATH, **form(png(picture()), size="32x32"))
                assert good.status_code == 200, good.text
                assert work.decodes >= 1 and work.resizes >= 1


async def test_an_edit_without_a_size_keeps_its_images_size_fitted_to_the_model() -> None:
    """L76: without ``size`` (or ``auto``) the output is the image's size, each side rounded
    to the nearest multiple the model takes: a 100x60 image makes 104x64 on SD (multiples
    of 8; it was refused naming ``size``, which the client never sent); one too large for
    the engine is refused naming ``image``, and says to send a size.
    """
    odd = png(Image.new("RGB", (100, 60), (200, 30, 90)))
    with anyio.fail_after(BUDGET):
        async with serving() as service:
            transport = httpx.ASGITransport(app=service.app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                kept = await client.post(PATH, **form(odd, num_inference_steps="2"))
                auto = await client.post(PATH, **form(odd, num_inference_steps="2", size="auto"))
                large = await client.post(
                    PATH, **form(png(Image.new("RGB", (512, 64))), num_inference_steps="2")
                )
    for answer in (kept, auto):
        assert answer.status_code == 200, answer.text
        assert answer.json()["size"] == "104x64"
        assert decoded(answer.json()["data"][0]["b64_json"]).shape == (64, 104, 3)
    assert large.status_code == 400
    error = large.json()["error"]
    assert error["param"] == "image" and "send a size" in error["message"], error
    assert "width: must be <= 256" in error["message"] and "\n" not in error["message"]
