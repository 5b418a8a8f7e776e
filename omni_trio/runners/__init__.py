"""Runners: the seam between the engine and a model."""

from __future__ import annotations

from ._protocol import Runner as Runner
from ._protocol import RunnerCapabilities as RunnerCapabilities

__all__ = ["Runner", "RunnerCapabilities"]
