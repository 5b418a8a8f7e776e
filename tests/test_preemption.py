"""Preemption at a step boundary (L61): who is suspended, when, and what it keeps.

Determinism: a ``GatedRunner`` holds the worker in a step while the test submits;
every suspension happens at the boundary after a step the test released, and is
read from exact counts (the runner's ``suspends``/``resumes``/``parked_states``,
the engine's statistics, the members of each step), never from timing. "At once"
(an abort frees a suspended request's state) is proved while the worker is held
in another request's step: no boundary can have come.
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest
import torch
import trio
import trio.testing

import omni_trio as ot
from omni_trio.runners import RunnerCapabilities
from omni_trio.testing import (
    FakeState,
    GatedRunner,
    assert_nothing_left,
    probe_engine,
    wait_until,
)
from tests.support.core import BUDGET, RecordingRunner, expected_images, req

pytestmark = pytest.mark.filterwarnings("error")


def config(**fields: Any) -> ot.EngineConfig:
    """Batches of one unless said otherwise."""
    fields.setdefault("max_batch_size", 1)
    return ot.EngineConfig(**fields)


async def opened(engine: ot.Engine, runner: GatedRunner) -> ot.RequestHandle:
    """Hold the worker in the one step of an 8x8 "opener" (a batch key of its own).

    What the test submits next waits, and starts together at the next boundary.
    """
    opener = engine.submit(req(num_steps=1, height=8, width=8), request_id="opener")
    await runner.wait_arrived(1)
    return opener


async def low_suspended_for(
    engine: ot.Engine,
    runner: GatedRunner,
    low: ot.GenerationRequest,
    high: ot.GenerationRequest,
) -> tuple[ot.RequestHandle, ot.RequestHandle]:
    """Run ``low`` into its first step, submit ``high``, and let that step end: at the
    boundary ``low`` is suspended and ``high``'s first step waits at the gate (L61).
    """
    low_handle = engine.submit(low, request_id="low")
    await runner.wait_arrived(1)
    high_handle = engine.submit(high, request_id="high")
    runner.release(1)
    await runner.wait_arrived(2)
    await wait_until(lambda: engine.statistics().suspended == 1)
    assert low_handle.status is ot.RequestStatus.WAITING
    return low_handle, high_handle


@pytest.mark.anyio
async def test_higher_priority_suspends_the_running_request_which_resumes_exactly() -> None:
    """L61: a strictly higher-priority newcomer suspends the running request at the boundary.

    "low" (5 steps) runs its first step, gated; "high" arrives. At the boundary "low"
    is suspended (it reads WAITING, its state parked, counted), "high" runs all its
    steps, then "low" resumes from step 2: its events count 1..5 once each, and its
    image equals the uninterrupted one.
    """
    runner = RecordingRunner()
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner, config()) as engine:
            low, high = await low_suspended_for(
                engine, runner, req(num_steps=5, seed=7), req(priority=1)
            )
            stats = engine.statistics()
            assert (stats.waiting, stats.running, stats.suspended, stats.preemptions) == (
                1,
                1,
                1,
                1,
            )
            assert runner.parked_states == 1 and runner.live_states == 2
            assert high.status is ot.RequestStatus.RUNNING
            events: list[int] = []

            async def read_low() -> None:
                events.extend([event.step async for event in low])

            async with anyio.create_task_group() as group:
                group.start_soon(read_low)
                runner.open_gate()
            async with high:
                await high.result()
            async with low:
                output = await low.result()
    assert runner.batches == [("low",), *[("high",)] * 3, *[("low",)] * 4]
    assert runner.prepared == ["low", "high"]
    assert (runner.suspends, runner.resumes, runner.parked_states) == (1, 1, 0)
    assert events == [1, 2, 3, 4, 5]
    assert torch.equal(output.images, expected_images(req(num_steps=5, seed=7)))
    assert output.metrics.preemptions == 1 and output.metrics.suspended_s > 0
    assert high.metrics is not None and high.metrics.preemptions == 0


@pytest.mark.anyio
async def test_equal_priorities_never_preempt() -> None:
    """L61: a newcomer of the running request's priority and tenant waits for the batch to end."""
    runner = RecordingRunner()
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner, config()) as engine:
            first = engine.submit(req(priority=3), request_id="first")
            await runner.wait_arrived(1)
            second = engine.submit(req(priority=3, deadline_s=1000), request_id="second")
            runner.open_gate()
            for handle in (first, second):
                async with handle:
                    await handle.result()
            assert engine.statistics().preemptions == 0
    assert runner.batches == [("first",)] * 3 + [("second",)] * 3
    assert runner.suspends == 0


