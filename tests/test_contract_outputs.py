"""Outputs and metrics: L15-L19, and the prompt cache's figures a runner reports (L94).

Determinism: GatedRunner steps (and, with ``gate_decodes``, decodes) wait for the
test's release; metrics are checked through identities that hold exactly, and
through lower bounds measured by the test itself, never through tight timings.
"""

from __future__ import annotations

import time

import anyio
import anyio.lowlevel
import pytest

import omni_trio as ot
from omni_trio.testing import FakeRunner, FakeState, GatedRunner, wait_until
from tests.support.core import BUDGET, read_gated, req, stats_add_up

pytestmark = pytest.mark.anyio


async def test_result_returns_output_once() -> None:
    """L15: result() returns the output once; after the terminal event nothing more comes."""
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(FakeRunner()) as engine:
            async with engine.submit(req(num_steps=3), request_id="r") as handle:
                steps = [event.step async for event in handle]
                output = await handle.result()
                assert steps == [1, 2, 3]
                assert output.request_id == "r"
                with pytest.raises(RuntimeError, match="already returned"):
                    await handle.result()
                assert [event async for event in handle] == []
            with pytest.raises(anyio.ClosedResourceError):
                await handle.result()


async def test_result_raises_terminal_error_every_time() -> None:
    """L15: aborted and failed requests raise their error from result(), every call."""
    runner = FakeRunner(fail_at_step=2)
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner) as engine:
            async with engine.submit(req(num_steps=3), request_id="f") as failed:
                for _ in range(2):
                    with pytest.raises(ot.RequestFailedError) as info:
                        await failed.result()
                    assert isinstance(info.value.__cause__, RuntimeError)
                assert [event.step async for event in failed] == [1]


async def test_output_is_materialized_off_the_step_loop() -> None:
    """L16: the next request steps while a finished one decodes; that wait is output_ready_wait.

    Exact, with gates and counts: "first"'s decode is held at its gate while
    "second" runs its three steps, each released by the test; only once the worker
    recorded the end of "second"'s denoising is the decode let go. So "second"'s
    whole execution lies inside "first"'s wait for its output, by the order of
    events, whatever the clock: that wait is ``output_ready_wait_s``, not ``exec_s``.
    """
    runner = GatedRunner(gate_decodes=True)
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner, ot.EngineConfig(max_batch_size=1)) as engine:
            first = engine.submit(req(num_steps=1), request_id="first")
            second = engine.submit(req(num_steps=3), request_id="second")
            runner.release(1)  # "first"'s only step
            await wait_until(lambda: runner.decodes_arrived == 1)
            for arrived in (2, 3, 4):  # "second"'s steps, while "first"'s decode is held
                await runner.wait_arrived(arrived)
                assert first.status is ot.RequestStatus.RUNNING
                runner.release(1)
            # The worker writes a batch's running count after it recorded the end of
            # its denoising.
            await wait_until(
                lambda: runner.steps_run == 4 and engine.statistics().workers[0].running == 0
            )
            assert runner.decodes_arrived == 1
            runner.release_decode(2)
            async with first, second:
                output = await first.result()
                later = await second.result()
            m = output.metrics
            assert m.output_ready_wait_s >= later.metrics.exec_s > 0
            assert "output_ready_wait" not in m.stage_durations
            assert set(m.stage_durations) == {"encode", "denoise", "decode"}
            assert m.exec_s + m.output_ready_wait_s + m.queue_wait_s == pytest.approx(m.total_s)


async def ended_three_ways(
    engine: ot.Engine, runner: GatedRunner
) -> tuple[ot.RequestHandle, ot.RequestHandle, ot.RequestHandle, float]:
    """On an engine of batches of one: ``"done"`` completes its one step, ``"waiting"`` is
    aborted before it ran, ``"running"`` is aborted in its second step and released;
    their handles, and when ``"running"``'s abort was asked (``time.perf_counter``)."""
    done = engine.submit(req(num_steps=1), request_id="done")
    runner.release(1)
    await done.result()
    running = engine.submit(req(num_steps=5), request_id="running")
    await runner.wait_arrived(2)
    waiting = engine.submit(req(num_steps=5), request_id="waiting")
    engine.abort_nowait("waiting")
    abort_called = time.perf_counter()
    engine.abort_nowait("running")
    runner.release(1)
    with pytest.raises(ot.RequestAbortedError):
        await running.result()
    return done, running, waiting, abort_called


async def test_metrics_for_every_terminal_state() -> None:
    """L17: metrics are set for completed, aborted, failed, waiting-aborted and cut-off requests."""
    runner = GatedRunner()
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner, ot.EngineConfig(max_batch_size=1)) as engine:
            done, running, waiting, abort_called = await ended_three_ways(engine, runner)
            released_seen = time.perf_counter()
            for handle in (done, running, waiting):
                assert handle.metrics is not None, handle
            assert done.metrics is not None and done.metrics.abort_latency_s is None
            assert done.metrics.steps_done == 1
            m = running.metrics
            assert m is not None and m.abort_latency_s is not None
            assert 0 <= m.abort_latency_s <= released_seen - abort_called + 1e-3
            assert m.steps_done == 1 and m.output_ready_wait_s == 0.0
            w = waiting.metrics
            assert w is not None and w.abort_latency_s is not None and w.steps_done == 0
            assert w.exec_s == 0.0
            for handle in (done, running, waiting):
                await handle.aclose()
        failing = FakeRunner(fail_at_step=1)
        async with ot.open_engine(failing) as engine:
            async with engine.submit(req(), request_id="failed") as failed:
                with pytest.raises(ot.RequestFailedError):
                    await failed.result()
                assert failed.metrics is not None and failed.metrics.abort_latency_s is None


