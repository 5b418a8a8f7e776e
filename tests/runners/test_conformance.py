"""The family conformance suite: what DiffusersRunner does for every tiny family alike.

Every test runs for every kind of ``TINY_KINDS`` and ``TINY_VIDEO_KINDS``: a family
that joins them joins this suite, and passes it before it is driven step by step.
What a family does alone (its request options, SDXL's guidance rescale, Wan 2.2's two
experts, edits, LTX-Video's decode noise) lives in its own test module.

- a request alone equals the pipeline's own ``__call__`` for its seed;
- requests that join a running batch mid-flight each equal their own ``__call__``;
- a suspended request resumes to its uninterrupted output, bitwise;
- a request left at a cancel point inside a step leaves the model to serve the next
  request bitwise as a fresh engine does;
- previews are small RGB images of the latents, only for a reading consumer;
- ``runner_for`` drives the pipeline step by step.

Determinism: tiny pipelines with seeded weights, built once (``tiny``); torch uses
one thread, so batched and solo runs add in a fixed order; a gated runner, or a gate
on one module's call, holds the worker at a known place.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import anyio
import pytest
import torch

import omni_trio as ot
from omni_trio.runners import DiffusersRunner, runner_for
from omni_trio.runners._cancel import cancel_modules
from tests.support.core import BUDGET, read_gated
from tests.support.runners import (
    KINDS,
    SIZE,
    GatedDiffusers,
    ModuleGate,
    abort_inside,
    reference,
    request,
    resumed_and_uninterrupted,
    tiny,
)

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("one_torch_thread")]


@cache
def honours_negative_prompt(kind: str) -> bool:
    """Whether the family takes ``negative_prompt`` (Flux and the unconditional UNet refuse it)."""
    runner = DiffusersRunner(tiny(kind))
    runner.close()
    return runner.capabilities.negative_prompt


def of(kind: str, *, negative_prompt: str | None = None, **fields: Any) -> ot.GenerationRequest:
    """``request(kind, ...)``, its negative prompt kept only where the family takes one."""
    if not honours_negative_prompt(kind):
        negative_prompt = None
    return request(kind, negative_prompt=negative_prompt, **fields)


def prepared(kind: str, r: ot.GenerationRequest) -> tuple[list[int], int]:
    """``r``'s model calls per step, and its latents' bytes, from a fresh runner's prepare."""
    runner = DiffusersRunner(tiny(kind))
    try:
        state = runner.prepare(r, "probe")
        assert state.latents is not None
        found = (list(state.groups), state.latents.nbytes)
        runner.discard(state)
    finally:
        runner.close()
    return found


def output_of(r: ot.GenerationRequest, output: ot.GenerationOutput) -> torch.Tensor:
    """A video request's frames, else its images."""
    if r.num_frames is None:
        return output.images
    assert output.video is not None
    return output.video


@pytest.mark.parametrize("kind", KINDS)
async def test_a_request_alone_equals_the_pipelines_own_call(kind: str) -> None:
    """L70, L72: for a seed, guided, with a negative prompt where the family takes one, the
    engine's output equals the pipeline's own __call__ (1e-4 for images; 1e-5 for videos,
    reached: identical for LTX-Video, 1.2e-6 for Wan, whose __call__ makes its two guidance
    calls apart): images [N, C, H, W], a video a CPU float tensor [N, F, C, H, W] in
    [0, 1] decoded in chunks with cancel points between them, its images the first frames.
    """
    r = of(kind, negative_prompt="blurry")
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(DiffusersRunner(tiny(kind))) as engine:
            output = await engine.generate(r)
    got = output_of(r, output)
    frames = () if r.num_frames is None else (r.num_frames,)
    assert got.shape == (1, *frames, 3, SIZE[kind], SIZE[kind])
    assert got.dtype == torch.float32 and got.device.type == "cpu"
    tolerance = 1e-4 if r.num_frames is None else 1e-5
    torch.testing.assert_close(got, reference(kind, r), atol=tolerance, rtol=0)
    if r.num_frames is not None:
        assert torch.equal(output.images, got[:, 0])


