"""Image to video (L69): ``WanImageToVideoPipeline`` (Wan 2.1's) and
``LTXImageToVideoPipeline`` step by step, alone and batched.

Determinism: one torch thread; the tiny pipeline's weights are seeded; the reference
is the pipeline's own ``__call__`` for the same image, prompt and seed (Wan's cleans the
prompt with ``ftfy``, a dependency: the runner encodes it by the same code).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import PIL.Image
import pytest
import torch

import omni_trio as ot
from omni_trio.runners import DiffusersRunner, tiny_pipeline
from omni_trio.runners._load import load_pipeline
from tests.runners.test_dependencies import requirements
from tests.support.core import BUDGET
from tests.support.runners import assert_loaded_output_matches

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("one_torch_thread")]

SIZE = 32
#: Each kind's frame count (Wan 4k + 1, LTX-Video 8k + 1).
FRAMES = {"wan-i2v": 5, "ltx-i2v": 9}
_PIPES: dict[str, Any] = {}


def tiny(kind: str) -> Any:
    """The tiny pipeline of ``kind``, built once per test run."""
    if kind not in _PIPES:
        _PIPES[kind] = tiny_pipeline(kind)
    return _PIPES[kind]


def image(seed: int) -> PIL.Image.Image:
    pixels = torch.rand(SIZE, SIZE, 3, generator=torch.Generator().manual_seed(seed))
    return PIL.Image.fromarray((pixels * 255).to(torch.uint8).numpy())


def request(seed: int, kind: str = "wan-i2v", **fields: Any) -> ot.GenerationRequest:
    values: dict[str, Any] = {
        "prompt": "a fox in the snow",
        "image": image(seed),
        "width": SIZE,
        "height": SIZE,
        "num_frames": FRAMES[kind],
        "num_steps": 3,
        "guidance_scale": 5.0,
        "seed": seed,
    }
    values.update(fields)
    return ot.GenerationRequest(**values)


def own_call(pipe: Any, r: ot.GenerationRequest) -> torch.Tensor:
    """The pipeline's call for ``r``, with the PIL image the request was made of."""
    frames: torch.Tensor = pipe(
        image=image(r.seed or 0),
        prompt=r.prompt,
        height=r.height,
        width=r.width,
        num_frames=r.num_frames,
        num_inference_steps=r.num_steps,
        guidance_scale=r.guidance_scale,
        generator=torch.Generator().manual_seed(r.seed or 0),
        output_type="pt",
    ).frames
    return frames


@pytest.mark.parametrize("kind", ["wan-i2v", "ltx-i2v"])
async def test_image_to_video_alone_and_batched_equals_its_own_call(kind: str) -> None:
    """L69: a request with an image and num_frames runs WanImageToVideoPipeline and
    LTXImageToVideoPipeline step by step: alone, and two requests of different images in
    one batch (the second joining after the first's step), each video equals the
    pipeline's own call (1e-5)."""
    pipe = tiny(kind)
    first, second = request(1, kind), request(2, kind, prompt="a boat")
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(DiffusersRunner(pipe)) as engine:
            alone = await engine.generate(first)
            async with engine.submit(first) as a:
                async for _ in a:
                    break  # the first step is done: the second joins mid-way
                async with engine.submit(second) as b:
                    together = [await a.result(), await b.result()]
    assert alone.video is not None and alone.video.shape == (1, FRAMES[kind], 3, SIZE, SIZE)
    torch.testing.assert_close(alone.video, own_call(pipe, first), atol=1e-5, rtol=0)
    for output, r in zip(together, (first, second), strict=True):
        assert output.video is not None
        torch.testing.assert_close(output.video, own_call(pipe, r), atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", ["wan-i2v", "ltx-i2v"])
async def test_an_unguided_image_to_video_request_equals_its_own_call(kind: str) -> None:
    """L69: a request without guidance (guidance_scale 1: no negative prompt's rows) runs
    too, and equals the pipeline's own call (1e-5)."""
    r = request(3, kind, guidance_scale=1.0, num_steps=2)
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(DiffusersRunner(tiny(kind))) as engine:
            output = await engine.generate(r)
    assert output.video is not None
    torch.testing.assert_close(output.video, own_call(tiny(kind), r), atol=1e-5, rtol=0)


def test_ftfy_is_a_dependency() -> None:
    """L69: Wan's image-to-video pipeline cleans every prompt with ``ftfy`` (a NameError
    without it): pyproject asks for it, with a floor."""
    assert any(s.operator == ">=" for s in requirements()["ftfy"].specifier)


async def test_an_image_to_video_request_is_checked_by_name() -> None:
    """L4, L69: the image-to-video runner refuses a request without an image (naming image)
    or with a strength (naming strength); a text-to-video runner refuses an image."""
    runner = DiffusersRunner(tiny("wan-i2v"))
    assert runner.family == "wan-i2v" and runner.capabilities.image_to_video
    async with ot.open_engine(runner) as engine:
        for fields, name in (({"image": None}, "image"), ({"strength": 0.5}, "strength")):
            with pytest.raises(ot.InvalidRequestError) as caught:
                engine.submit(request(1, **fields))
            assert caught.value.field == name
    async with ot.open_engine(DiffusersRunner(tiny_pipeline("wan"))) as engine:
        with pytest.raises(ot.InvalidRequestError) as caught:
            engine.submit(request(1))
        assert caught.value.field == "image"


@pytest.mark.parametrize("kind", ["wan-i2v", "ltx-i2v"])
async def test_a_saved_image_to_video_folder_loads_to_the_same_output(
    kind: str, tmp_path: Path
) -> None:
    """L69: a folder ``save_pretrained`` wrote (the vision encoder and image processor
    too) loads to the same class, whose output is the tiny pipeline's (to float rounding:
    ``assert_loaded_output_matches``).
    """
    tiny(kind).save_pretrained(tmp_path)
    loaded = load_pipeline(tmp_path)
    assert type(loaded) is type(tiny(kind))
    videos = []
    for pipe in (tiny(kind), loaded):
        with anyio.fail_after(BUDGET):
            async with ot.open_engine(DiffusersRunner(pipe)) as engine:
                output = await engine.generate(request(1, kind, num_steps=2))
        assert output.video is not None
        videos.append(output.video)
    assert_loaded_output_matches(*videos)
