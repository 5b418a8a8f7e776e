"""``abort``: time from ``await engine.abort()`` to the worker's release, running and waiting."""

from __future__ import annotations

import random
import time
from typing import Any

import anyio

from .._config import EngineConfig, GenerationRequest
from .._engine import open_engine
from ..testing import FakeRunner
from ._common import percentile, spread

__all__ = ["run_abort"]


async def _measure(aborts: int, step_seconds: float, seed: int) -> dict[str, list[float]]:
    rng = random.Random(seed)
    running_ms: list[float] = []
    running_steps: list[float] = []
    release_ms: list[float] = []
    waiting_ms: list[float] = []
    config = EngineConfig(max_batch_size=1)
    async with open_engine(FakeRunner(step_seconds=step_seconds), config) as engine:
        for i in range(aborts):
            request = GenerationRequest(num_steps=1000, height=16, width=16, seed=i)
            async with engine.submit(request, request_id="running") as handle:
                abort_after = rng.randint(1, 5)
                async for event in handle:
                    if event.step >= abort_after:
                        break
                # A second request waits behind the running one.
                async with engine.submit(request, request_id="waiting"):
                    started = time.perf_counter()
                    await engine.abort("waiting")
                    waiting_ms.append((time.perf_counter() - started) * 1e3)
                started = time.perf_counter()
                await engine.abort("running")
                elapsed = time.perf_counter() - started
                running_ms.append(elapsed * 1e3)
                running_steps.append(elapsed / step_seconds)
                assert handle.metrics is not None and handle.metrics.abort_latency_s is not None
                release_ms.append(handle.metrics.abort_latency_s * 1e3)
    return {
        "running_ms": running_ms,
        "running_steps": running_steps,
        "release_ms": release_ms,
        "waiting_ms": waiting_ms,
    }


def run_abort(*, aborts: int, step_seconds: float, seed: int = 0) -> dict[str, Any]:
    """Abort ``aborts`` running requests at random early steps, and as many waiting ones."""
    data = anyio.run(_measure, aborts, step_seconds, seed)
    running_ms = data["running_ms"]
    return {
        "config": {"aborts": aborts, "step_seconds": step_seconds, "backend": "trio"},
        "running_ms": {**spread(running_ms), "p99": percentile(running_ms, 99)},
        "running_release_ms": {
            **spread(data["release_ms"]),
            "p99": percentile(data["release_ms"], 99),
        },
        "waiting_ms": {**spread(data["waiting_ms"]), "p99": percentile(data["waiting_ms"], 99)},
        "summary": {
            "running_p50_ms": spread(running_ms)["median"],
            "running_p99_ms": percentile(running_ms, 99),
            "running_p99_steps": percentile(data["running_steps"], 99),
            "waiting_p99_ms": percentile(data["waiting_ms"], 99),
        },
    }