@pytest.mark.parametrize("kind", KINDS)
async def test_requests_joining_mid_flight_each_equal_their_own_call(kind: str) -> None:
    """L70: two requests of other prompts, seeds, steps and guidance share every step from
    the first, a third (two images or videos) joins while the second step runs; each
    equals its own __call__ (1e-4; Qwen-Image's prompts of different lengths pad and mask
    the text of one model call).
    """
    first = of(kind, num_steps=4, seed=1, prompt="first", negative_prompt="dull, grey")
    second = of(kind, num_steps=3, seed=2, prompt="second, longer prompt", guidance_scale=1.0)
    # LTXPipeline's own call fails for two videos of one prompt with a timestep-conditioned
    # VAE (see test_video.py): one each for it.
    images = 1 if kind == "ltx" else 2
    third = of(kind, num_steps=2, seed=3, prompt="3", negative_prompt="x", num_images=images)
    runner = GatedDiffusers(tiny(kind))
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner, ot.EngineConfig(max_batch_size=4)) as engine:
            handles = [engine.submit(first), engine.submit(second)]
            await runner.wait_arrived(1)
            runner.release(1)
            await runner.wait_arrived(2)
            handles.append(engine.submit(third))  # joins at the next boundary
            runner.open_gate()
            outputs = []
            for handle in handles:
                async with handle:
                    outputs.append(await handle.result())
            stats = engine.statistics()
    assert (stats.steps_run, stats.batch_steps) == (4 + 3 + 2, 4)  # every step shared
    for r, output in zip([first, second, third], outputs, strict=True):
        torch.testing.assert_close(output_of(r, output), reference(kind, r), atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    ("kind", "park_on_host"), [*((kind, True) for kind in KINDS), ("sd", False)]
)
async def test_a_suspended_request_resumes_to_its_uninterrupted_output(
    kind: str, park_on_host: bool
) -> None:
    """L61, L70: suspended after its first step for a request of a higher priority and
    resumed, a request's output is bitwise the one it makes uninterrupted (same batch
    composition: alone), and the parked state counts its latents' bytes at least. (On
    the CPU, parking on the host moves nothing: the CUDA test in test_diffusers_runner.py
    moves it.) LTX-Video draws its decode noise from the request's generator after the
    last step, so the generator's state survives too.
    """
    low = of(kind, num_steps=4, seed=11, prompt="low", negative_prompt="dull")
    high = of(kind, num_steps=2, seed=12, prompt="high", priority=1)
    resumed, uninterrupted, parked = await resumed_and_uninterrupted(
        tiny(kind), low, high, park_on_host=park_on_host
    )
    _, latents = prepared(kind, low)
    assert parked >= latents
    assert torch.equal(output_of(low, resumed), output_of(low, uninterrupted))


@pytest.mark.parametrize("kind", KINDS)
async def test_a_step_left_at_a_cancel_point_leaves_the_model_as_fresh(kind: str) -> None:
    """L71: a request aborted inside the first block of its second step: the step is left
    before the next block (which ran in step 1 only), one step counted, nothing decoded,
    no check armed, no state held; the next request's output is bitwise a fresh engine's.
    A denoiser of one block (tiny LTX-Video's) has no cancel point after it inside the
    step: the step ends, and the request is dropped undecoded at its boundary.
    """
    pipeline = tiny(kind)
    vae = getattr(pipeline, "vae", None)
    decoder = getattr(vae, "decoder", None)
    blocks = [module for module in cancel_modules(pipeline) if module is not decoder]
    first = of(kind, num_steps=3, negative_prompt="dull")
    after = of(kind, seed=3, prompt="after", num_steps=2)
    (step_1, *_), _ = prepared(kind, first)
    after_calls = sum(prepared(kind, after)[0])
    next_block = ModuleGate(blocks[1], at=0) if len(blocks) > 1 else None
    try:
        with anyio.fail_after(BUDGET):
            gate, runner, handle, output, fresh = await abort_inside(
                lambda _: blocks[0], step_1 + 1, pipe=pipeline, first=first, after=after
            )
    finally:
        if next_block is not None:
            next_block.remove()
    assert gate.calls == step_1 + 1  # block 0: the model calls of step 1, one of step 2
    assert handle.metrics is not None
    if next_block is None:
        assert handle.metrics.steps_done == 2
    else:
        assert handle.metrics.steps_done == 1
        # Step 1 of the aborted request (not its step 2), then the next and the fresh one.
        assert next_block.finished == step_1 + 2 * after_calls
    assert runner.decodes == 1  # the next request's only
    assert torch.equal(output_of(after, output), output_of(after, fresh))


@pytest.mark.parametrize("kind", KINDS)
async def test_previews_are_small_rgb_images_only_for_a_reader(kind: str) -> None:
    """L18: previews every second step, small RGB images of the latents (a video's first
    latent frame; the unconditional UNet's, in pixel space, its image) in [0, 1] on the
    CPU, following the latents; none for a request that asks for none.
    """
    runner = GatedDiffusers(tiny(kind))
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner) as engine:
            async with engine.submit(of(kind, preview_every=2, num_steps=4)) as handle:
                events = await read_gated(handle, runner)
                await handle.result()
            async with engine.submit(of(kind, preview_every=0, num_steps=2)) as handle:
                assert [event.preview async for event in handle] == [None] * 2
                await handle.result()
    assert [event.step for event in events if event.preview is not None] == [2, 4]
    previews = [event.preview for event in events if event.preview is not None]
    grid = SIZE[kind] if kind == "unet" else SIZE[kind] // 8
    for preview in previews:
        assert preview.shape == (1, 3, grid, grid)
        assert preview.device.type == "cpu"
        assert float(preview.min()) >= 0.0 and float(preview.max()) <= 1.0
    assert not torch.equal(previews[0], previews[1])


@pytest.mark.parametrize("kind", KINDS)
def test_runner_for_drives_the_pipeline_step_by_step(kind: str) -> None:
    """runner_for picks DiffusersRunner for the tiny pipeline, whose family is the kind."""
    runner = runner_for(tiny(kind))
    try:
        assert isinstance(runner, DiffusersRunner)
        assert runner.family == kind
    finally:
        runner.close()
