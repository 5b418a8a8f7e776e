"""Helpers shared by the runner tests (tests/runners/): tiny pipelines, gated real runners,
and the drivers that suspend a request or abort one inside a module's call.

Determinism: the tiny pipelines have seeded weights and are built once per process
(``pipe``); a gated runner or a module gate holds the worker at a known place, so
where a suspension or an abort lands needs no timing.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import Any
from unittest import mock

import anyio
import torch

import omni_trio as ot
from omni_trio._cancelpoint import active_checks
from omni_trio.runners import TINY_KINDS, TINY_VIDEO_KINDS, DiffusersRunner, tiny_pipeline
from omni_trio.runners._compile import use_compile_cache
from omni_trio.runners._family import RequestState
from omni_trio.testing import probe, probe_engine, wait_until
from tests.support.core import BUDGET

#: Every tiny kind ``DiffusersRunner`` drives: the images', then the videos'.
KINDS: tuple[str, ...] = (*TINY_KINDS, *TINY_VIDEO_KINDS)

#: Each kind's test size (the unconditional UNet's is its only one). A video's frame
#: count: 9 keeps both frame rules (Wan 4k + 1, LTX-Video 8k + 1).
SIZE = {"sd": 64, "sdxl": 64, "sd3": 64, "flux": 64, "qwen-image": 64, "unet": 32}
SIZE |= dict.fromkeys(TINY_VIDEO_KINDS, 32)
FRAMES = 9


@cache
def tiny(kind: str) -> Any:
    """The tiny pipeline of ``kind``, built once per process."""
    return tiny_pipeline(kind)


@cache
def two_experts() -> Any:
    """Tiny Wan 2.2: ``transformer`` above the boundary timestep, ``transformer_2`` below."""
    import importlib

    # Untyped: diffusers' constructors carry no annotations.
    diffusers: Any = importlib.import_module("diffusers")
    base = tiny("wan")
    torch.manual_seed(1)
    second = diffusers.WanTransformer3DModel(**base.transformer.config).eval()
    return diffusers.WanPipeline(**{**base.components, "transformer_2": second}, boundary_ratio=0.5)


def request(kind: str, **fields: Any) -> ot.GenerationRequest:
    """A small guided request for ``kind``; ``fields`` override the defaults.

    A video request has ``FRAMES`` frames, 3 steps and the negative prompt ``"dull"``.
    """
    values: dict[str, Any] = {
        "prompt": "a red flower",
        "num_steps": 4,
        "height": SIZE[kind],
        "width": SIZE[kind],
        "guidance_scale": 5.0,
        "seed": 7,
    }
    if kind in TINY_VIDEO_KINDS:
        values |= {"negative_prompt": "dull", "num_steps": 3, "num_frames": FRAMES}
    values.update(fields)
    return ot.GenerationRequest(**values)


_references: dict[tuple[str, str], torch.Tensor] = {}


def reference(kind: str, r: ot.GenerationRequest, pipeline: Any = None) -> torch.Tensor:
    """The pipeline's own ``__call__`` output for ``r``, mapped as the family maps it.

    Images ``[N, C, H, W]``, or a video's frames ``[N, F, C, H, W]``. Qwen-Image takes
    ``guidance_scale`` as ``true_cfg_scale``; ``extra`` goes to the call as it is.
    The tiny pipeline's output is computed once per request (a seed gives one output;
    a test run on both backends asks twice); ``pipeline`` given, its own call runs
    every time (a test of what the call gives now passes the tiny one itself).
    """
    assert r.image is None, "an edit's reference is its edit pipeline's (test_edits.py)"
    if pipeline is not None:
        return _called(kind, r, pipeline)
    key = (kind, repr(r))
    if key not in _references:
        _references[key] = _called(kind, r, tiny(kind))
    return _references[key]


def _called(kind: str, r: ot.GenerationRequest, call: Any) -> torch.Tensor:
    generator = torch.Generator().manual_seed(r.seed or 0)
    if kind == "unet":
        out = call(
            batch_size=r.num_images,
            num_inference_steps=r.num_steps,
            generator=generator,
            output_type="pt",
        )
        images: Any = out.images
        if isinstance(images, torch.Tensor):
            return images
        # Before diffusers 0.41 DDIMPipeline gives NHWC arrays whatever output_type says.
        return torch.from_numpy(images).permute(0, 3, 1, 2)
    scale = "true_cfg_scale" if kind == "qwen-image" else "guidance_scale"
    options: dict[str, Any] = {scale: r.guidance_scale}
    if r.num_frames is None:
        options["num_images_per_prompt"] = r.num_images
    else:
        options |= {"num_frames": r.num_frames, "num_videos_per_prompt": r.num_images}
    out = call(
        r.prompt,
        negative_prompt=r.negative_prompt,
        num_inference_steps=r.num_steps,
        height=r.height,
        width=r.width,
        generator=generator,
        output_type="pt",
        **options,
        **r.extra,
    )
    result: torch.Tensor = out.images if r.num_frames is None else out.frames
    return result


class GatedDiffusers(DiffusersRunner):
    """A DiffusersRunner whose steps wait for ``release``."""

    def __init__(self, pipeline: Any) -> None:
        super().__init__(pipeline)
        self._gate = threading.Condition()
        self._permits = 0
        self.arrived = 0

    def release(self, n: int = 1) -> None:
        with self._gate:
            self._permits += n
            self._gate.notify_all()

    def open_gate(self) -> None:
        self.release(10**6)

    def step(self, states: Sequence[RequestState]) -> None:
        with self._gate:
            self.arrived += 1
            if not self._gate.wait_for(lambda: self._permits > 0, timeout=20):
                raise RuntimeError("step never released")
            self._permits -= 1
        super().step(states)

    async def wait_arrived(self, n: int) -> None:
        await wait_until(lambda: self.arrived >= n)


async def resumed_and_uninterrupted(
    pipeline: Any,
    low_request: ot.GenerationRequest,
    high_request: ot.GenerationRequest,
    *,
    park_on_host: bool,
) -> tuple[ot.GenerationOutput, ot.GenerationOutput, int]:
    """``low_request`` suspended after its first step for ``high_request`` (of a higher
    priority) and resumed, the same request uninterrupted, and the bytes its suspension
    parked. Batches of one: the same composition both ways.
    """
    options = ot.EngineConfig(max_batch_size=1, park_on_host=park_on_host)
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(DiffusersRunner(pipeline), options) as engine:
            uninterrupted = await engine.generate(low_request)
        runner = GatedDiffusers(pipeline)
        async with ot.open_engine(runner, options) as engine:
            low = engine.submit(low_request, request_id="low")
            await runner.wait_arrived(1)
            high = engine.submit(high_request, request_id="high")
            runner.release(1)
            await runner.wait_arrived(2)
            stats = engine.statistics()
            assert (stats.suspended, stats.preemptions) == (1, 1)
            assert low.status is ot.RequestStatus.WAITING
            parked = probe_engine(engine).workers[0].parked_bytes
            runner.open_gate()
            async with high:
                await high.result()
            async with low:
                resumed = await low.result()
    assert resumed.metrics.preemptions == 1
    assert runner.live_states == 0
    return resumed, uninterrupted, parked


class ModuleGate:
    """A forward pre-hook on ``module`` that holds its ``at``-th call until ``release()``.

    It runs after the runner's own cancel-point hook (hooks run in the order they were
    registered), so the held call is inside the block: the cancel point before it
    passed. ``calls`` counts the calls that began, ``finished`` those that ran to the end.
    """

    def __init__(self, module: torch.nn.Module, at: int) -> None:
        self.at = at
        self.calls = 0
        self.finished = 0
        self.arrived = threading.Event()
        self._go = threading.Event()
        self._handles = [
            module.register_forward_pre_hook(self._hook),
            module.register_forward_hook(self._done),
        ]

    def _done(self, module: torch.nn.Module, args: object, output: object) -> None:
        self.finished += 1

    def _hook(self, module: torch.nn.Module, args: object) -> None:
        self.calls += 1
        if self.calls == self.at:
            self.arrived.set()
            if not self._go.wait(20):
                raise RuntimeError("ModuleGate: never released")

    def release(self) -> None:
        self._go.set()

    def remove(self) -> None:
        self._go.set()
        for handle in self._handles:
            handle.remove()

    async def wait_arrived(self) -> None:
        await wait_until(self.arrived.is_set)


def _vae_cache_clear(pipe: Any) -> bool:
    # None before its first decode; every entry None once a decode ended or was left.
    vae = getattr(pipe, "vae", None)  # the unconditional UNet's pipeline has none
    return all(feature is None for feature in getattr(vae, "_feat_map", None) or ())


async def _fresh_output(pipe: Any, r: ot.GenerationRequest, **options: Any) -> ot.GenerationOutput:
    async with ot.open_engine(DiffusersRunner(pipe, **options)) as engine:
        return await engine.generate(r)


async def abort_inside(
    where: Callable[[Any], torch.nn.Module],
    at: int,
    *,
    pipe: Any = None,
    first: ot.GenerationRequest | None = None,
    after: ot.GenerationRequest | None = None,
    **options: Any,
) -> tuple[ModuleGate, DiffusersRunner, ot.RequestHandle, ot.GenerationOutput, ot.GenerationOutput]:
    """Abort ``first`` while ``where(pipe)``'s ``at``-th call runs; then serve ``after``.

    Defaults: tiny Wan, a 3-step video, then another. ``options`` go to the
    ``DiffusersRunner``. Returns the gate, the runner, the aborted handle, ``after``'s
    output and a fresh engine's output for ``after`` (same options).
    """
    pipe = tiny("wan") if pipe is None else pipe
    first = request("wan") if first is None else first
    after = request("wan", seed=3, prompt="after", num_steps=2) if after is None else after
    runner = DiffusersRunner(pipe, **options)
    gate = ModuleGate(where(pipe), at)
    try:
        async with ot.open_engine(runner) as engine:
            handle = engine.submit(first, request_id="r")
            await gate.wait_arrived()

            async def release_once_cut() -> None:
                await wait_until(lambda: probe(handle).cancel_reason is not None)
                gate.release()

            async with anyio.create_task_group() as tg:
                tg.start_soon(release_once_cut)
                assert await engine.abort("r") is True
            assert runner.live_states == 0 and active_checks() == 0
            assert _vae_cache_clear(pipe)
            calls = gate.calls
            await handle.aclose()
            output = await engine.generate(after)
            gate.calls = calls  # the counts of the aborted request only
    finally:
        gate.remove()
        runner.close()
    return gate, runner, handle, output, await _fresh_output(pipe, after, **options)


def assert_loaded_output_matches(loaded: torch.Tensor, original: torch.Tensor) -> None:
    """A pipeline loaded from its saved folder gives ``original``'s output, to float rounding.

    Not bitwise: safetensors maps the loaded weights at addresses that need not be 64-byte
    aligned, and the CPU's matrix kernels may round such operands differently (tiny
    LTX-Video's timestep embedding differs by 1.5e-7 in one linear layer, its weights
    equal); which layers do depends on the machine's vector unit.
    """
    torch.testing.assert_close(loaded, original, rtol=0, atol=1e-5)


#: The commit of ``hub_cache``'s snapshot.
REVISION = "0123456789abcdef0123456789abcdef01234567"


def hub_cache(home: Path, kind: str, repo: str) -> Path:
    """Fill ``home`` as the Hugging Face cache holding a tiny ``kind`` as ``repo``."""
    snapshot = home / "hub" / f"models--{repo.replace('/', '--')}" / "snapshots" / REVISION
    tiny_pipeline(kind, seed=0).save_pretrained(snapshot)
    refs = snapshot.parents[1] / "refs"
    refs.mkdir()
    (refs / "main").write_text(REVISION)
    return snapshot


async def generated_at_once(
    engine: ot.Engine, requests: Sequence[ot.GenerationRequest]
) -> list[ot.GenerationOutput]:
    """Submit every request at once (so they batch as the engine plans); their outputs in
    the requests' order."""
    outputs: list[ot.GenerationOutput | None] = [None] * len(requests)

    async def one(index: int) -> None:
        outputs[index] = await engine.generate(requests[index])

    async with anyio.create_task_group() as tasks:
        for index in range(len(requests)):
            tasks.start_soon(one, index)
    return [output for output in outputs if output is not None]


async def images_together(
    runner: Any, requests: Sequence[ot.GenerationRequest]
) -> list[torch.Tensor]:
    """``requests`` submitted at once to an engine of ``runner`` with batches of up to 3
    (it closes the runner at its exit); their images in order."""
    async with ot.open_engine(runner, ot.EngineConfig(max_batch_size=3)) as engine:
        return [output.images for output in await generated_at_once(engine, requests)]


def dynamo_counts() -> tuple[int, int]:
    """Dynamo's graphs made and graph breaks so far in this process (its own counters)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"]), sum(counters["graph_break"].values())


@contextmanager
def compile_cache_in(folder: Path) -> Iterator[None]:
    """Inside, torch's compile caches are under ``folder`` (``use_compile_cache``); after,
    the environment is as it was."""
    with mock.patch.dict(os.environ):
        use_compile_cache(folder)
        yield
