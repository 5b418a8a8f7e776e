"""``overhead``: the engine's cost per step over the runner's bare loop (peer: raw)."""

from __future__ import annotations

import time
from typing import Any

import anyio

from .._config import EngineConfig, GenerationRequest
from .._engine import open_engine
from ..testing import FakeRunner
from ._common import spread

__all__ = ["run_overhead"]


def _raw(runner: FakeRunner, request: GenerationRequest) -> float:
    """The physical limit: prepare, step, decode, called directly in one thread."""
    started = time.perf_counter()
    state = runner.prepare(request, "raw")
    for _ in range(request.num_steps):
        runner.step([state])
    runner.decode(state).float().cpu()
    runner.discard(state)
    return time.perf_counter() - started


async def _engine(runner: FakeRunner, request: GenerationRequest, requests: int) -> float:
    config = EngineConfig(max_steps=request.num_steps)
    async with open_engine(runner, config) as engine:
        await engine.generate(request)  # warm-up: thread start, first allocations
        started = time.perf_counter()
        for _ in range(requests):
            await engine.generate(request)
        return time.perf_counter() - started


def run_overhead(*, steps: int, requests: int, repeats: int, step_seconds: float) -> dict[str, Any]:
    """Time ``requests`` sequential requests of ``steps`` steps, engine vs raw, interleaved."""
    request = GenerationRequest(prompt="overhead", num_steps=steps, height=16, width=16, seed=0)
    runner = FakeRunner(step_seconds=step_seconds)
    _raw(runner, request)  # warm-up
    raw_s: list[float] = []
    engine_s: list[float] = []
    for _ in range(repeats):
        raw_s.append(sum(_raw(runner, request) for _ in range(requests)))
        engine_s.append(
            anyio.run(_engine, FakeRunner(step_seconds=step_seconds), request, requests)
        )
    total_steps = steps * requests
    per_step_us = [(e - r) / total_steps * 1e6 for e, r in zip(engine_s, raw_s, strict=True)]
    ratios = [e / r for e, r in zip(engine_s, raw_s, strict=True)]
    return {
        "config": {
            "steps_per_request": steps,
            "requests": requests,
            "repeats": repeats,
            "step_seconds": step_seconds,
            "backend": "trio",
        },
        "raw_s": spread(raw_s),
        "engine_s": spread(engine_s),
        "summary": {
            "ratio_engine_over_raw": spread(ratios)["median"],
            "per_step_overhead_us": spread(per_step_us)["median"],
            "per_step_overhead_us_spread": spread(per_step_us),
        },
    }
