"""DiffusersRunner on tiny SDXL and Qwen-Image pipelines: equality with their own ``__call__``.

Determinism: tiny pipelines with seeded weights; torch uses one thread so batched
and solo runs add in a fixed order; a gated runner holds the worker inside a step
where a preemption must land at a known boundary.

Request mapping: SDXL takes ``guidance_scale`` and ``negative_prompt`` as its
``__call__`` does, and ``extra["guidance_rescale"]``; Qwen-Image takes
``guidance_scale`` as ``true_cfg_scale``, so it guides only with a negative prompt.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import anyio
import pytest
import torch

import omni_trio as ot
from omni_trio.runners import DiffusersRunner, runner_for, tiny_pipeline
from omni_trio.serve import ImageService, ServeConfig
from omni_trio.serve._models import MODELS, TINY_SIZE, TINY_STEPS, load_model
from tests.support.runners import GatedDiffusers, resumed_and_uninterrupted
from tests.test_serve_app import PATH, png_size, serving
from tests.util import BUDGET, read_gated

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("one_torch_thread")]

KINDS = ("sdxl", "qwen-image")
SIZE = 64


@cache
def pipe(kind: str) -> Any:
    return tiny_pipeline(kind)


def request(**fields: Any) -> ot.GenerationRequest:
    values: dict[str, Any] = {
        "prompt": "a red flower",
        "num_steps": 4,
        "height": SIZE,
        "width": SIZE,
        "guidance_scale": 5.0,
        "seed": 7,
    }
    values.update(fields)
    return ot.GenerationRequest(**values)


def reference(kind: str, r: ot.GenerationRequest) -> torch.Tensor:
    """The pipeline's own __call__ output for ``r``, mapped as the family maps it."""
    scale = "true_cfg_scale" if kind == "qwen-image" else "guidance_scale"
    out = pipe(kind)(
        r.prompt,
        negative_prompt=r.negative_prompt,
        num_inference_steps=r.num_steps,
        height=r.height,
        width=r.width,
        num_images_per_prompt=r.num_images,
        generator=torch.Generator().manual_seed(r.seed or 0),
        output_type="pt",
        **{scale: r.guidance_scale},
        **r.extra,
    )
    images: torch.Tensor = out.images
    return images


# (kind, request fields, whether classifier-free guidance runs)
CASES = [
    ("sdxl", {"negative_prompt": "blurry"}, True),
    ("sdxl", {}, True),  # no negative prompt: SDXL's zeroed negative embeddings
    ("sdxl", {"guidance_scale": 1.0}, False),
    ("sdxl", {"extra": {"guidance_rescale": 0.7}, "width": 48}, True),
    ("qwen-image", {"negative_prompt": "blurry"}, True),
    ("qwen-image", {"negative_prompt": " ", "num_images": 2}, True),
    ("qwen-image", {}, False),  # true CFG needs a negative prompt
    ("qwen-image", {"negative_prompt": "blurry", "guidance_scale": 1.0}, False),
]


@pytest.mark.parametrize(("kind", "fields", "cfg"), CASES)
async def test_engine_image_equals_pipeline_call(
    kind: str, fields: dict[str, Any], cfg: bool
) -> None:
    """For a seed, the engine's image equals the pipeline's own __call__ (1e-4), with and
    without guidance; the runner guides exactly when __call__ does.
    """
    r = request(**fields)
    runner = DiffusersRunner(pipe(kind))
    with anyio.fail_after(BUDGET):
        state = runner.prepare(r, "probe")
        assert state.cfg is cfg
        runner.discard(state)
        async with ot.open_engine(runner) as engine:
            output = await engine.generate(r)
    torch.testing.assert_close(output.images, reference(kind, r), atol=1e-4, rtol=0)
    assert output.images.shape == (r.num_images, 3, r.height, r.width)


async def test_guidance_rescale_changes_the_sdxl_image() -> None:
    """extra["guidance_rescale"] reaches the guidance: 0.7 gives another image than 0."""
    runner = DiffusersRunner(pipe("sdxl"))
    assert runner.capabilities.extra_keys == {"guidance_rescale"}
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner) as engine:
            plain = await engine.generate(request())
            rescaled = await engine.generate(request(extra={"guidance_rescale": 0.7}))
    assert float((plain.images - rescaled.images).abs().max()) > 1e-3


@pytest.mark.parametrize(
    ("kind", "fields", "name"),
    [
        ("sdxl", {"height": 60}, "height"),
        ("qwen-image", {"width": 56}, "width"),  # 8 | 56 but not 16
        ("qwen-image", {"extra": {"guidance_rescale": 0.5}}, "extra"),
        ("sdxl", {"extra": {"eta": 0.5}}, "extra"),
    ],
)
async def test_requests_the_model_cannot_serve_are_refused(
    kind: str, fields: dict[str, Any], name: str
) -> None:
    """L4: sizes off the model's grid and unknown extras are refused at submit."""
    async with ot.open_engine(DiffusersRunner(pipe(kind))) as engine:
        with pytest.raises(ot.InvalidRequestError) as info:
            engine.submit(request(**fields))
        assert info.value.field == name


async def test_a_bad_guidance_rescale_fails_the_request() -> None:
    """A guidance_rescale outside [0, 1] fails its request at prepare; the engine serves on."""
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(DiffusersRunner(pipe("sdxl"))) as engine:
            with pytest.raises(ot.RequestFailedError):
                await engine.generate(request(extra={"guidance_rescale": 2.0}))
            await engine.generate(request(num_steps=1))
            assert engine.statistics().failed == 1


