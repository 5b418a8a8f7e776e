"""DiffusersRunner on tiny real pipelines: equality with the pipelines' own output.

Determinism: tiny pipelines with seeded weights; torch uses one thread so batched
and solo runs add in a fixed order; a gated subclass holds the worker inside a
step where an abort must land at a known boundary.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import anyio
import pytest
import torch

import omni_trio as ot
from omni_trio._request import MAX_GUIDANCE_SCALE
from omni_trio.runners import DiffusersRunner, tiny_pipeline
from omni_trio.runners._family import step_groups
from tests.support.runners import GatedDiffusers, resumed_and_uninterrupted
from tests.util import BUDGET, read_gated

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("one_torch_thread")]

SIZE = {"sd": 64, "sd3": 64, "flux": 64, "unet": 32}


@cache
def pipe(kind: str) -> Any:
    return tiny_pipeline(kind)


def request(kind: str, **fields: Any) -> ot.GenerationRequest:
    values: dict[str, Any] = {
        "prompt": "a red flower",
        "num_steps": 4,
        "height": SIZE[kind],
        "width": SIZE[kind],
        "guidance_scale": 5.0,
        "seed": 7,
    }
    values.update(fields)
    return ot.GenerationRequest(**values)


def reference(kind: str, r: ot.GenerationRequest) -> torch.Tensor:
    """The pipeline's own __call__ output for ``r``."""
    generator = torch.Generator().manual_seed(r.seed or 0)
    if kind == "unet":
        out = pipe(kind)(
            batch_size=r.num_images,
            num_inference_steps=r.num_steps,
            generator=generator,
            output_type="pt",
        )
    else:
        kwargs: dict[str, Any] = {}
        if r.negative_prompt is not None:
            kwargs["negative_prompt"] = r.negative_prompt
        out = pipe(kind)(
            r.prompt,
            num_inference_steps=r.num_steps,
            height=r.height,
            width=r.width,
            guidance_scale=r.guidance_scale,
            num_images_per_prompt=r.num_images,
            generator=generator,
            output_type="pt",
            **kwargs,
        )
    images: torch.Tensor = out.images
    return images


@pytest.mark.parametrize("kind", ["sd", "sd3", "flux", "unet"])
async def test_engine_image_equals_pipeline_call(kind: str) -> None:
    """For a seed, the engine's image equals the pipeline's own __call__ (1e-4)."""
    extra = {"negative_prompt": "blurry"} if kind in ("sd", "sd3") else {}
    r = request(kind, **extra)
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(DiffusersRunner(pipe(kind))) as engine:
            output = await engine.generate(r)
    torch.testing.assert_close(output.images, reference(kind, r), atol=1e-4, rtol=0)
    assert output.images.shape == (1, 3, SIZE[kind], SIZE[kind])


@pytest.mark.parametrize("kind", ["sd", "sd3", "flux"])
async def test_batch_joining_mid_flight_matches_solo(kind: str) -> None:
    """Requests with other prompts, seeds and steps join a running batch; each equals solo."""
    first = request(kind, num_steps=8, seed=1, prompt="first")
    later = [
        request(kind, num_steps=3, seed=2, prompt="second", guidance_scale=1.0),
        request(kind, num_steps=5, seed=3, prompt="third", num_images=2),
    ]
    runner = DiffusersRunner(pipe(kind))
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner, ot.EngineConfig(max_batch_size=4)) as engine:
            async with engine.submit(first) as head:
                async for event in head:
                    if event.step == 2:
                        break_after_join = [engine.submit(r) for r in later]
                        break
                outputs = [await head.result()]
                for handle in break_after_join:
                    async with handle:
                        outputs.append(await handle.result())
            stats = engine.statistics()
    assert stats.batch_steps < stats.steps_run  # they shared steps
    for r, output in zip([first, *later], outputs, strict=True):
        torch.testing.assert_close(output.images, reference(kind, r), atol=1e-3, rtol=0)


