"""The public test helpers of omni_trio.testing."""

from __future__ import annotations

import threading
import time

import anyio
import pytest
import torch

import omni_trio as ot
from omni_trio.testing import (
    FakeRunner,
    GatedRunner,
    RequestLedger,
    RequestProbe,
    engine_threads,
    probe,
    wait_until,
)
from tests.support.core import BUDGET, req, solo_images, status


def test_fake_runner_depends_only_on_the_request() -> None:
    """FakeRunner images depend on seed, prompt and steps, never on batch-mates."""
    base = req(num_steps=4, seed=3, prompt="p")
    runner = FakeRunner()
    states = [runner.prepare(r, str(i)) for i, r in enumerate([base, req(seed=9), base])]
    for _ in range(4):
        runner.step(states)
    torch.testing.assert_close(runner.decode(states[0]), solo_images(base), rtol=0, atol=0)
    torch.testing.assert_close(runner.decode(states[2]), solo_images(base), rtol=0, atol=0)
    assert not torch.equal(solo_images(base), solo_images(req(num_steps=4, seed=4, prompt="p")))
    assert not torch.equal(solo_images(base), solo_images(req(num_steps=4, seed=3, prompt="q")))
    assert not torch.equal(solo_images(base), solo_images(req(num_steps=5, seed=3, prompt="p")))
    images = solo_images(base)
    assert images.shape == (1, 3, 16, 16)
    assert float(images.min()) >= 0.0 and float(images.max()) <= 1.0


def test_fake_runner_counts_and_refuses_double_discard() -> None:
    """Counters follow the calls; discarding a state twice is a bug the runner reports."""
    runner = FakeRunner()
    state = runner.prepare(req(), "r")
    assert runner.live_states == 1
    runner.discard(state)
    assert runner.live_states == 0
    with pytest.raises(RuntimeError, match="twice"):
        runner.discard(state)


def test_gated_runner_times_out_instead_of_hanging() -> None:
    """A step nobody releases fails after gate_timeout rather than hanging the test."""
    runner = GatedRunner(gate_timeout=0.01)
    state = runner.prepare(req(), "r")
    with pytest.raises(RuntimeError, match="no release"):
        runner.step([state])


@pytest.mark.anyio
async def test_engine_threads_are_listed_while_open() -> None:
    """engine_threads() shows the engine's threads while it runs, none after."""
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(FakeRunner()) as engine:
            assert set(engine_threads()) == set(engine.threads)
            assert all(isinstance(t, threading.Thread) for t in engine.threads)
        assert engine_threads() == []


@pytest.mark.anyio
async def test_ledger_follows_a_suspended_request_back_to_waiting() -> None:
    """L15, L61: a suspended request goes from RUNNING back to WAITING; the ledger accepts it.

    "low" runs its first step, gated; "high", of a higher priority, arrives, and at
    the boundary "low" is suspended: it reads WAITING, after the ledger saw it
    RUNNING. The ledger's checks pass, with the engine (under its lock) and
    without, and again once "low" resumed and both completed.
    """
    runner = GatedRunner()
    ledger = RequestLedger()
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner, ot.EngineConfig(max_batch_size=1)) as engine:
            low = engine.submit(req(num_steps=2), request_id="low")
            ledger.track(low)
            await runner.wait_arrived(1)
            assert low.status is ot.RequestStatus.RUNNING
            ledger.check(engine)
            high = engine.submit(req(num_steps=1, priority=1), request_id="high")
            ledger.track(high)
            runner.release(1)
            await runner.wait_arrived(2)  # "high"'s step: "low" was suspended before it
            assert engine.statistics().suspended == 1
            assert status(low) is ot.RequestStatus.WAITING
            ledger.check(engine)
            ledger.check()
            runner.open_gate()
            for handle in (high, low):
                async with handle:
                    ledger.outcome(handle, await handle.result())
            ledger.check(engine)
    assert ledger.tracked == 0
    assert low.metrics is not None and low.metrics.preemptions == 1


@pytest.mark.anyio
async def test_ledger_flags_running_back_to_waiting_without_a_suspension(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """L15, L61: RUNNING -> WAITING is legal only for a suspended request.

    While the worker waits at the gate inside "a"'s step, the probe the ledger reads
    through (``RequestProbe``) says WAITING again, with no suspension counted: the
    ledger, which saw "a" RUNNING, flags it. One suspension counted makes the same
    status legal. The engine's own state is never touched.
    """
    runner = GatedRunner()
    ledger = RequestLedger()
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner) as engine:
            async with engine.submit(req(num_steps=1), request_id="a") as handle:
                ledger.track(handle)
                await runner.wait_arrived(1)
                ledger.check(engine)
                with monkeypatch.context() as patch:
                    patch.setattr(
                        RequestProbe, "status", property(lambda _: ot.RequestStatus.WAITING)
                    )
                    with pytest.raises(AssertionError, match="never suspended"):
                        ledger.check()
                    patch.setattr(RequestProbe, "preemptions", property(lambda _: 1))
                    ledger.check()
                assert probe(handle).status is ot.RequestStatus.RUNNING
                runner.release(1)
                ledger.outcome(handle, await handle.result())
            await wait_until(lambda: runner.live_states == 0)
            ledger.check(engine)
    assert ledger.tracked == 0


@pytest.mark.anyio
async def test_ledger_reads_the_statistics_and_its_statuses_at_one_moment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """L19: a worker that takes a waiting request between the engine's statistics and the
    ledger's own count must not make them differ (the soak saw 4 RUNNING where the
    statistics said 1: the worker took 3 between its two reads).

    The reproduction: the test holds the workers' lock while it submits, so the worker
    cannot take the request yet; the statistics are read (it waits), then the test lets
    go of its hold and gives the worker its chance. Without one moment for both reads,
    the worker takes the request and the ledger counts it RUNNING.
    """
    ledger = RequestLedger()
    runner = GatedRunner()
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner) as engine:
            lock = engine._pool.cond
            real = engine.statistics
            handle_probe: list[RequestProbe] = []

            held = [True]

            def statistics() -> ot.EngineStatistics:
                stats = real()
                if not held.pop():  # the ledger reads them twice: the second time
                    return stats
                lock.release()  # the test's hold; the ledger's own, if any, stays
                deadline = time.monotonic() + 1.0
                while handle_probe[0].status is ot.RequestStatus.WAITING:
                    if time.monotonic() > deadline:
                        break  # the worker cannot take it: the ledger holds the lock
                    time.sleep(0.001)
                return stats

            held.append(False)  # the first read (is_dead) keeps the hold
            lock.acquire()
            handle = engine.submit(req(num_steps=1), request_id="a")
            ledger.track(handle)
            handle_probe.append(probe(handle))
            monkeypatch.setattr(engine, "statistics", statistics)
            ledger.check(engine)
            monkeypatch.undo()
            async with handle:
                await wait_until(lambda: handle_probe[0].status is ot.RequestStatus.RUNNING)
                runner.release(1)
                ledger.outcome(handle, await handle.result())


def test_rss_bytes_is_deprecated() -> None:
    """``rss_bytes`` still reads a size, with a ``DeprecationWarning`` (removed in 0.3.0)."""
    import omni_trio.testing

    with pytest.warns(DeprecationWarning, match=r"removed in 0\.3\.0"):
        assert omni_trio.testing.rss_bytes(trim=True) > 0