@pytest.mark.anyio
async def test_a_full_batch_gives_up_its_lowest_ranked_member() -> None:
    """L61: in a full batch the lowest-ranked member makes room, and only it.

    "a" (priority 0) and "b" (priority -1) fill a batch of two (they wait behind a
    one-step "opener" of another size, so they start together); "c" (priority 0)
    has a higher priority than "b" only, so "b" is suspended and "c" joins at the
    same boundary; "b" resumes when a place is free, and joins "a".
    """
    runner = RecordingRunner()
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner, config(max_batch_size=2)) as engine:
            handles = [await opened(engine, runner)]
            handles += [
                engine.submit(req(num_steps=4), request_id="a"),
                engine.submit(req(num_steps=4, priority=-1), request_id="b"),
            ]
            runner.release(1)
            await runner.wait_arrived(2)
            handles.append(engine.submit(req(num_steps=2), request_id="c"))
            runner.open_gate()
            for handle in handles:
                async with handle:
                    await handle.result()
    assert runner.batches[:4] == [("opener",), ("a", "b"), ("a", "c"), ("a", "c")]
    assert runner.batches[4:] == [("a", "b"), ("b",), ("b",)]
    assert runner.suspends == 1


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("newcomer", "tenant_preemption", "suspends"),
    [("light", True, 1), ("light", False, 0), ("heavy", True, 0)],
)
async def test_a_tenant_over_its_share_gives_a_place_to_another_tenant(
    newcomer: str, tenant_preemption: bool, suspends: int
) -> None:
    """L61 amended, L57: at one priority, a full batch held by one tenant makes room
    for another tenant's newcomer; never for its own tenant's, nor when turned off.

    "h1" and "h2" of tenant "heavy" (4 steps) fill a batch of two behind a one-step
    "opener"; "n" (2 steps) arrives at the same priority. For tenant "light", "heavy"
    holds both places where its weight's share is one: "h2", its lowest-ranked,
    is suspended, "n" joins at the boundary, and "h2" resumes when "n" is done,
    from the step it reached, with the uninterrupted image. "heavy"'s own "n", or
    ``tenant_preemption=False``, waits for a place.
    """
    runner = RecordingRunner()
    settings = config(max_batch_size=2, tenant_preemption=tenant_preemption)
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner, settings) as engine:
            handles = [await opened(engine, runner)]
            for name in ("h1", "h2"):
                request = req(num_steps=4, seed=3, tenant="heavy")
                handles.append(engine.submit(request, request_id=name))
            runner.release(1)
            await runner.wait_arrived(2)
            handles.append(engine.submit(req(num_steps=2, tenant=newcomer), request_id="n"))
            runner.open_gate()
            outputs = []
            for handle in handles:
                async with handle:
                    outputs.append(await handle.result())
            assert engine.statistics().preemptions == suspends
    if suspends:
        assert runner.batches == [
            ("opener",),
            ("h1", "h2"),
            *[("h1", "n")] * 2,
            ("h1", "h2"),
            *[("h2",)] * 2,
        ]
        assert outputs[2].metrics.preemptions == 1
    else:
        assert runner.batches == [("opener",), *[("h1", "h2")] * 4, *[("n",)] * 2]
    assert (runner.suspends, runner.resumes, runner.parked_states) == (suspends, suspends, 0)
    expected = expected_images(req(num_steps=4, seed=3, tenant="heavy"))
    assert torch.equal(outputs[2].images, expected)


