"""PipelineCallRunner: any pipeline through its own __call__, stopped at a step.

Determinism: tiny seeded pipelines, one torch thread; a gated subclass holds the
pipeline inside its step callback so an abort lands at a known step.
"""

from __future__ import annotations

import gc
import threading
from typing import Any

import anyio
import diffusers
import pytest
import torch

import omni_trio as ot
from omni_trio.runners import (
    DiffusersRunner,
    PipelineCallRunner,
    StepCallback,
    runner_for,
    tiny_pipeline,
)
from omni_trio.runners._call import CallState
from tests.support.core import BUDGET

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("one_torch_thread")]


class CustomPipeline(diffusers.StableDiffusionPipeline):
    """A pipeline DiffusersRunner does not know (a subclass may change the loop)."""


def custom_pipeline() -> tuple[Any, list[int]]:
    """A custom pipeline and a list that counts its VAE decodes."""
    pipeline_class: Any = CustomPipeline
    pipe: Any = pipeline_class(**tiny_pipeline("sd").components)
    pipe.set_progress_bar_config(disable=True)
    decodes: list[int] = []
    original = pipe.vae.decode

    def counting_decode(*args: Any, **kwargs: Any) -> Any:
        decodes.append(1)
        return original(*args, **kwargs)

    pipe.vae.decode = counting_decode
    return pipe, decodes


REQUEST = ot.GenerationRequest(
    prompt="a boat", num_steps=4, height=64, width=64, guidance_scale=5.0, seed=5
)


def reference(pipe: Any) -> torch.Tensor:
    images: torch.Tensor = pipe(
        REQUEST.prompt,
        num_inference_steps=REQUEST.num_steps,
        height=REQUEST.height,
        width=REQUEST.width,
        guidance_scale=REQUEST.guidance_scale,
        generator=torch.Generator().manual_seed(5),
        output_type="pt",
    ).images
    return images


async def test_fallback_runs_any_pipeline() -> None:
    """An unknown pipeline runs through its own call; the image equals a direct call."""
    pipe, _ = custom_pipeline()
    runner = runner_for(pipe)
    assert isinstance(runner, PipelineCallRunner)
    assert isinstance(runner_for(tiny_pipeline("sd")), DiffusersRunner)
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner) as engine:
            async with engine.submit(REQUEST) as handle:
                steps = [event.step async for event in handle]
                output = await handle.result()
    assert steps == [1, 2, 3, 4]
    torch.testing.assert_close(output.images, reference(pipe), atol=1e-4, rtol=0)
    assert runner.live_states == 0


def test_a_second_runner_over_one_pipeline_is_refused_while_the_first_lives() -> None:
    """L42: two workers over one pipeline would run its loop at once: a second
    ``PipelineCallRunner`` over it is refused by name; once the first is closed, or
    gone, another may call it."""
    pipe, _ = custom_pipeline()
    first = PipelineCallRunner(pipe)
    refusal = r"^PipelineCallRunner: another live runner calls this pipeline \(L42\)"
    with pytest.raises(ValueError, match=refusal):
        PipelineCallRunner(pipe)
    with pytest.raises(ValueError, match=refusal):
        runner_for(pipe)
    PipelineCallRunner(custom_pipeline()[0])  # another pipeline is free
    first.close()
    second = PipelineCallRunner(pipe)
    with pytest.raises(ValueError, match=refusal):
        PipelineCallRunner(pipe)
    del second
    gc.collect()
    PipelineCallRunner(pipe)


class GatedCall(PipelineCallRunner):
    """Holds the pipeline inside its step callback until released."""

    def __init__(self, pipeline: Any) -> None:
        super().__init__(pipeline)
        self._gate = threading.Semaphore(0)
        self.arrived = 0

    def release(self, n: int = 1) -> None:
        for _ in range(n):
            self._gate.release()

    def run(self, state: CallState, on_step: StepCallback) -> None:
        def gated(total: int | None = None) -> None:
            self.arrived += 1
            if not self._gate.acquire(timeout=20):
                raise RuntimeError("never released")
            on_step(total)

        super().run(state, gated)


