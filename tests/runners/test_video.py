"""Video in DiffusersRunner (L70): what Wan and LTX-Video do beyond the image families.

Their request options against their own ``__call__``, the frame rule, the MP4 writer,
bad videos, Wan 2.2's two experts. What every family does (equal its ``__call__``,
join mid-flight, resume exactly, previews) is the conformance suite's
(test_conformance.py).

Determinism: tiny pipelines with seeded weights; torch uses one thread so batched
and solo runs add in a fixed order; a gated runner holds the worker inside a step.
Sizes: 32 x 32 px, 9 frames (it keeps both frame rules: Wan 4k + 1, LTX-Video 8k + 1),
1 to 4 steps.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

import omni_trio as ot
from omni_trio._request import MAX_NUM_FRAMES
from omni_trio.runners import DiffusersRunner, RunnerCapabilities
from omni_trio.runners._family import RequestState
from omni_trio.testing import FakeRunner
from tests.support.core import BUDGET
from tests.support.runners import (
    FRAMES,
    SIZE,
    GatedDiffusers,
    reference,
    request,
    tiny,
    two_experts,
)

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("one_torch_thread")]

# The suite's case (guided, a negative prompt) is not repeated here.
CASES = [
    ("wan", {"guidance_scale": 1.0, "negative_prompt": None, "num_images": 2}),
    ("ltx", {"extra": {"decode_timestep": 0.05, "decode_noise_scale": 0.025}}),
    ("ltx", {"guidance_scale": 1.0}),
]


@pytest.mark.parametrize(("kind", "fields"), CASES)
async def test_video_options_equal_the_pipeline_call(kind: str, fields: dict[str, Any]) -> None:
    """L70: unguided videos, two of one prompt, and LTX-Video's decode timestep and noise
    equal the pipeline's own __call__ frames for the seed (1e-5), a CPU float tensor
    [N, F, C, H, W]; images are the first frames.
    """
    r = request(kind, **fields)
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(DiffusersRunner(tiny(kind))) as engine:
            output = await engine.generate(r)
    assert output.video is not None
    assert output.video.shape == (r.num_images, FRAMES, 3, SIZE[kind], SIZE[kind])
    assert output.video.dtype == torch.float32 and output.video.device.type == "cpu"
    torch.testing.assert_close(output.video, reference(kind, r), atol=1e-5, rtol=0)
    assert torch.equal(output.images, output.video[:, 0])


async def test_two_ltx_videos_of_one_prompt_decode() -> None:
    """L70: LTX-Video with num_images 2 (where LTXPipeline's own call fails in its
    timestep-conditioned VAE: one decode timestep per prompt) decodes two videos, each its
    own, with one decode timestep per video.
    """
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(DiffusersRunner(tiny("ltx"))) as engine:
            output = await engine.generate(request("ltx", num_steps=2, num_images=2))
    assert output.video is not None
    assert output.video.shape == (2, FRAMES, 3, SIZE["ltx"], SIZE["ltx"])
    assert not torch.equal(output.video[0], output.video[1])


@pytest.mark.parametrize(("kind", "good", "bad"), [("wan", 5, 7), ("ltx", 17, 5)])
async def test_num_frames_is_validated_by_name(kind: str, good: int, bad: int) -> None:
    """L4, L70: num_frames off the runner's rule, missing for a video runner, or given to an
    image runner is refused at submit naming num_frames; a bad value at construction; it is
    part of a video runner's batch key.
    """
    for value in (0, True, 1.5, MAX_NUM_FRAMES + 1):
        with pytest.raises(ot.InvalidRequestError) as info:
            request(kind, num_frames=value)
        assert info.value.field == "num_frames"
    runner = DiffusersRunner(tiny(kind))
    capabilities = runner.capabilities
    assert capabilities.frames == ((4, 1) if kind == "wan" else (8, 1))
    assert capabilities.batch_key(request(kind)) != capabilities.batch_key(
        request(kind, num_frames=good)
    )
    async with ot.open_engine(runner) as engine:
        for fields in ({"num_frames": bad}, {"num_frames": None}):
            with pytest.raises(ot.InvalidRequestError) as info:
                engine.submit(request(kind, **fields))
            assert info.value.field == "num_frames"
    async with ot.open_engine(FakeRunner()) as engine:
        with pytest.raises(ot.InvalidRequestError) as info:
            engine.submit(request(kind, num_frames=good))
        assert info.value.field == "num_frames"
    with pytest.raises(ValueError, match="frames"):
        RunnerCapabilities(frames=(4, 4))
    # A video runner's key holds the frames even when its fields leave them out.
    plain = RunnerCapabilities(frames=(4, 1), batch_key_fields=("height",))
    assert plain.batch_key(request(kind, num_frames=5)) == (SIZE[kind], 5)


async def test_save_video_writes_an_mp4_that_reads_back(tmp_path: Path) -> None:
    """L70: save_video writes an H.264 MP4 that PyAV reads back with F frames of the size and
    the rate given; an image output, a bad fps or index and a missing PyAV are refused clearly.
    """
    import av

    with anyio.fail_after(BUDGET):
        async with ot.open_engine(DiffusersRunner(tiny("ltx"))) as engine:
            output = await engine.generate(request("ltx", num_steps=2, width=64))
        async with ot.open_engine(FakeRunner()) as engine:
            image = await engine.generate(request("ltx", num_steps=1, num_frames=None))
    assert image.video is None
    path = tmp_path / "clip.mp4"
    output.save_video(path, fps=8)
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(stream)]
        assert stream.average_rate == 8
    assert len(frames) == FRAMES
    assert all(frame.shape == (SIZE["ltx"], 64, 3) for frame in frames)
    with pytest.raises(ValueError, match="fps"):
        output.save_video(path, fps=0)
    with pytest.raises(ValueError, match="index"):
        output.save_video(path, index=1)
    with pytest.raises(ValueError, match="image"):
        image.save_video(path)
    saved = sys.modules.get("av")
    sys.modules["av"] = None  # type: ignore[assignment]  # what a missing package looks like
    try:
        with pytest.raises(ImportError, match="omni_trio\\[video\\]"):
            output.save_video(path)
    finally:
        sys.modules["av"] = saved  # type: ignore[assignment]


class BadVideo(DiffusersRunner):
    """Decodes a video that breaks the contract in one way."""

    def __init__(self, pipeline: Any, how: str) -> None:
        super().__init__(pipeline)
        self.how = how

    def decode(self, state: RequestState) -> torch.Tensor:
        video = super().decode(state)
        if self.how == "frames":
            return video[:, 1:]
        if self.how == "nan":
            video[0, 3, 0, 0, 0] = float("nan")
            return video
        return video[:, 0]  # an image, not a video


@pytest.mark.parametrize(
    ("how", "message"),
    [
        ("frames", "videos of shape (1, 8, 3, 32, 32), expected (1, 9, 3, 32, 32)"),
        ("nan", "videos with NaN values"),
        ("image", "videos of shape (1, 3, 32, 32), expected (1, 9, 3, 32, 32)"),
    ],
)
async def test_a_bad_video_fails_the_request_naming_the_violation(how: str, message: str) -> None:
    """L24, L70: a decoded video of the wrong frame count or shape, or with NaN in a frame
    past the first, fails the request (InvalidOutputError) and is never delivered.
    """
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(BadVideo(tiny("wan"), how)) as engine:
            with pytest.raises(ot.RequestFailedError) as info:
                await engine.generate(request("wan", num_steps=1), request_id="bad")
    assert isinstance(info.value.__cause__, ot.InvalidOutputError)
    assert str(info.value) == f"request 'bad' failed: the runner's decode returned {message}"


async def test_wan_two_experts_alone_and_with_rows_of_both_in_one_step() -> None:
    """L70: Wan 2.2's two experts: each row goes to the expert of its own timestep, so a
    request alone, and two requests whose rows need both experts in one step (one joined
    mid-way), each equal their own __call__ (1e-4); the boundary was crossed.
    """
    pipeline = two_experts()
    calls: list[tuple[str, int]] = []  # (expert, rows) of each model call

    def noted(name: str) -> Any:
        def hook(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
            calls.append((name, kwargs["hidden_states"].shape[0]))

        return hook

    hooks = [
        getattr(pipeline, name).register_forward_pre_hook(noted(name), with_kwargs=True)
        for name in ("transformer", "transformer_2")
    ]
    first = request("wan", num_steps=4, seed=1)
    second = request("wan", num_steps=4, seed=2, prompt="second", guidance_scale=1.0)
    try:
        runner = GatedDiffusers(pipeline)
        with anyio.fail_after(BUDGET):
            async with ot.open_engine(runner, ot.EngineConfig(max_batch_size=2)) as engine:
                handles = [engine.submit(first)]
                await runner.wait_arrived(1)
                runner.release(2)
                await runner.wait_arrived(3)
                handles.append(engine.submit(second))  # joins past the boundary of "first"
                runner.open_gate()
                outputs = []
                for handle in handles:
                    async with handle:
                        outputs.append(await handle.result())
    finally:
        for hook in hooks:
            hook.remove()
    # The step they share at the end of "first": "second"'s one row (no guidance) at
    # t = 1000 to the first expert, "first"'s two (guided) at t = 24 to the second.
    pair = [("transformer", 1), ("transformer_2", 2)]
    assert any(calls[i : i + 2] == pair for i in range(len(calls) - 1)), calls
    for r, output in zip([first, second], outputs, strict=True):
        assert output.video is not None
        torch.testing.assert_close(
            output.video, reference("wan", r, two_experts()), atol=1e-4, rtol=0
        )
