"""Runners: the seam between the engine and a model.

- ``Runner`` and ``RunnerCapabilities``: the protocol a model implements.
- ``DiffusersRunner``: a diffusers pipeline driven one step at a time.
- ``tiny_pipeline``: tiny real pipelines with random weights, for tests and demos.
"""

from __future__ import annotations

from ._diffusers import DiffusersRunner as DiffusersRunner
from ._protocol import Runner as Runner
from ._protocol import RunnerCapabilities as RunnerCapabilities
from ._tiny import TINY_KINDS as TINY_KINDS
from ._tiny import tiny_pipeline as tiny_pipeline

__all__ = ["TINY_KINDS", "DiffusersRunner", "Runner", "RunnerCapabilities", "tiny_pipeline"]
