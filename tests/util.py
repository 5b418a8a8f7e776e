"""Helpers shared by the tests."""

from __future__ import annotations

from typing import Any, Protocol

import anyio
import torch

import omni_trio as ot
from omni_trio.testing import FakeRunner, wait_until

#: Seconds any single test may take before it is failed as hung.
BUDGET = 30.0


def req(**fields: Any) -> ot.GenerationRequest:
    """A small valid request; ``fields`` override the defaults."""
    defaults: dict[str, Any] = {
        "prompt": "a flower",
        "num_steps": 3,
        "height": 16,
        "width": 16,
        "seed": 1,
    }
    defaults.update(fields)
    return ot.GenerationRequest(**defaults)


def solo_images(request: ot.GenerationRequest) -> torch.Tensor:
    """The images a fresh FakeRunner makes for ``request`` alone, with no engine."""
    runner = FakeRunner()
    state = runner.prepare(request, "solo")
    for _ in range(request.num_steps):
        runner.step([state])
    return runner.decode(state).float()


def stats_add_up(engine: ot.Engine) -> bool:
    """Whether every admitted request is counted in exactly one status (L19)."""
    s = engine.statistics()
    return s.admitted == s.waiting + s.running + s.completed + s.aborted + s.failed


class Gate(Protocol):
    """A runner whose steps wait for the test (GatedRunner, or a gated real runner)."""

    def release(self, n: int = 1) -> None: ...

    def open_gate(self) -> None: ...


async def read_gated(
    handle: ot.RequestHandle, runner: Gate, *, count: int | None = None
) -> list[ot.StepEvent]:
    """Start reading ``handle``'s events, and only then let gated steps run.

    Reads ``count`` events after releasing ``count`` steps, or every event after
    opening the gate. A consumer that reads from the first step on is the premise
    of previews (L18); releasing first would race the worker against the reader.
    """
    events: list[ot.StepEvent] = []

    async def reader() -> None:
        async for event in handle:
            events.append(event)
            if len(events) == count:
                break

    async with anyio.create_task_group() as tg:
        tg.start_soon(reader)
        await wait_until(lambda: handle._record.reading)
        if count is None:
            runner.open_gate()
        else:
            runner.release(count)
    return events