async def test_abort_stops_the_call_before_decode() -> None:
    """L7, L10: an abort lands at the next step callback; the pipeline never decodes."""
    pipe, decodes = custom_pipeline()
    runner = GatedCall(pipe)
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner) as engine:
            async with engine.submit(REQUEST, request_id="r") as handle:
                runner.release(1)
                while runner.arrived < 2:
                    await anyio.sleep(0.001)
                engine.abort_nowait("r")
                runner.release(10)
                with pytest.raises(ot.RequestAbortedError):
                    await handle.result()
                assert handle.metrics is not None
                assert handle.metrics.steps_done == 2
    assert decodes == []
    assert runner.completed_calls == 0
    assert runner.live_states == 0
    # The pipeline stays usable and gives the same image as a fresh one.
    torch.testing.assert_close(reference(pipe), reference(custom_pipeline()[0]), atol=0, rtol=0)


async def test_extra_passes_call_arguments_and_refuses_unknown_ones() -> None:
    """L4: extra keys are the pipeline's own __call__ parameters; others are refused."""
    pipe, _ = custom_pipeline()
    async with ot.open_engine(PipelineCallRunner(pipe)) as engine:
        output = await engine.generate(
            ot.GenerationRequest(
                prompt="x", num_steps=2, height=64, width=64, seed=1, extra={"eta": 0.0}
            )
        )
        assert output.images.shape == (1, 3, 64, 64)
        with pytest.raises(ot.InvalidRequestError) as info:
            engine.submit(ot.GenerationRequest(height=64, width=64, extra={"nope": 1}))
        assert info.value.field == "extra"


@pytest.mark.parametrize("settings", [None, {"desc": "mine", "leave": False}])
async def test_the_pipeline_bar_is_off_per_call_and_restored(
    settings: dict[str, Any] | None, capfd: pytest.CaptureFixture[str]
) -> None:
    """Each call runs with the pipeline's bar disabled; the caller's settings come back."""
    pipe, _ = custom_pipeline()
    del pipe._progress_bar_config  # as if never configured (custom_pipeline disabled it)
    if settings is not None:
        pipe.set_progress_bar_config(**settings)
    bar_settings: list[dict[str, Any]] = []
    bar = pipe.progress_bar

    def recording_bar(*args: Any, **kwargs: Any) -> Any:
        """The settings the pipeline's loop starts its bar with."""
        bar_settings.append(dict(pipe._progress_bar_config))
        return bar(*args, **kwargs)

    pipe.progress_bar = recording_bar
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(PipelineCallRunner(pipe)) as engine:
            await engine.generate(REQUEST)
    assert bar_settings == [{**(settings or {}), "disable": True}]
    if settings is None:
        assert not hasattr(pipe, "_progress_bar_config")
    else:
        assert pipe._progress_bar_config == settings
    assert "it/s" not in capfd.readouterr().err


class RecordingCall(PipelineCallRunner):
    """Keeps every state it prepares."""

    def __init__(self, pipeline: Any) -> None:
        super().__init__(pipeline)
        self.states: list[CallState] = []

    def prepare(self, request: ot.GenerationRequest, request_id: str) -> CallState:
        state = super().prepare(request, request_id)
        self.states.append(state)
        return state


@pytest.mark.parametrize(("strength", "real"), [(1.0, 4), (0.5, 2), (0.3, 1)])
async def test_strength_below_one_counts_the_steps_the_pipeline_runs(
    strength: float, real: int
) -> None:
    """img2img with strength s runs int(num_steps * s) steps: steps_done and total say so."""
    components = tiny_pipeline("sd").components
    img2img: Any = diffusers.StableDiffusionImg2ImgPipeline
    pipe: Any = img2img(**components, requires_safety_checker=False)
    runner = RecordingCall(pipe)
    image = torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    request = ot.GenerationRequest(
        prompt="a boat",
        num_steps=4,
        height=64,
        width=64,
        seed=5,
        extra={"image": image, "strength": strength},
    )
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner) as engine:
            async with engine.submit(request) as handle:
                events = [(event.step, event.total) async for event in handle]
                output = await handle.result()
    assert events == [(step, real) for step in range(1, real + 1)]
    assert output.metrics.steps_done == real
    assert [state.total_steps for state in runner.states] == [real]
