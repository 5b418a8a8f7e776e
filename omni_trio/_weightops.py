"""The engine's weights across its runners (L102, L103): updates in place, sleep, wake.

Runs in the event loop's thread; one operation at a time (``update``, ``sleep``,
``wake`` take one lock). An update or a sleep:

1. holds the workers (``Pool.set_hold``): from their next boundary on they take no
   new request. With the policy ``finish`` the running and suspended requests run to
   their ends; with ``abort`` they are aborted (reason ``weights_updated``); with
   ``suspend`` every worker suspends its running requests (L61) and says so (``Held``);
2. waits until none of the requests a worker had taken is on a worker any more (each
   is terminal, or suspended): no runner call of a request runs from then on, and no
   state made on the old weights is left to be stepped on the new ones;
3. calls every live runner (``WeightsRunner``) in anyio's worker threads, one after
   another: when one refuses, those that applied it revert it (all or nothing), and
   the error names the worker; else every one commits. A runner that breaks (a
   ``BaseException`` that is not an ``Exception``: a parallel group whose rank died)
   ends its worker (L23, L43) and the others go on, as an adapter's load does;
4. an update moves the version on, names the new weights in the result cache's model
   (the requests waiting since before lose their keys: they run on the new weights)
   and ends the hold; a sleep keeps the workers held, taking nothing, until ``wake``.

While it waits, new requests are admitted and wait in the queue (a sleep with
``refuse`` refuses them from its call to its wake: ``EngineSleepingError``).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, cast

import anyio
import anyio.lowlevel
import anyio.to_thread

from ._errors import OmniTrioError
from ._log import ENGINE
from ._pool import Hold
from ._reasons import AbortReason
from ._weights import (
    SLEEP_POLICIES,
    UPDATE_POLICIES,
    EngineSleepingError,
    SleepReport,
    WakeReport,
    WeightsError,
    WeightSource,
    WeightsRunner,
    WeightVersion,
    is_weights_runner,
)

if TYPE_CHECKING:
    from ._engine import Engine
    from ._record import Record
    from ._runner import Runner

__all__ = ["EngineWeights"]

T = TypeVar("T")
R = TypeVar("R")


class _Broke:
    """A runner's call raised a ``BaseException`` that is not an ``Exception``."""

    __slots__ = ("exc",)

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


def _call(call: Callable[[R], T], runner: R) -> T | _Broke:
    """``call(runner)`` in a worker thread; a ``BaseException`` that is not an
    ``Exception`` (the runner broke, L23) is returned, not raised."""
    try:
        return call(runner)
    except Exception:
        raise
    except BaseException as exc:
        return _Broke(exc)


