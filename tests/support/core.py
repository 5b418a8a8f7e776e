"""Helpers that several core test modules share (tests mirror omni_trio's core modules)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import omni_trio as ot
from omni_trio.testing import FakeState, GatedRunner

__all__ = ["RecordingRunner"]


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
