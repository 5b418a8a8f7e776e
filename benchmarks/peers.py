"""The peers the engine is measured against, on one pipeline with one request.

- **raw**: the runner's own loop (``prepare``, ``step`` x n, ``decode``,
  ``discard``) called directly in the caller's thread, no engine: the physical
  limit.
- **naive**: the pipeline's whole ``__call__`` in a worker thread behind a lock,
  the common serving pattern. Its "abort" cancels the awaiting task
  (``to_thread.run_sync(abandon_on_cancel=True)``): the caller returns at once, the
  thread runs on to the end and holds the lock, so the next request waits for it.
- **interrupt**: the same, and the call's ``callback_on_step_end`` sets the
  pipeline's ``_interrupt`` flag once the request is aborted (diffusers' own
  mechanism): the loop spins on without model calls and still decodes.

Thread hygiene: the worker threads return ``None`` and keep the images on the
``Call`` object, so no tensor is returned from a thread-cache worker (which would
keep it referenced after the call); ``LockedPipeline.wait_idle`` makes sure no orphan thread
outlives a measurement.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
import torch

from omni_trio import GenerationRequest
from omni_trio.runners import DiffusersRunner

__all__ = [
    "Call",
    "LockedPipeline",
    "RawRun",
    "TimedRunner",
    "median_step_s",
    "run_raw",
    "sd_request",
    "start_call",
    "step_in_progress",
]

#: How often a waiting task looks at a thread's progress. Picked without
#: measurement; it only delays the observer, never the timestamps (taken in the thread).
POLL_S = 0.0005


def sd_request(steps: int, size: int, seed: int = 0, **fields: Any) -> GenerationRequest:
    """The benchmark's request: one prompt, a square size, a seed."""
    return GenerationRequest(
        prompt="a lighthouse", num_steps=steps, height=size, width=size, seed=seed, **fields
    )


def call_kwargs(request: GenerationRequest) -> dict[str, Any]:
    """The pipeline ``__call__`` arguments equivalent to ``request``."""
    return {
        "prompt": request.prompt,
        "num_inference_steps": request.num_steps,
        "height": request.height,
        "width": request.width,
        "guidance_scale": request.guidance_scale,
        "num_images_per_prompt": request.num_images,
        "generator": torch.Generator().manual_seed(request.seed or 0),
        "output_type": "pt",
    }


@dataclass(slots=True)
class RawRun:
    """Timings of one request through the runner's bare loop, in seconds."""

    prepare_s: float
    step_s: list[float]
    decode_s: float
    total_s: float


def run_raw(runner: DiffusersRunner, request: GenerationRequest) -> RawRun:
    """Run ``request`` through the runner's loop in this thread: the physical limit."""
    started = time.perf_counter()
    state = runner.prepare(request, "raw")
    prepared = time.perf_counter()
    steps: list[float] = []
    for _ in range(request.num_steps):
        begun = time.perf_counter()
        runner.step([state])
        steps.append(time.perf_counter() - begun)
    begun = time.perf_counter()
    runner.decode(state).detach().float().cpu()
    decoded = time.perf_counter()
    runner.discard(state)
    return RawRun(prepared - started, steps, decoded - begun, time.perf_counter() - started)


class TimedRunner(DiffusersRunner):
    """A ``DiffusersRunner`` that notes when each step call starts and ends."""

    def __init__(self, pipeline: Any, *, max_batch_size: int = 8) -> None:
        super().__init__(pipeline, max_batch_size=max_batch_size)
        self.steps: list[tuple[float, float]] = []

    def step(self, states: Sequence[Any]) -> None:
        """Step as ``DiffusersRunner`` does, noting the start and end times."""
        started = time.perf_counter()
        super().step(states)
        self.steps.append((started, time.perf_counter()))


def step_in_progress(steps: list[tuple[float, float]], at: float) -> tuple[float, float]:
    """The step the worker had to finish after ``at``: its duration, and when it ended."""
    for started, ended in reversed(steps):
        if started <= at:
            return (ended - started, ended) if ended > at else (0.0, at)
    return 0.0, at


def median_step_s(runner: DiffusersRunner, request: GenerationRequest) -> float:
    """The median step time of ``request`` on ``runner`` alone (after one warm-up run)."""
    run_raw(runner, request)
    steps = run_raw(runner, request).step_s
    return statistics.median(steps)