async def test_abort_one_member_leaves_others_equal_to_solo() -> None:
    """L9, L10: an aborted member leaves the batch undecoded; the others equal their solo runs."""
    kind = "sd"
    requests = {rid: request(kind, num_steps=6, seed=i, prompt=rid) for i, rid in enumerate("abc")}
    runner = GatedDiffusers(pipe(kind))
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner, ot.EngineConfig(max_batch_size=4)) as engine:
            handles = {rid: engine.submit(r, request_id=rid) for rid, r in requests.items()}
            runner.release(2)
            await runner.wait_arrived(3)
            engine.abort_nowait("b")
            runner.release(100)
            outputs = {}
            for rid, handle in handles.items():
                async with handle:
                    if rid == "b":
                        with pytest.raises(ot.RequestAbortedError):
                            await handle.result()
                    else:
                        outputs[rid] = await handle.result()
    assert runner.decodes == 2
    assert runner.live_states == 0
    for rid in ("a", "c"):
        torch.testing.assert_close(
            outputs[rid].images, reference(kind, requests[rid]), atol=1e-3, rtol=0
        )


@pytest.mark.parametrize("kind", ["sd", "flux", "unet"])
async def test_previews_only_when_asked_and_read(kind: str) -> None:
    """L18: previews are small RGB images in [0, 1], only for a reading consumer."""
    runner = GatedDiffusers(pipe(kind))
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner) as engine:
            async with engine.submit(request(kind, preview_every=2)) as handle:
                events = await read_gated(handle, runner)
                await handle.result()
            async with engine.submit(request(kind, preview_every=0)) as handle:
                assert [event.preview async for event in handle] == [None] * 4
                await handle.result()
    assert [event.step for event in events if event.preview is not None] == [2, 4]
    for event in events:
        if event.preview is not None:
            assert event.preview.shape[:2] == (1, 3)
            assert event.preview.device.type == "cpu"
            assert float(event.preview.min()) >= 0.0
            assert float(event.preview.max()) <= 1.0


async def test_pipeline_stays_usable_after_the_engine() -> None:
    """The engine never changes the caller's pipeline: its own call still gives the same image."""
    kind = "sd"
    r = request(kind)
    before = reference(kind, r)
    async with ot.open_engine(DiffusersRunner(pipe(kind))) as engine:
        await engine.generate(r)
    torch.testing.assert_close(reference(kind, r), before, atol=0, rtol=0)
    assert pipe(kind).unet.training is False


@pytest.mark.parametrize(
    ("kind", "fields", "name"),
    [
        ("sd", {"height": 60}, "height"),
        ("sd3", {"width": 40}, "width"),
        ("flux", {"negative_prompt": "x"}, "negative_prompt"),
        ("unet", {"height": 64}, "height"),
        ("sd", {"extra": {"eta": 0.5}}, "extra"),
    ],
)
async def test_requests_the_model_cannot_serve_are_refused(
    kind: str, fields: dict[str, Any], name: str
) -> None:
    """L4: sizes off the model's grid, unsupported negative prompts, unknown extras."""
    async with ot.open_engine(DiffusersRunner(pipe(kind))) as engine:
        with pytest.raises(ot.InvalidRequestError) as info:
            engine.submit(request(kind, **fields))
        assert info.value.field == name


async def test_overflowing_guidance_never_delivers_nan_pixels() -> None:
    """L4, L22: tiny SD at guidance 1e300 is refused at construction; at the bound it gives
    valid pixels; forced past the bound (the model overflows to NaN) the request fails.
    """
    with pytest.raises(ot.InvalidRequestError) as info:
        request("sd", guidance_scale=1e300)
    assert info.value.field == "guidance_scale"
    at_bound = request("sd", guidance_scale=MAX_GUIDANCE_SCALE)
    # A request validated, then forced past the bound: what a model overflow looks like.
    forced = request("sd")
    object.__setattr__(forced, "guidance_scale", 1e300)
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(DiffusersRunner(pipe("sd"))) as engine:
            output = await engine.generate(at_bound)
            low, high = torch.aminmax(output.images)
            assert float(low) >= 0.0 and float(high) <= 1.0
            with pytest.raises(ot.RequestFailedError) as failed:
                await engine.generate(forced, request_id="forced")
            assert isinstance(failed.value.__cause__, ot.InvalidOutputError)
            assert str(failed.value) == (
                "request 'forced' failed: the runner's decode returned images with NaN values"
            )
            # The engine serves on.
            await engine.generate(request("sd"))
            assert engine.statistics().failed == 1