# Later requests: other prompts, seeds and step counts, guidance off, two images; for
# Qwen-Image negative prompts of other lengths, so a model call pads and masks text.
JOINERS = {
    "sdxl": [
        {"num_steps": 3, "seed": 2, "prompt": "second", "guidance_scale": 1.0},
        {"num_steps": 5, "seed": 3, "prompt": "third", "num_images": 2},
    ],
    "qwen-image": [
        {"num_steps": 3, "seed": 2, "prompt": "second, longer prompt"},
        {"num_steps": 5, "seed": 3, "prompt": "3", "negative_prompt": "x", "num_images": 2},
    ],
}


@pytest.mark.parametrize("kind", KINDS)
async def test_batch_joining_mid_flight_matches_solo(kind: str) -> None:
    """Requests with other prompts, seeds, steps and guidance join a running batch at its
    third step; each image equals its solo pipeline call (1e-4; reached: 5.4e-7).
    """
    first = request(num_steps=8, seed=1, prompt="first", negative_prompt="dull, grey")
    later = [request(**fields) for fields in JOINERS[kind]]
    runner = DiffusersRunner(pipe(kind))
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner, ot.EngineConfig(max_batch_size=4)) as engine:
            async with engine.submit(first) as head:
                async for event in head:
                    if event.step == 2:
                        joined = [engine.submit(r) for r in later]
                        break
                outputs = [await head.result()]
                for handle in joined:
                    async with handle:
                        outputs.append(await handle.result())
            stats = engine.statistics()
    assert stats.batch_steps < stats.steps_run  # they shared steps
    for r, output in zip([first, *later], outputs, strict=True):
        torch.testing.assert_close(output.images, reference(kind, r), atol=1e-4, rtol=0)


@pytest.mark.parametrize(("kind", "park_on_host"), [("sdxl", True), ("qwen-image", True)])
async def test_a_suspended_request_resumes_to_the_uninterrupted_image(
    kind: str, park_on_host: bool
) -> None:
    """L61: suspended after its first step and resumed later, a request's image is bitwise
    the one it makes uninterrupted (alone both times), and the parked state counts its
    latents' bytes at least.
    """
    low = request(num_steps=5, seed=11, prompt="low", negative_prompt="dull")
    high = request(num_steps=2, seed=12, prompt="high", priority=1)
    resumed, uninterrupted, parked = await resumed_and_uninterrupted(
        pipe(kind), low, high, park_on_host=park_on_host
    )
    assert parked >= 4 * 4 * (SIZE // 8) ** 2
    assert torch.equal(resumed.images, uninterrupted.images)


@pytest.mark.parametrize("kind", KINDS)
async def test_previews_are_small_rgb_images_of_the_latents(kind: str) -> None:
    """L18: previews at the latent grid (Qwen-Image's unpacked), RGB in [0, 1], on the CPU."""
    runner = GatedDiffusers(pipe(kind))
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner) as engine:
            async with engine.submit(request(preview_every=2)) as handle:
                events = await read_gated(handle, runner)
                await handle.result()
    previews = [event.preview for event in events if event.preview is not None]
    assert [event.step for event in events if event.preview is not None] == [2, 4]
    for preview in previews:
        assert preview.shape == (1, 3, SIZE // 8, SIZE // 8)
        assert preview.device.type == "cpu"
        assert float(preview.min()) >= 0.0
        assert float(preview.max()) <= 1.0
    assert not torch.equal(previews[0], previews[1])  # they follow the latents


@pytest.mark.parametrize(
    ("kind", "pipeline"),
    [("sdxl", "StableDiffusionXLPipeline"), ("qwen-image", "QwenImagePipeline")],
)
def test_runner_for_drives_the_new_families_step_by_step(kind: str, pipeline: str) -> None:
    """runner_for picks DiffusersRunner, whose family is the kind."""
    runner = runner_for(pipe(kind))
    assert type(pipe(kind)).__name__ == pipeline
    assert isinstance(runner, DiffusersRunner)
    assert runner.family == kind


@pytest.mark.parametrize(("name", "guidance"), [("tiny-sdxl", 5.0), ("tiny-qwen-image", 4.0)])
async def test_serve_model_names_load_and_serve_the_tiny_pipelines(
    name: str, guidance: float
) -> None:
    """L50: serve --model tiny-sdxl / tiny-qwen-image loads the tiny pipeline at 64 px, the
    tiny step count and the guidance default of the __call__ parameter the family maps
    to, and serves an image of its default size.
    """
    assert name in MODELS
    model = load_model(name, step_seconds=0.0)
    assert isinstance(model.runners[0], DiffusersRunner)
    assert model.runners[0].family == name.removeprefix("tiny-")
    assert (model.size, model.steps, model.guidance_scale) == (TINY_SIZE, TINY_STEPS, guidance)
    config = ServeConfig(
        model_name=model.name,
        default_width=SIZE,
        default_height=SIZE,
        default_steps=2,
        default_guidance_scale=model.guidance_scale,
    )
    with anyio.fail_after(BUDGET):
        async with serving(ImageService(model.runners[0], config=config)) as client:
            response = await client.post(PATH, json={"prompt": "a cat"})
    assert response.status_code == 200, response.text
    assert png_size(response.json()["data"][0]["b64_json"]) == (SIZE, SIZE)
