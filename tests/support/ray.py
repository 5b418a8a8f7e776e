"""A holdable Ray Serve replica: fake runners whose steps wait at a gate the test opens.

A replica is a process of its own, so ``GatedRunner``'s in-process gate cannot reach it.
A ``Gate`` actor (``start_gate()``) serves instead: every step of a ``HeldRunner``
reports to it and waits until the test calls ``open``; the test waits on
``wait_arrived(n)`` for ``n`` steps to be held there. ``held_runners(gate, n)`` is a
picklable factory for ``deployment``: a replica of ``n`` workers, each of which holds
the one request it runs.

The replica imports this module (the factory travels by reference): Ray puts the
driver's working directory, the repository's root under pytest, on its workers' paths.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import ray

from omni_trio.testing import FakeRunner, FakeState

__all__ = ["GATE_TIMEOUT_S", "Gate", "HeldRunner", "held_runners", "start_gate"]

#: Seconds a step waits at a gate never opened before it fails (its request with it):
#: a test that dies before its ``finally`` opens the gate leaves no replica stuck.
GATE_TIMEOUT_S = 120.0


class Gate:
    """Counts the steps that reached it; lets every one go once opened, for good.

    A Ray actor (``start_gate()``), whose methods each run as a task of its event loop.
    """

    def __init__(self) -> None:
        self._arrived = 0
        self._changed = asyncio.Condition()
        self._opened = asyncio.Event()

    async def arrive(self) -> None:
        """Count one step, then return once the gate is open."""
        async with self._changed:
            self._arrived += 1
            self._changed.notify_all()
        await self._opened.wait()

    async def wait_arrived(self, n: int) -> int:
        """Return the steps that arrived, once there are ``n`` or more."""
        async with self._changed:
            await self._changed.wait_for(lambda: self._arrived >= n)
            return self._arrived

    async def arrived(self) -> int:
        """The steps that arrived so far."""
        return self._arrived

    async def open(self) -> None:
        """Let every step that waits, and every later one, run."""
        self._opened.set()


def start_gate() -> Any:
    """Start a ``Gate`` actor (no CPU of the cluster's); return its handle."""
    return ray.remote(num_cpus=0)(Gate).remote()


class HeldRunner(FakeRunner):
    """A ``FakeRunner`` whose every step waits at ``gate`` (a ``Gate``) until it opens."""

    def __init__(self, gate: Any) -> None:
        super().__init__()
        self._gate = gate

    def step(self, states: Sequence[FakeState]) -> None:
        """Report to the gate and wait until it is open, then step as ``FakeRunner``."""
        ray.get(self._gate.arrive.remote(), timeout=GATE_TIMEOUT_S)
        super().step(states)


def held_runners(gate: Any, n: int) -> list[HeldRunner]:
    """``n`` runners (``n`` workers of one replica's engine) held at ``gate``."""
    return [HeldRunner(gate) for _ in range(n)]
