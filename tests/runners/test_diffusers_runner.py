"""DiffusersRunner on tiny real pipelines: aborts, refusals, bad outputs, CUDA.

What every family must do (equal its own ``__call__``, join mid-flight, resume
exactly, serve on after a cancel point) is the conformance suite's
(test_conformance.py); this file holds what the runner does around the families.

Determinism: tiny pipelines with seeded weights; torch uses one thread so batched
and solo runs add in a fixed order; a gated subclass holds the worker inside a
step where an abort must land at a known boundary.
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest
import torch

import omni_trio as ot
from omni_trio._request import MAX_GUIDANCE_SCALE
from omni_trio.runners import DiffusersRunner, tiny_pipeline
from omni_trio.runners._family import step_groups
from tests.support.core import BUDGET
from tests.support.runners import (
    GatedDiffusers,
    reference,
    request,
    resumed_and_uninterrupted,
    tiny,
)

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("one_torch_thread")]


async def test_abort_one_member_leaves_others_equal_to_solo() -> None:
    """L9, L10: an aborted member leaves the batch undecoded; the others equal their solo runs."""
    kind = "sd"
    requests = {rid: request(kind, num_steps=6, seed=i, prompt=rid) for i, rid in enumerate("abc")}
    runner = GatedDiffusers(tiny(kind))
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


async def test_pipeline_stays_usable_after_the_engine() -> None:
    """The engine never changes the caller's pipeline: its own call still gives the same image."""
    kind = "sd"
    r = request(kind)
    before = reference(kind, r, tiny(kind))  # the call itself, each time: no kept output
    async with ot.open_engine(DiffusersRunner(tiny(kind))) as engine:
        await engine.generate(r)
    torch.testing.assert_close(reference(kind, r, tiny(kind)), before, atol=0, rtol=0)
    assert tiny(kind).unet.training is False


@pytest.mark.parametrize(
    ("kind", "fields", "name"),
    [
        ("sd", {"height": 60}, "height"),
        ("sdxl", {"height": 60}, "height"),
        ("sd3", {"width": 40}, "width"),
        ("qwen-image", {"width": 56}, "width"),  # 8 | 56 but not 16
        ("flux", {"negative_prompt": "x"}, "negative_prompt"),
        ("unet", {"height": 64}, "height"),
        ("sd", {"extra": {"eta": 0.5}}, "extra"),
        ("sdxl", {"extra": {"eta": 0.5}}, "extra"),
        ("qwen-image", {"extra": {"guidance_rescale": 0.5}}, "extra"),
    ],
)
async def test_requests_the_model_cannot_serve_are_refused(
    kind: str, fields: dict[str, Any], name: str
) -> None:
    """L4: sizes off the model's grid, unsupported negative prompts, unknown extras."""
    async with ot.open_engine(DiffusersRunner(tiny(kind))) as engine:
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
        async with ot.open_engine(DiffusersRunner(tiny("sd"))) as engine:
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
    expected = reference(kind, r, cuda_pipe).cpu()
    for output in outputs:
        assert output.images.is_pinned()
        torch.testing.assert_close(output.images, expected, atol=1e-3, rtol=0)


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