@pytest.mark.anyio
async def test_an_incompatible_batch_is_suspended_whole_or_not_at_all() -> None:
    """L61: a newcomer with another batch key starts only on an empty batch.

    A batch of "a" (priority 0) and "b" (priority 1) runs at 16x16; "big" (32x32,
    priority 1) does not outrank "b", so nothing is suspended. A second run with
    "b" at priority 0: both members are suspended and "big" runs alone first.
    """
    for b_priority, suspends in ((1, 0), (0, 2)):
        runner = RecordingRunner()
        with anyio.fail_after(BUDGET):
            async with ot.open_engine(runner, config(max_batch_size=4)) as engine:
                handles = [await opened(engine, runner)]
                handles += [
                    engine.submit(req(), request_id="a"),
                    engine.submit(req(priority=b_priority), request_id="b"),
                ]
                runner.release(1)
                await runner.wait_arrived(2)
                handles.append(
                    engine.submit(req(height=32, width=32, priority=1), request_id="big")
                )
                runner.open_gate()
                for handle in handles:
                    async with handle:
                        await handle.result()
        assert runner.suspends == suspends
        assert sorted(runner.batches[1]) == ["a", "b"]
        if suspends:
            assert runner.batches[2:5] == [("big",)] * 3
        else:
            assert runner.batches[2:4] == [("b", "a")] * 2


@pytest.mark.anyio
async def test_a_request_is_suspended_at_most_max_preemptions_times() -> None:
    """L61: after ``max_preemptions`` suspensions a request runs to its end.

    With ``max_preemptions=1``, "low" gives way to "high", then runs on past "h2",
    which waits for it.
    """
    runner = RecordingRunner()
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner, config(max_preemptions=1)) as engine:
            low, high = await low_suspended_for(
                engine, runner, req(num_steps=4), req(num_steps=1, priority=1)
            )
            runner.release(2)  # h1's step, then low's second
            await runner.wait_arrived(4)
            h2 = engine.submit(req(num_steps=1, priority=1), request_id="h2")
            runner.open_gate()
            for handle in (low, high, h2):
                async with handle:
                    await handle.result()
            assert engine.statistics().preemptions == 1
    assert runner.batches == [("low",), ("high",), ("low",), ("low",), ("low",), ("h2",)]


@pytest.mark.anyio
@pytest.mark.parametrize("how", ["abort", "close", "result_cancelled"])
async def test_ending_a_suspended_request_frees_its_state_at_once(how: str) -> None:
    """L61, L8: aborting a suspended request frees its parked state at once, undecoded.

    The worker is held in "high"'s step the whole time: no boundary comes, yet the
    abort returns with the state discarded (the materializer thread releases it).
    """
    runner = GatedRunner()
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner, config()) as engine:
            low, high = await low_suspended_for(engine, runner, req(num_steps=5), req(priority=1))
            if how == "abort":
                assert await engine.abort("low") is True
            elif how == "close":
                await low.aclose()
                await wait_until(lambda: low.status.is_terminal)
            else:
                with anyio.move_on_after(0):
                    await low.result()
            assert low.status is ot.RequestStatus.ABORTED
            assert runner.arrived == 2 and runner.live_states == 1
            assert runner.parked_states == 0 and runner.decodes == 0
            stats = engine.statistics()
            assert (stats.suspended, stats.waiting, stats.aborted) == (0, 0, 1)
            assert low.metrics is not None and low.metrics.preemptions == 1
            assert low.metrics.steps_after_abort == 0
            await low.aclose()
            runner.open_gate()
            async with high:
                await high.result()
        assert_nothing_left(engine, runner)


