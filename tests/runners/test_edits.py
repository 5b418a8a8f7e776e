"""Image-to-image and inpainting: the request's fields (L74) and DiffusersRunner (L75).

Determinism: tiny SD and SDXL pipelines with seeded weights at 64x64, 10 steps or
fewer, one torch thread; the input images are seeded noise; the references are
diffusers' own img2img and inpainting pipelines built from the same components,
called with the same seed. A gated runner holds the worker inside a step where an
abort or a suspension must land at a known boundary. The whole file runs in about
half a minute on one CPU core.
"""

from __future__ import annotations

import warnings
from functools import cache
from typing import Any

import anyio
import numpy as np
import pytest
import torch
from PIL import Image

import omni_trio as ot
from omni_trio.runners import DiffusersRunner, RunnerCapabilities
from omni_trio.testing import FakeRunner
from tests.support.core import BUDGET
from tests.support.runners import GatedDiffusers, resumed_and_uninterrupted, tiny

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("one_torch_thread")]

SIZE = 64
#: Measured: at most 2.4e-6 apart on the CPU (float32); the bound leaves room.
TOLERANCE = 1e-4


def picture(seed: int = 1) -> Image.Image:
    """A seeded RGB noise image of ``SIZE`` x ``SIZE``."""
    pixels = np.random.default_rng(seed).integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def right_half() -> Image.Image:
    """A mask that repaints the right half."""
    pixels = np.zeros((SIZE, SIZE), dtype=np.uint8)
    pixels[:, SIZE // 2 :] = 255
    return Image.fromarray(pixels)


def edit(kind: str = "image-to-image", **fields: Any) -> ot.GenerationRequest:
    values: dict[str, Any] = {
        "prompt": "a red flower",
        "num_steps": 10,
        "height": SIZE,
        "width": SIZE,
        "guidance_scale": 5.0,
        "seed": 7,
        "image": picture(),
        "strength": 0.6,
    }
    if kind == "inpaint":
        values["mask"] = right_half()
    values.update(fields)
    return ot.GenerationRequest(**values)


@cache
def edit_pipeline(family: str, inpaint: bool, scheduler: str | None = None) -> Any:
    import diffusers

    base = tiny(family)
    name = {
        ("sd", False): "StableDiffusionImg2ImgPipeline",
        ("sd", True): "StableDiffusionInpaintPipeline",
        ("sdxl", False): "StableDiffusionXLImg2ImgPipeline",
        ("sdxl", True): "StableDiffusionXLInpaintPipeline",
    }[(family, inpaint)]
    components = dict(base.components)
    if scheduler is not None:
        components["scheduler"] = getattr(diffusers, scheduler).from_config(base.scheduler.config)
    built = getattr(diffusers, name)(**components)
    built.set_progress_bar_config(disable=True)
    return built


def reference(
    family: str, r: ot.GenerationRequest, scheduler: str | None = None
) -> tuple[torch.Tensor, int]:
    """The edit pipeline's own images for ``r``, and the steps its loop ran."""
    inpaint = r.mask is not None
    kwargs: dict[str, Any] = {}
    if inpaint:
        kwargs.update(mask_image=right_half(), height=r.height, width=r.width)
    steps: list[int] = []

    def count(pipeline: Any, index: int, t: Any, tensors: dict[str, Any]) -> dict[str, Any]:
        steps.append(index)
        return tensors

    with warnings.catch_warnings():
        # img2img warns (FutureWarning) that one image serves several num_images.
        warnings.simplefilter("ignore", FutureWarning)
        out = edit_pipeline(family, inpaint, scheduler)(
            r.prompt,
            image=picture(),
            strength=r.strength,
            num_inference_steps=r.num_steps,
            guidance_scale=r.guidance_scale,
            num_images_per_prompt=r.num_images,
            generator=torch.Generator().manual_seed(r.seed or 0),
            output_type="pt",
            callback_on_step_end=count,
            **kwargs,
        )
    images: torch.Tensor = out.images
    return images, len(steps)


# -- L75: the runner ------------------------------------------------------------------


@pytest.mark.parametrize("family", ["sd", "sdxl"])
@pytest.mark.parametrize("kind", ["image-to-image", "inpaint"])
async def test_an_edit_equals_its_pipeline_and_reports_the_steps_it_runs(
    family: str, kind: str
) -> None:
    """L75: alone, an img2img or inpainting request's images equal the edit pipeline's
    (1e-4), and its step events count the steps that run: 10 steps at strength 0.6 run 6.
    """
    r = edit(kind)
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(DiffusersRunner(tiny(family))) as engine:
            async with engine.submit(r) as handle:
                events = [(event.step, event.total) async for event in handle]
                output = await handle.result()
    expected, ran = reference(family, r)
    assert ran == r.denoise_steps == 6
    assert events == [(step, 6) for step in range(1, 7)]
    assert output.metrics.steps_done == 6
    torch.testing.assert_close(output.images, expected, atol=TOLERANCE, rtol=0)


@pytest.mark.parametrize("family", ["sd", "sdxl"])
async def test_edits_batch_with_each_other_and_join_mid_way(family: str) -> None:
    """L75: img2img and inpainting requests of other strengths, seeds and image counts join
    a running text-to-image batch mid-way; every image equals its own pipeline's.
    """
    first = ot.GenerationRequest(
        prompt="first", num_steps=8, height=SIZE, width=SIZE, guidance_scale=5.0, seed=1
    )
    later = [
        edit("image-to-image", seed=2, strength=0.5, num_images=2),
        edit("inpaint", seed=3, strength=0.8, guidance_scale=1.0),
        edit("inpaint", seed=4, strength=1.0, num_steps=4),
    ]
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(
            DiffusersRunner(tiny(family)), ot.EngineConfig(max_batch_size=4)
        ) as engine:
            async with engine.submit(first) as head:
                async for event in head:
                    if event.step == 2:
                        joined = [engine.submit(r) for r in later]
                        break
                await head.result()
            outputs = []
            for handle in joined:
                async with handle:
                    outputs.append(await handle.result())
            stats = engine.statistics()
    assert stats.batch_steps < stats.steps_run  # they shared steps
    for r, output in zip(later, outputs, strict=True):
        expected, _ = reference(family, r)
        torch.testing.assert_close(output.images, expected, atol=TOLERANCE, rtol=0)


async def test_a_scheduler_that_draws_noise_draws_what_the_pipeline_draws() -> None:
    """L75: with a scheduler that draws noise at every step (DDPM), the edit's
    images still equal the pipeline's: every draw from the request's generator is made
    in the pipeline's order (the inpainting pipeline's sampling of the masked image too).
    """
    import diffusers as untyped

    diffusers: Any = untyped
    base = tiny("sd")
    noisy = diffusers.StableDiffusionPipeline(
        **{
            **base.components,
            "scheduler": diffusers.DDPMScheduler.from_config(base.scheduler.config),
        }
    )
    for kind in ("image-to-image", "inpaint"):
        r = edit(kind, num_steps=8, strength=0.7)
        with anyio.fail_after(BUDGET):
            async with ot.open_engine(DiffusersRunner(noisy)) as engine:
                output = await engine.generate(r)
        expected, _ = reference("sd", r, "DDPMScheduler")
        torch.testing.assert_close(output.images, expected, atol=TOLERANCE, rtol=0)


async def test_an_aborted_edit_is_never_decoded() -> None:
    """L75, L10, L71: an inpainting request aborted while its third step waits to start
    leaves that step at its first cancel point (the UNet's first block), undecoded, and
    its state (the image's latents, noise and mask with it) is freed.
    """
    runner = GatedDiffusers(tiny("sd"))
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner) as engine:
            handle = engine.submit(edit("inpaint"), request_id="edit")
            runner.release(2)
            await runner.wait_arrived(3)
            engine.abort_nowait("edit")
            runner.open_gate()
            async with handle:
                with pytest.raises(ot.RequestAbortedError):
                    await handle.result()
            assert handle.metrics is not None and handle.metrics.steps_done == 2
    assert runner.decodes == 0
    assert runner.live_states == 0


