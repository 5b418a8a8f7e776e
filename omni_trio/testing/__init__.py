"""Tools for testing code that uses omni_trio, and omni_trio itself.

``FakeRunner`` and ``GatedRunner`` stand in for a model; the checks assert that
nothing leaked. Like ``trio.testing``, this module is public and stable.
"""

from __future__ import annotations

from ._checks import ENGINE_THREAD_PREFIX as ENGINE_THREAD_PREFIX
from ._checks import assert_engine_idle as assert_engine_idle
from ._checks import assert_no_engine_threads as assert_no_engine_threads
from ._checks import engine_threads as engine_threads
from ._checks import live_objects as live_objects
from ._checks import wait_until as wait_until
from ._fake import FakeRunner as FakeRunner
from ._fake import FakeState as FakeState
from ._fake import GatedRunner as GatedRunner

__all__ = [
    "ENGINE_THREAD_PREFIX",
    "FakeRunner",
    "FakeState",
    "GatedRunner",
    "assert_engine_idle",
    "assert_no_engine_threads",
    "engine_threads",
    "live_objects",
    "wait_until",
]
