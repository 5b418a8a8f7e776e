"""Runners the several-device tests share: each records what it prepares; one dies when told.

Both are ``GatedRunner``s: each step waits for the test's ``release`` (or an open
gate), so which worker holds which request is read from the runner, never timed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import omni_trio as ot
from omni_trio.testing import FakeRunner, FakeState, GatedRunner
from tests.support.core import WorkerKilled

__all__ = ["KillableRunner", "PrepareRecorder"]


class PrepareRecorder(GatedRunner):
    """A ``GatedRunner`` that records the ids it prepares."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.prepared: list[str] = []

    def prepare(self, request: ot.GenerationRequest, request_id: str) -> FakeState:
        """Record, then prepare."""
        self.prepared.append(request_id)
        return super().prepare(request, request_id)


class KillableRunner(PrepareRecorder):
    """Dies (a BaseException from ``step``) when told to."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.kill = False

    def step(self, states: Sequence[FakeState]) -> None:
        """Wait at the gate; then die if told to, else step."""
        with self._changed:
            self.arrived += 1
            self._changed.notify_all()
            if not self._changed.wait_for(lambda: self._open or self._permits > 0, 20):
                raise RuntimeError("KillableRunner: no release() came")
            if not self._open:
                self._permits -= 1
        if self.kill:
            raise WorkerKilled("device lost")
        FakeRunner.step(self, states)