@pytest.mark.parametrize("park_on_host", [False, True])
async def test_a_suspended_edit_resumes_to_the_uninterrupted_image(park_on_host: bool) -> None:
    """L75, L61: an inpainting request suspended after its first step for a higher
    priority, and resumed, makes bitwise the image it makes uninterrupted; its parked
    state counts the edit's own tensors (image latents, noise, mask) with its latents.
    """
    low = edit("inpaint", seed=11, prompt="low")
    high = ot.GenerationRequest(
        prompt="high", num_steps=2, height=SIZE, width=SIZE, seed=12, priority=1
    )
    resumed, uninterrupted, parked = await resumed_and_uninterrupted(
        tiny("sd"), low, high, park_on_host=park_on_host
    )
    latent = 4 * 4 * (SIZE // 8) ** 2  # one [1, 4, 8, 8] float32 tensor
    assert parked >= 3 * latent + latent // 4  # latents, image latents, noise, mask
    assert torch.equal(resumed.images, uninterrupted.images)


# -- L74: the request -----------------------------------------------------------------


def _grey(size: tuple[int, int] = (SIZE, SIZE)) -> Image.Image:
    return Image.new("L", size, 255)


HOSTILE: list[tuple[dict[str, Any], str, str]] = [
    ({"image": "image.png"}, "image", "must be a PIL image or a float tensor"),
    ({"image": np.zeros((3, SIZE, SIZE), np.float32)}, "image", "got ndarray"),
    ({"image": Image.new("RGBA", (SIZE, SIZE))}, "image", "mode RGB, got mode 'RGBA'"),
    ({"image": Image.new("RGB", (SIZE, 32))}, "image", "is 64x32 (width x height)"),
    ({"image": torch.zeros(3, SIZE, SIZE, dtype=torch.uint8)}, "image", "floating-point"),
    ({"image": torch.zeros(4, SIZE, SIZE)}, "image", "[3, H, W], got shape [4, 64, 64]"),
    ({"image": torch.zeros(1, 3, SIZE, SIZE)}, "image", "got shape [1, 3, 64, 64]"),
    ({"image": torch.full((3, SIZE, SIZE), float("nan"))}, "image", "NaN"),
    ({"image": torch.full((3, SIZE, SIZE), 1.5)}, "image", "in [0, 1], got [1.5, 1.5]"),
    ({"image": torch.full((3, SIZE, SIZE), -0.1)}, "image", "in [0, 1]"),
    ({"image": torch.nn.Parameter(torch.zeros(3, SIZE, SIZE))}, "image", "plain torch.Tensor"),
    ({"image": None, "mask": _grey()}, "mask", "needs an image"),
    ({"mask": Image.new("RGB", (SIZE, SIZE))}, "mask", "mode L or 1"),
    ({"mask": _grey((32, SIZE))}, "mask", "is 32x64 (width x height), the image is 64x64"),
    ({"mask": torch.full((1, SIZE, SIZE), float("nan"))}, "mask", "NaN"),
    ({"mask": torch.zeros(3, SIZE, SIZE)}, "mask", "[1, H, W]"),
    ({"image": None, "strength": 0.5}, "strength", "applies to an image"),
    ({"strength": 0.0}, "strength", "must be > 0"),
    ({"strength": -0.5}, "strength", "must be >= 0.0"),
    ({"strength": 1.5}, "strength", "must be <= 1.0"),
    ({"strength": float("nan")}, "strength", "finite"),
    ({"strength": True}, "strength", "must be a number"),
    ({"strength": "0.5"}, "strength", "must be a number"),
    ({"strength": 0.05}, "strength", "runs no step"),
]


@pytest.mark.parametrize(("fields", "name", "says"), HOSTILE)
def test_hostile_images_masks_and_strengths_are_refused_by_name(
    fields: dict[str, Any], name: str, says: str
) -> None:
    """L74: wrong types, modes, shapes, sizes, dtypes, NaN, ranges, a mask without an
    image, strengths out of (0, 1] or too small to run a step: ``InvalidRequestError``
    naming the field, nothing else raised.
    """
    kind = "inpaint" if "mask" in fields and fields.get("image", 1) is not None else "img"
    values = {"image": picture(), "strength": 0.6, **fields}
    with pytest.raises(ot.InvalidRequestError) as info:
        edit(kind, **values)
    assert info.value.field == name
    assert says in str(info.value)


def test_an_undecodable_image_is_refused_by_name() -> None:
    """L74: a lazily opened PNG whose data is cut short fails naming ``image``."""
    import io

    data = io.BytesIO()
    picture().save(data, format="PNG")
    truncated = Image.open(io.BytesIO(data.getvalue()[: len(data.getvalue()) // 2]))
    with pytest.raises(ot.InvalidRequestError) as info:
        edit(image=truncated)
    assert info.value.field == "image"
    assert "could not be decoded" in str(info.value)


def test_images_are_private_copies_compared_by_value_and_kept_out_of_batch_keys() -> None:
    """L74: the request keeps a CPU float32 copy (changing the caller's tensor changes
    nothing), defaults the strength by kind, compares images by value, shows none in its
    ``repr``, and no runner may put ``image`` or ``mask`` in its batch key (``kind`` may).
    """
    pixels = torch.rand(3, SIZE, SIZE, dtype=torch.float64)
    r = edit(image=pixels, strength=None)
    pixels.fill_(0.0)
    assert isinstance(r.image, torch.Tensor) and r.image.dtype == torch.float32
    assert float(r.image.max()) > 0
    assert (r.kind, r.strength, r.denoise_steps) == ("image-to-image", 0.8, 8)
    inpaint = edit("inpaint", strength=None)
    assert (inpaint.kind, inpaint.strength, inpaint.denoise_steps) == ("inpaint", 1.0, 10)
    plain = ot.GenerationRequest(num_steps=10)
    assert (plain.kind, plain.strength, plain.denoise_steps) == ("text-to-image", None, 10)
    assert edit() == edit() and edit() != edit(image=picture(2)) and edit() != plain
    assert "image=" not in repr(r) and "mask=" not in repr(inpaint)
    for fields in (("height", "image"), ("mask",)):
        with pytest.raises(ValueError, match="batch_key_fields"):
            RunnerCapabilities(batch_key_fields=fields)
    keyed = RunnerCapabilities(batch_key_fields=("height", "width", "kind"))
    assert keyed.batch_key(inpaint) == (SIZE, SIZE, "inpaint")
    assert keyed.batch_key(r) != keyed.batch_key(inpaint)
    with pytest.raises(ValueError, match="image_input"):
        RunnerCapabilities(mask_input=True)


@pytest.mark.parametrize(
    ("runner", "fields", "name"),
    [
        ("fake", {}, "image"),
        ("sd3", {}, "image"),
        ("mask-only", {"mask": _grey()}, "mask"),
    ],
)
async def test_runners_that_take_no_images_refuse_them_by_name(
    runner: str, fields: dict[str, Any], name: str
) -> None:
    """L74: a runner that does not declare ``image_input`` (``mask_input``) refuses an
    image (a mask) at admission, naming the field; the engine serves on.
    """
    if runner == "fake":
        made: Any = FakeRunner()
    elif runner == "sd3":
        made = DiffusersRunner(tiny("sd3"))
    else:

        class ImagesOnly(FakeRunner):
            @property
            def capabilities(self) -> RunnerCapabilities:
                return RunnerCapabilities(image_input=True, batch_key_fields=())

        made = ImagesOnly()
    r = edit(**fields)
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(made) as engine:
            with pytest.raises(ot.InvalidRequestError) as info:
                engine.submit(r)
            assert info.value.field == name
            assert engine.statistics().waiting == 0