#: What ``PromptCounting`` says its prompt cache did for every request's texts.
PROMPT_FIGURES = ot.PromptCacheMetrics(hits=1, misses=1, encode_s=0.5, saved_s=0.25)


class PromptCounting(GatedRunner):
    """A gated fake runner with ``prompt_cache_metrics``: ``PROMPT_FIGURES`` for every
    request but ``"bad"``, for which it returns what is not a ``PromptCacheMetrics``."""

    def prompt_cache_metrics(self, state: FakeState) -> object:
        return "figures" if state.request_id == "bad" else PROMPT_FIGURES


async def test_a_requests_prompt_cache_figures_are_read_at_its_release() -> None:
    """L94: ``RequestMetrics.prompt_cache`` is what the runner's ``prompt_cache_metrics``
    said of the request's state, read at its release whatever ended it (completed, or
    aborted while it ran); ``None`` for a request that never ran and from a runner
    without the call; a value of another type fails the request, as the discard's."""
    runner = PromptCounting()
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner, ot.EngineConfig(max_batch_size=1)) as engine:
            done, running, waiting, _ = await ended_three_ways(engine, runner)
            runner.open_gate()
            bad = engine.submit(req(num_steps=1), request_id="bad")
            with pytest.raises(ot.RequestFailedError) as failed:
                await bad.result()
            figures = {h.request_id: h.metrics and h.metrics.prompt_cache for h in
                       (done, running, waiting, bad)}  # fmt: skip
            for handle in (done, running, waiting, bad):
                await handle.aclose()
        assert figures == {"done": PROMPT_FIGURES, "running": PROMPT_FIGURES,
                           "waiting": None, "bad": None}  # fmt: skip
        assert isinstance(failed.value.__cause__, ot.InvalidOutputError)
        assert "prompt_cache_metrics returned str, not PromptCacheMetrics" in str(failed.value)
        async with ot.open_engine(FakeRunner(step_cache=True)) as engine:
            plain = await engine.generate(req(num_steps=1, cache=ot.StepCache(kind="first-block")))
    assert plain.metrics.cache is not None and plain.metrics.prompt_cache is None


@pytest.mark.parametrize(
    ("preview_every", "read", "expected"), [(2, True, 3), (0, True, 0), (1, False, 0)]
)
async def test_previews_only_when_asked_and_read(
    preview_every: int, read: bool, expected: int
) -> None:
    """L18: previews come every preview_every-th step, only to a consumer that reads events."""
    runner = GatedRunner()
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner) as engine:
            request = req(num_steps=6, preview_every=preview_every)
            async with engine.submit(request, request_id="r") as handle:
                if read:
                    events = await read_gated(handle, runner)
                    assert [e.step for e in events] == [1, 2, 3, 4, 5, 6]
                    with_preview = [e.step for e in events if e.preview is not None]
                    assert with_preview == ([2, 4, 6] if preview_every == 2 else [])
                    for event in events:
                        if event.preview is not None:
                            assert event.preview.shape == (1, 3, 2, 2)
                            assert event.preview.device.type == "cpu"
                else:
                    runner.open_gate()
                await handle.result()
            assert runner.previews == expected


async def test_statistics_add_up_at_every_moment() -> None:
    """L19: at every moment each admitted request is in exactly one status."""
    runner = GatedRunner()
    violations: list[ot.EngineStatistics] = []
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner, ot.EngineConfig(max_batch_size=2)) as engine:
            done = False

            async def watch() -> None:
                while not done:
                    if not stats_add_up(engine):
                        violations.append(engine.statistics())
                    await anyio.lowlevel.checkpoint()

            async with anyio.create_task_group() as tg:
                tg.start_soon(watch)
                handles = [engine.submit(req(num_steps=3), request_id=f"r{i}") for i in range(8)]
                assert stats_add_up(engine)
                engine.abort_nowait("r7")
                assert stats_add_up(engine)
                await runner.wait_arrived(1)
                engine.abort_nowait("r0")
                runner.open_gate()
                for handle in handles:
                    async with handle:
                        with (
                            pytest.raises(ot.RequestAbortedError)
                            if handle.request_id
                            in (
                                "r0",
                                "r7",
                            )
                            else _nothing()
                        ):
                            await handle.result()
                    assert stats_add_up(engine)
                done = True
            stats = engine.statistics()
            assert (stats.admitted, stats.completed, stats.aborted) == (8, 6, 2)
            assert violations == []


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *args: object) -> None:
        return None