class EngineWeights:
    """An engine's weights: their version, updates, sleep and wake (see the module doc).

    Args:
        engine: the engine (its pool, workers, live requests).
        runners: its runners, in the order of its workers.
    """

    def __init__(self, engine: Engine, runners: Sequence[Runner[Any]]) -> None:
        self._engine = engine
        self._runners: list[WeightsRunner] = (
            [cast("WeightsRunner", runner) for runner in runners]
            if all(is_weights_runner(runner) for runner in runners)
            else []
        )
        self._lock = anyio.Lock()
        #: The weights served now (L102).
        self.version = WeightVersion(number=0)
        #: The level the engine sleeps at; 0 awake (L103).
        self.level = 0
        self._refusing = False
        # L103: the hold round of a sleep that suspends, and the workers that said they
        # run nothing in it; ``_news`` is set when that (or a worker's death) happens.
        self._round = 0
        self._held: set[int] = set()
        self._news = anyio.Event()

    def check_admitting(self) -> None:
        """Refuse a new request while a sleep refuses them (L103).

        Raises:
            EngineSleepingError: the engine sleeps, or falls asleep, with ``refuse``.
        """
        if self._refusing:
            raise EngineSleepingError("the engine sleeps: retry once it wakes")

    def held(self, worker: int, round_: int) -> None:
        """Worker ``worker`` runs nothing in hold ``round_`` (its ``Held``)."""
        if round_ == self._round:
            self._held.add(worker)
            self._news.set()

    def worker_lost(self) -> None:
        """A worker died (L43), or the engine: whoever waits for the workers looks again."""
        self._news.set()

    # -- update ----------------------------------------------------------------------

    async def update(
        self, source: WeightSource, *, policy: str, label: str | None
    ) -> WeightVersion:
        """``Engine.update_weights``."""
        if policy not in UPDATE_POLICIES:
            raise ValueError(f"policy: one of {', '.join(UPDATE_POLICIES)}, got {policy!r}")
        if label is not None and (not isinstance(label, str) or not label):
            raise ValueError("label: a non-empty str, or None")
        self._check_supported("updated in place")
        engine = self._engine
        async with self._lock:
            engine._check_admitting()
            if self.level:
                raise WeightsError("the engine sleeps: wake it first", reason="asleep")
            number = self.version.number + 1
            key = f"v{number}-{uuid.uuid4().hex[:16]}"
            started = time.perf_counter()
            version = None
            try:
                await self._drain(
                    Hold.FRESH if policy == "finish" else Hold.ALL,
                    abort=AbortReason.WEIGHTS_UPDATED if policy == "abort" else None,
                )
                drained = time.perf_counter()
                engine._check_admitting()
                await self._each(
                    lambda runner: runner.update_weights(source, key=key),
                    undo=lambda runner: runner.revert_weights(),
                    what="update",
                )
                await self._each(lambda runner: runner.commit_weights(), what="commit")
                version = self.version = WeightVersion(number=number, label=label)
                if engine._results is not None:
                    waiting = [r for r in engine._live.values() if r.worker is None]
                    engine._results.weights_changed(key, waiting)
            finally:
                engine._pool.set_hold(None, weights=version)
            ENGINE.info(
                "weights updated to version %d%s (%s): %.3f s waiting for the requests in"
                " flight, %.3f s applying",
                number,
                "" if label is None else f" {label!r}",
                policy,
                drained - started,
                time.perf_counter() - drained,
            )
            return version

    # -- sleep and wake --------------------------------------------------------------

    async def sleep(self, *, level: int, policy: str, refuse: bool) -> SleepReport:
        """``Engine.sleep``."""
        if level not in (1, 2):
            raise ValueError(f"level: 1 or 2, got {level!r}")
        if policy not in SLEEP_POLICIES:
            raise ValueError(f"policy: one of {', '.join(SLEEP_POLICIES)}, got {policy!r}")
        self._check_supported("put to sleep")
        engine = self._engine
        if policy == "suspend" and not engine._capabilities.suspendable:
            raise WeightsError(
                "the runners cannot suspend a request (they declare no suspendable):"
                " sleep with policy='finish'",
                reason="unsupported",
            )
        async with self._lock:
            engine._check_admitting()
            if self.level:
                return SleepReport(
                    level=self.level,
                    offloaded_bytes=0,
                    dropped_bytes=0,
                    kept_bytes=0,
                    drain_s=0.0,
                    sleep_s=0.0,
                )
            started = time.perf_counter()
            self._refusing = bool(refuse)
            try:
                await self._drain(Hold.FRESH if policy == "finish" else Hold.SUSPEND)
                engine._pool.set_hold(Hold.ALL)
                drained = time.perf_counter()
                engine._check_admitting()
                freed = await self._each(
                    lambda runner: runner.sleep_weights(level),
                    undo=lambda runner: runner.wake_weights(),
                    what="sleep",
                )
            except BaseException:
                self._refusing = False
                engine._pool.set_hold(None)
                raise
            self.level = level
            report = SleepReport(
                level=level,
                offloaded_bytes=sum(bytes_.offloaded for bytes_ in freed),
                dropped_bytes=sum(bytes_.dropped for bytes_ in freed),
                kept_bytes=sum(bytes_.kept for bytes_ in freed),
                drain_s=drained - started,
                sleep_s=time.perf_counter() - drained,
            )
            ENGINE.info(
                "asleep at level %d (%s): %d bytes offloaded, %d dropped, %d kept; %.3f s"
                " waiting for the requests in flight, %.3f s freeing",
                level,
                policy,
                report.offloaded_bytes,
                report.dropped_bytes,
                report.kept_bytes,
                report.drain_s,
                report.sleep_s,
            )
            return report

    async def wake(self) -> WakeReport:
        """``Engine.wake``."""
        async with self._lock:
            if not self.level:
                await anyio.lowlevel.checkpoint()
                return WakeReport(level=0, wake_s=0.0)
            started = time.perf_counter()
            await self._each(lambda runner: runner.wake_weights(), what="wake")
            level, self.level = self.level, 0
            self._refusing = False
            self._engine._pool.set_hold(None)
            report = WakeReport(level=level, wake_s=time.perf_counter() - started)
            ENGINE.info("awake from level %d in %.3f s", level, report.wake_s)
            return report

    # -- the steps -------------------------------------------------------------------

    def _check_supported(self, what: str) -> None:
        if not self._runners:
            raise WeightsError(
                f"these runners' weights cannot be {what} (they do not implement WeightsRunner)",
                reason="unsupported",
            )

    async def _drain(self, hold: Hold, *, abort: str | None = None) -> None:
        """Hold the workers and wait until none of the requests they took is on a worker
        (see the module doc); abort them first with ``abort``."""
        engine = self._engine
        self._held.clear()
        self._round = engine._pool.set_hold(hold)
        started: list[Record] = [r for r in engine._live.values() if r.worker is not None]
        if abort is not None:
            for record in started:
                engine._abort_record(record, abort)
        if hold is Hold.SUSPEND:
            while not engine._alive <= self._held and engine._dead is None:
                self._news = anyio.Event()
                if engine._alive <= self._held:
                    break
                await self._news.wait()
            with engine._pool.cond:  # the decoding ones; the suspended read not taken
                started = [r for r in started if r.taken]
        for record in started:
            await record.done.wait()

    async def _each(
        self,
        call: Callable[[WeightsRunner], T],
        *,
        undo: Callable[[WeightsRunner], None] | None = None,
        what: str,
    ) -> list[T]:
        """``call`` on every live runner in turn, in a worker thread (shielded); when one
        raises, ``undo`` on those done, in reverse order, then ``WeightsError``."""
        engine = self._engine
        done: list[WeightsRunner] = []
        results: list[T] = []
        index = 0
        try:
            for index in sorted(engine._alive):
                runner = self._runners[index]
                with anyio.CancelScope(shield=True):
                    outcome = await anyio.to_thread.run_sync(_call, call, runner)
                if isinstance(outcome, _Broke):
                    error = engine._runner_broke(index, outcome.exc)
                    if error is not None:
                        raise error
                    continue
                done.append(runner)
                results.append(outcome)
        except Exception as exc:
            await self._undo(done, undo, what)
            if isinstance(exc, OmniTrioError):
                raise
            raise WeightsError(
                f"the {what} failed on {engine._workers[index].name}: {type(exc).__name__}:"
                f" {exc}; every runner is as it was",
                reason="failed",
            ) from exc
        except BaseException:
            await self._undo(done, undo, what)
            raise
        return results

    @staticmethod
    async def _undo(
        done: list[WeightsRunner],
        undo: Callable[[WeightsRunner], None] | None,
        what: str,
    ) -> None:
        if undo is None:
            return
        with anyio.CancelScope(shield=True):
            for runner in reversed(done):
                try:
                    await anyio.to_thread.run_sync(undo, runner)
                except Exception:
                    ENGINE.exception("a runner could not undo its %s", what)