@pytest.mark.trio
async def test_a_suspended_request_expires_at_its_deadline(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """L61, L62: a suspended request whose deadline passes is aborted at once, undecoded."""
    runner = GatedRunner()
    async with ot.open_engine(runner, config()) as engine:
        # A deadline far longer than the virtual time the polls below can take.
        low, high = await low_suspended_for(
            engine, runner, req(num_steps=5, deadline_s=10_000), req(priority=1)
        )
        await trio.sleep(20_000)
        async with low:
            with pytest.raises(ot.RequestAbortedError) as info:
                await low.result()
        assert info.value.reason == "deadline"
        assert runner.arrived == 2 and runner.parked_states == 0 and runner.decodes == 0
        runner.open_gate()
        async with high:
            await high.result()
    assert_nothing_left(engine, runner)


@pytest.mark.anyio
async def test_shutdown_cuts_a_suspended_request_and_frees_it() -> None:
    """L61, L31, L35: shutdown ends a suspended request with EngineClosedError, freed."""
    runner = GatedRunner()
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner, config()) as engine:
            low, high = await low_suspended_for(engine, runner, req(num_steps=5), req(priority=1))
            async with anyio.create_task_group() as group:
                group.start_soon(engine.aclose)
                # Released while the worker is still held in "high"'s step.
                await wait_until(lambda: low.status.is_terminal)
                assert runner.arrived == 2 and runner.parked_states == 0
                runner.open_gate()
        for handle in (low, high):
            async with handle:
                with pytest.raises(ot.EngineClosedError):
                    await handle.result()
    assert runner.decodes == 0 and runner.parked_states == 0
    assert_nothing_left(engine, runner)


class RefusingRunner(GatedRunner):
    """Fails the suspension or the resumption of one request."""

    def __init__(self, call: str, **options: Any) -> None:
        super().__init__(**options)
        self.call = call

    def state_bytes(self, state: FakeState) -> int:
        """Fail when told to."""
        if self.call == "state_bytes":
            raise RuntimeError("cannot measure")
        return super().state_bytes(state)

    def suspend(self, state: FakeState, *, to_host: bool) -> None:
        """Fail when told to."""
        if self.call == "suspend":
            raise RuntimeError("cannot park")
        super().suspend(state, to_host=to_host)

    def resume(self, state: FakeState) -> None:
        """Fail when told to."""
        if self.call == "resume":
            raise RuntimeError("cannot resume")
        super().resume(state)


@pytest.mark.anyio
@pytest.mark.parametrize("call", ["state_bytes", "suspend", "resume"])
async def test_a_failed_suspend_or_resume_fails_that_request_only(call: str) -> None:
    """L61, L22: what ``state_bytes``/``suspend``/``resume`` raise fails the request to
    suspend; others go on."""
    runner = RefusingRunner(call)
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner, config()) as engine:
            low = engine.submit(req(num_steps=5), request_id="low")
            await runner.wait_arrived(1)
            high = engine.submit(req(priority=1), request_id="high")
            runner.open_gate()
            async with high:
                await high.result()
            async with low:
                with pytest.raises(ot.RequestFailedError) as info:
                    await low.result()
    assert f"{call}" in str(info.value)
    assert runner.live_states == 0 and runner.decodes == 1


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("runner_options", "config_options"),
    [
        ({"suspendable": False}, {}),
        ({}, {"preemption": False}),
        ({}, {"max_preemptions": 0}),
        ({}, {"max_parked_bytes": 0}),
    ],
    ids=["runner-not-suspendable", "preemption-off", "no-preemptions", "no-parked-bytes"],
)
async def test_without_preemption_the_newcomer_waits_for_the_batch(
    runner_options: dict[str, Any], config_options: dict[str, Any]
) -> None:
    """L61: a runner that cannot suspend, or a config that forbids it, is never preempted."""
    runner = RecordingRunner(**runner_options)
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner, config(**config_options)) as engine:
            low = engine.submit(req(), request_id="low")
            await runner.wait_arrived(1)
            high = engine.submit(req(priority=1), request_id="high")
            runner.open_gate()
            for handle in (low, high):
                async with handle:
                    await handle.result()
            assert engine.statistics().preemptions == 0
    assert runner.batches == [("low",)] * 3 + [("high",)] * 3
    assert runner.suspends == 0


