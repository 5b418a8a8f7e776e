"""Helpers shared by the runner tests (tests/runners/): tiny pipelines, gated real runners,
and the drivers that suspend a request or abort one inside a module's call.

Determinism: the tiny pipelines have seeded weights and are built once per process
(``pipe``); a gated runner or a module gate holds the worker at a known place, so
where a suspension or an abort lands needs no timing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from functools import cache
from typing import Any

import anyio
import torch

import omni_trio as ot
from omni_trio._cancelpoint import active_checks
from omni_trio.runners import DiffusersRunner, tiny_pipeline
from omni_trio.runners._family import RequestState
from omni_trio.testing import probe, wait_until
from tests.util import BUDGET

#: A video request's size and frame count: 32 x 32 px, 9 frames (it keeps both frame
#: rules: Wan 4k + 1, LTX-Video 8k + 1).
VIDEO_SIZE = 32
FRAMES = 9


@cache
def tiny(kind: str) -> Any:
    """The tiny pipeline of ``kind``, built once."""
    return tiny_pipeline(kind)


def video_request(**fields: Any) -> ot.GenerationRequest:
    """A small guided video request; ``fields`` override the defaults."""
    values: dict[str, Any] = {
        "prompt": "a red flower",
        "negative_prompt": "dull",
        "num_steps": 3,
        "height": VIDEO_SIZE,
        "width": VIDEO_SIZE,
        "num_frames": FRAMES,
        "guidance_scale": 5.0,
        "seed": 7,
    }
    values.update(fields)
    return ot.GenerationRequest(**values)


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
            parked = engine._workers[0].parked_bytes
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
    return all(feature is None for feature in getattr(pipe.vae, "_feat_map", None) or ())


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
    first = video_request(num_steps=3) if first is None else first
    after = video_request(seed=3, prompt="after", num_steps=2) if after is None else after
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
