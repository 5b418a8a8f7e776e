"""Helpers the tests share: budgets, small requests, expected images, engine checks.

The core's (tests mirror omni_trio's modules); ``tests.support.cli``, ``.serve``,
``.runners`` and ``.devices`` hold those of the other areas.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Protocol

import anyio
import torch

import omni_trio as ot
from omni_trio.testing import (
    FakeRunner,
    FakeState,
    GatedRunner,
    RequestLedger,
    RunnerCounters,
    check_engine_invariants,
    probe,
    wait_until,
)

#: Seconds any single test may take before it is failed as hung.
BUDGET = 30.0


class WorkerKilled(BaseException):
    """Not an Exception: raised from the runner, it kills the worker thread (L23)."""


class RunnerBroke(Exception):
    """What a faulty runner raises: an ordinary error, confined to requests (L22)."""


class Boom(Exception):
    """What a consumer raises inside its handle's ``async with`` block."""


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


_expected: dict[tuple[object, ...], torch.Tensor] = {}


def expected_images(request: ot.GenerationRequest) -> torch.Tensor:
    """``solo_images(request)``, computed once per distinct request and kept."""
    key = (
        request.prompt,
        request.num_steps,
        request.height,
        request.width,
        request.seed,
        request.num_images,
    )
    if key not in _expected:
        _expected[key] = solo_images(request)
    return _expected[key]


@contextmanager
def together(engine: ot.Engine) -> Iterator[None]:
    """The requests submitted inside wait together when a worker next looks: its lock
    (the pool's) is held, so no worker takes one of them before the last is submitted.

    ``submit`` wakes an idle worker at once, from the event loop's thread; without this,
    a worker may take the first request alone before the next ones are submitted (the
    GIL may switch between two submits), and a test of one batch of several would see
    two batches now and then.
    """
    with engine._pool.cond:
        yield


def status(handle: ot.RequestHandle) -> ot.RequestStatus:
    """The status now (a call, so that type checkers do not narrow it across awaits)."""
    return handle.status


async def outcome_of(handle: ot.RequestHandle) -> ot.GenerationOutput | Exception:
    """What ``handle.result()`` returns, or the engine's error it raises.

    Cancellation:
        Propagates; ``result()`` aborts the request first (L11).
    """
    try:
        return await handle.result()
    except ot.OmniTrioError as exc:
        return exc


def check_all(engine: ot.Engine, runner: RunnerCounters, ledger: RequestLedger) -> None:
    """Invariants that hold after any fault: counts add up, the ledger agrees (L19)."""
    check_engine_invariants(engine, runner)
    ledger.check(engine)


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
        await wait_until(lambda: probe(handle).reading)
        if count is None:
            runner.open_gate()
        else:
            runner.release(count)
    return events


class RecordingRunner(GatedRunner):
    """A ``GatedRunner`` that records which requests it prepares and steps, in order."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self._order_lock = threading.Lock()
        self.prepared: list[str] = []
        self.batches: list[tuple[str, ...]] = []

    def prepare(self, request: ot.GenerationRequest, request_id: str) -> FakeState:
        """Record the start, then prepare."""
        with self._order_lock:
            self.prepared.append(request_id)
        return super().prepare(request, request_id)

    def step(self, states: Sequence[FakeState]) -> None:
        """Record the batch's members, then step."""
        with self._order_lock:
            self.batches.append(tuple(state.request_id for state in states))
        super().step(states)