@dataclass(eq=False)
class Call:
    """One request to a ``LockedPipeline``; the thread fills in the timestamps.

    Times are ``time.perf_counter()`` seconds: ``t_acquired`` when the thread got
    the lock, ``step_times`` at each step's callback, ``t_end`` when the thread let
    the lock go (the worker's release).
    """

    request: GenerationRequest
    observe: bool = True
    abort_requested: bool = False
    t_submitted: float = 0.0
    t_acquired: float | None = None
    step_times: list[float] = field(default_factory=list)
    t_end: float | None = None
    t_returned: float | None = None
    images: torch.Tensor | None = None
    ended: threading.Event = field(default_factory=threading.Event)
    # Whether the thread started (True) or the caller gave up before it did (False).
    claimed: bool | None = None


class LockedPipeline:
    """The ``naive`` peer, or with ``interrupt`` the ``diffusers-interrupt`` one.

    Args:
        pipeline: the diffusers pipeline; its calls are serialized by one lock.
        interrupt: set ``pipeline._interrupt`` from the step callback on abort.
    """

    def __init__(self, pipeline: Any, *, interrupt: bool) -> None:
        self._pipeline = pipeline
        self._interrupt = interrupt
        self._lock = threading.Lock()
        self._count_lock = threading.Lock()
        self._in_flight = 0

    @property
    def name(self) -> str:
        """``"interrupt"`` or ``"naive"``."""
        return "interrupt" if self._interrupt else "naive"

    def _callback(self, call: Call) -> Callable[..., dict[str, Any]]:
        interrupt = self._interrupt

        def on_step_end(pipe: Any, index: int, timestep: Any, tensors: dict[str, Any]) -> Any:
            call.step_times.append(time.perf_counter())
            if interrupt and call.abort_requested:
                pipe._interrupt = True
            return tensors

        return on_step_end

    def _claim(self, call: Call, *, by_thread: bool) -> bool:
        """Decide once whether the thread runs ``call``; count it off if it never will."""
        with self._count_lock:
            if call.claimed is not None:
                return False
            call.claimed = by_thread
            if not by_thread:
                self._in_flight -= 1
                call.t_end = time.perf_counter()
                call.ended.set()
            return True

    def _call(self, call: Call) -> None:
        if not self._claim(call, by_thread=True):
            return
        output: Any = None
        try:
            with self._lock:
                call.t_acquired = time.perf_counter()
                kwargs = call_kwargs(call.request)
                if call.observe or self._interrupt:
                    kwargs["callback_on_step_end"] = self._callback(call)
                with torch.no_grad():
                    output = self._pipeline(**kwargs)
                call.images = output.images
                call.t_end = time.perf_counter()
        finally:
            # No tensor stays in this frame, none is returned (see the module docstring).
            output = None
            if call.t_end is None:
                call.t_end = time.perf_counter()
            with self._count_lock:
                self._in_flight -= 1
            call.ended.set()

    async def run(self, call: Call) -> None:
        """Serve ``call``; cancelling the caller abandons the thread, which runs on.

        Cancellation:
            Returns at once; the thread finishes the call and then frees the lock.
        """
        with self._count_lock:
            self._in_flight += 1
        call.t_submitted = time.perf_counter()
        try:
            await anyio.to_thread.run_sync(self._call, call, abandon_on_cancel=True)
            call.t_returned = time.perf_counter()
        finally:
            # Cancelled before the thread started: it never will.
            self._claim(call, by_thread=False)

    def abort(self, call: Call, scope: anyio.CancelScope) -> None:
        """Abort ``call`` as this peer does: flag it (interrupt) and cancel its caller."""
        call.abort_requested = True
        scope.cancel()

    async def wait_idle(self) -> None:
        """Wait until no call's thread is running.

        Cancellation:
            Safe.
        """
        while self._in_flight:
            await anyio.sleep(POLL_S)

    @staticmethod
    async def wait_steps(call: Call, steps: int) -> None:
        """Wait until ``call`` finished ``steps`` steps (or ended).

        Cancellation:
            Safe.
        """
        while len(call.step_times) < steps and not call.ended.is_set():
            await anyio.sleep(POLL_S)

    @staticmethod
    async def wait_ended(call: Call) -> None:
        """Wait until ``call``'s thread let the lock go.

        Cancellation:
            Safe.
        """
        while not call.ended.is_set():
            await anyio.sleep(POLL_S)


def start_call(group: anyio.abc.TaskGroup, peer: LockedPipeline, call: Call) -> anyio.CancelScope:
    """Start ``call`` on ``peer`` in ``group``; return the scope that aborts its caller."""
    scope = anyio.CancelScope()

    async def caller() -> None:
        with scope:
            await peer.run(call)

    group.start_soon(caller)
    return scope
