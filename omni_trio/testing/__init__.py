"""Tools for testing code that uses omni_trio, and omni_trio itself.

``FakeRunner`` and ``GatedRunner`` stand in for a model; the checks assert that
nothing leaked; ``probe(handle)`` and ``probe_engine(engine)`` show the engine-side
facts a test needs. Like ``trio.testing``, this module is public and stable.

Layout: ``_fake`` (the fake runners), ``_checks`` (threads, leaks, waiting),
``_probe`` (read-only views of an engine and its requests, and the test-only levers:
``assume_step_time``, ``assume_step_cost``), ``_invariants`` (the engine's
invariants and ``RequestLedger``), ``_deprecated`` (names on their way out).
"""

from __future__ import annotations

from .. import _exports
from ._checks import ENGINE_THREAD_PREFIX as ENGINE_THREAD_PREFIX
from ._checks import assert_engine_idle as assert_engine_idle
from ._checks import assert_no_engine_threads as assert_no_engine_threads
from ._checks import engine_threads as engine_threads
from ._checks import live_objects as live_objects
from ._checks import wait_until as wait_until
from ._deprecated import rss_bytes as rss_bytes  # deprecated, removed in 0.3.0
from ._fake import FakeRunner as FakeRunner
from ._fake import FakeState as FakeState
from ._fake import GatedRunner as GatedRunner
from ._invariants import RequestLedger as RequestLedger
from ._invariants import RunnerCounters as RunnerCounters
from ._invariants import assert_nothing_left as assert_nothing_left
from ._invariants import check_engine_invariants as check_engine_invariants
from ._invariants import engine_settled as engine_settled
from ._probe import EngineProbe as EngineProbe
from ._probe import RequestProbe as RequestProbe
from ._probe import WorkerProbe as WorkerProbe
from ._probe import assume_step_cost as assume_step_cost
from ._probe import assume_step_time as assume_step_time
from ._probe import cancel_at_delivery as cancel_at_delivery
from ._probe import probe as probe
from ._probe import probe_engine as probe_engine

__all__ = [
    "ENGINE_THREAD_PREFIX",
    "EngineProbe",
    "FakeRunner",
    "FakeState",
    "GatedRunner",
    "RequestLedger",
    "RequestProbe",
    "RunnerCounters",
    "WorkerProbe",
    "assert_engine_idle",
    "assert_no_engine_threads",
    "assert_nothing_left",
    "assume_step_cost",
    "assume_step_time",
    "cancel_at_delivery",
    "check_engine_invariants",
    "engine_settled",
    "engine_threads",
    "live_objects",
    "probe",
    "probe_engine",
    "rss_bytes",
    "wait_until",
]

# Reprs, tracebacks and pickles name this package, not its private modules.
_exports.set_public_module(__name__, globals())