class ParkRecordingRunner(GatedRunner):
    """Records where each suspension parked its state."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.to_host: list[bool] = []

    def suspend(self, state: FakeState, *, to_host: bool) -> None:
        """Record, then park."""
        self.to_host.append(to_host)
        super().suspend(state, to_host=to_host)


@pytest.mark.anyio
@pytest.mark.parametrize("park_on_host", [False, True])
async def test_park_on_host_and_the_parked_bytes_bound(park_on_host: bool) -> None:
    """L61: ``park_on_host`` reaches the runner; ``max_parked_bytes`` bounds what is parked.

    The bound is exactly one state's bytes: the first suspension fits, a second one
    (while the first is still parked) does not.
    """
    one_state = 4 * 2 * 2 * 4  # float32 latents [1, 4, 2, 2] of a 16x16 request
    runner = ParkRecordingRunner()
    options = config(park_on_host=park_on_host, max_parked_bytes=one_state, max_batch_size=1)
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner, options) as engine:
            low, mid = await low_suspended_for(
                engine, runner, req(num_steps=5), req(num_steps=3, priority=1)
            )
            assert probe_engine(engine).workers[0].parked_bytes == one_state
            top = engine.submit(req(num_steps=1, priority=2), request_id="top")
            runner.open_gate()
            for handle in (low, mid, top):
                async with handle:
                    await handle.result()
            assert engine.statistics().preemptions == 1
    assert runner.to_host == [park_on_host]


def test_suspendable_capabilities_are_checked() -> None:
    """L61: a whole-call runner cannot suspend; a batching one must take joins."""
    with pytest.raises(ValueError, match="suspendable"):
        RunnerCapabilities(whole_call=True, suspendable=True)
    with pytest.raises(ValueError, match="can_join"):
        RunnerCapabilities(max_batch_size=2, can_join=False, suspendable=True)
    RunnerCapabilities(max_batch_size=1, suspendable=True)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("preemption", 1),
        ("park_on_host", "yes"),
        ("tenant_preemption", "no"),
        ("max_preemptions", -1),
        ("max_preemptions", True),
        ("max_parked_bytes", -1),
        ("max_parked_bytes", 1.5),
    ],
)
def test_preemption_config_is_validated(field: str, value: object) -> None:
    """Bad preemption settings are refused, naming the field."""
    with pytest.raises(ValueError, match=field):
        ot.EngineConfig(**{field: value})  # type: ignore[arg-type]


@pytest.mark.anyio
async def test_a_suspended_requests_timeline_has_one_run_per_segment() -> None:
    """L61, L99: a request suspended once has two run segments in its timeline, in order,
    the wait between them; its last step ends the second; the high-priority request that
    suspended it ran once, inside that wait. A request aborted while it waited never ran.
    """
    runner = GatedRunner()
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner, config()) as engine:
            low, high = await low_suspended_for(
                engine, runner, req(num_steps=2), req(num_steps=1, priority=5)
            )
            runner.open_gate()
            async with low, high:
                await low.result()
                await high.result()
            waiting = engine.submit(req(num_steps=1, height=8, width=8), request_id="late")
            async with waiting:
                waiting.abort_nowait()
    assert low.metrics is not None and high.metrics is not None
    lows, highs = low.metrics.timeline, high.metrics.timeline
    assert lows is not None and highs is not None
    (first_start, first_end), (second_start, second_end) = lows.runs
    assert 0 <= first_start < first_end < second_start < second_end
    assert lows.denoised_s == second_end <= lows.ended_s
    [(high_start, high_end)] = highs.runs
    high_offset = (highs.admitted_ns - lows.admitted_ns) / 1e9
    # The clocks agree to rounding: the high request ran inside the low one's wait.
    assert first_end - 1e-3 <= high_start + high_offset <= high_end + high_offset
    assert high_end + high_offset <= second_start + 1e-3
    assert waiting.metrics is not None and waiting.metrics.timeline is not None
    assert waiting.metrics.timeline.runs == () and waiting.metrics.timeline.denoised_s is None