def test_unsupported_pipeline_is_refused_by_name() -> None:
    """A pipeline of another family gets a TypeError listing what is supported."""
    with pytest.raises(TypeError, match="StableDiffusionPipeline"):
        DiffusersRunner(object())


def test_step_groups_follow_the_progress_bar() -> None:
    """PNDM's warm-up call and Heun's second-order calls fold into the requested steps."""
    assert step_groups(4, 4, 1) == [1, 1, 1, 1]
    assert step_groups(5, 4, 1) == [2, 1, 1, 1]  # PNDM with skip_prk_steps
    assert step_groups(7, 4, 2) == [2, 2, 2, 1]  # Heun: 2n - 1 calls


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
async def test_cuda_decode_overlaps_and_lands_in_pinned_memory() -> None:
    """L16 on CUDA: decode on a side stream into pinned host memory; images equal the pipeline's."""
    kind = "sd"
    cuda_pipe: Any = tiny_pipeline(kind).to("cuda")
    r = request(kind)
    runner = DiffusersRunner(cuda_pipe)
    async with ot.open_engine(runner, ot.EngineConfig(max_batch_size=2)) as engine:
        outputs = [await engine.generate(r) for _ in range(2)]
    expected = cuda_pipe(
        r.prompt,
        num_inference_steps=r.num_steps,
        height=r.height,
        width=r.width,
        guidance_scale=r.guidance_scale,
        generator=torch.Generator().manual_seed(r.seed or 0),
        output_type="pt",
    ).images.cpu()
    for output in outputs:
        assert output.images.is_pinned()
        torch.testing.assert_close(output.images, expected, atol=1e-3, rtol=0)


@pytest.mark.parametrize(("kind", "park_on_host"), [("sd", False), ("sd", True), ("unet", True)])
async def test_a_suspended_request_resumes_to_the_uninterrupted_image(
    kind: str, park_on_host: bool
) -> None:
    """L61: suspended after its first step and resumed later, a request's image is bitwise
    the one it makes uninterrupted (same batch composition: alone), and the parked state
    counts its latents' bytes at least. "unet" is DDPM: its scheduler draws noise from the
    request's generator at every step, so the generator's state must survive too. (On the
    CPU, parking on the host moves nothing: the CUDA test below moves it.)
    """
    low = request(kind, num_steps=5, seed=11, prompt="low")
    high = request(kind, num_steps=2, seed=12, prompt="high", priority=1)
    resumed, uninterrupted, parked = await resumed_and_uninterrupted(
        pipe(kind), low, high, park_on_host=park_on_host
    )
    assert parked >= 4 * 4 * (SIZE[kind] // 8) ** 2
    assert torch.equal(resumed.images, uninterrupted.images)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    "scheduler", ["PNDMScheduler", "DPMSolverMultistepScheduler", "EulerDiscreteScheduler"]
)
async def test_a_request_parked_on_the_host_resumes_exactly_on_cuda(scheduler: str) -> None:
    """L61 on CUDA: parked in host memory (latents, conditioning, the scheduler's tensors and
    history) and moved back, a request resumes to its uninterrupted image, bitwise, with
    schedulers that keep history (PNDM, multistep DPM) and CPU-side sigmas (Euler).
    """
    import diffusers

    cuda_pipe: Any = tiny_pipeline("sd").to("cuda")
    cuda_pipe.scheduler = getattr(diffusers, scheduler).from_config(cuda_pipe.scheduler.config)
    low = request("sd", num_steps=5, seed=11, prompt="low")
    high = request("sd", num_steps=2, seed=12, prompt="high", priority=1)
    resumed, uninterrupted, _ = await resumed_and_uninterrupted(
        cuda_pipe, low, high, park_on_host=True
    )
    assert torch.equal(resumed.images, uninterrupted.images)
