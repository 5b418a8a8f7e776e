"""Groups of samples of one prompt (L101): one call, G requests of their own.

- a group's samples are requests with seeds derived from the group's (or given), all
  submitted before any wait, so they share the worker's batch;
- one sample aborted by its id leaves the others running: the result reports that
  sample aborted, with its reason, the others completed, and pads nothing;
- samples refused at admission (a full queue), aborted at their deadline, or cancelled
  with the caller are each reported as such;
- the group's arguments are checked by name.

Determinism: ``GatedRunner`` (a fake) holds the worker at a step until the test
releases it, so where an abort or a join lands needs no timing; the deadline test runs
on trio's virtual clock (``autojump_clock``). The fake's images depend on the request
alone, so a sample's output is compared to the same request run alone.
"""

from __future__ import annotations

import anyio
import pytest
import torch
import trio
import trio.testing

import omni_trio as ot
from omni_trio._groups import MAX_GROUP_SIZE
from omni_trio.testing import GatedRunner, probe_engine, wait_until
from tests.support.core import BUDGET, req, solo_images


@pytest.mark.anyio
async def test_a_groups_samples_are_requests_of_derived_seeds_that_share_a_batch() -> None:
    """L101: a group of 4 is 4 requests ``"g/0"`` to ``"g/3"`` with the seeds
    ``group_seeds`` derives from the request's, all in the second step's batch at the
    latest (the worker may take the first before the others are admitted); each output
    is its request's alone."""
    runner = GatedRunner()
    request = req(seed=7, num_steps=3)
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner) as engine:
            async with anyio.create_task_group() as group:
                found: list[ot.GroupResult] = []

                async def run() -> None:
                    found.append(await ot.generate_group(engine, request, n=4, group_id="g"))

                group.start_soon(run)
                await runner.wait_arrived(1)
                runner.release(1)
                await runner.wait_arrived(2)
                assert engine.statistics().workers[0].running == 4
                runner.open_gate()
    result = found[0]
    seeds = ot.group_seeds(7, 4)
    assert len(set(seeds)) == 4 and all(0 <= seed < 2**63 for seed in seeds)
    assert (result.group_id, result.seed, result.is_partial) == ("g", 7, False)
    assert [s.request_id for s in result.samples] == ["g/0", "g/1", "g/2", "g/3"]
    assert [s.seed for s in result.samples] == list(seeds)
    for sample in result.samples:
        assert sample.outcome == "completed" and sample.output is not None
        expected = solo_images(req(seed=sample.seed, num_steps=3))
        assert torch.equal(sample.output.images, expected)
    assert len(result.outputs) == 4


@pytest.mark.anyio
async def test_a_partial_group_reports_its_aborted_sample_and_pads_nothing() -> None:
    """L101: one sample aborted by its id mid-way ends alone: the others complete, the
    result is partial, names the aborted sample and its reason, and holds three outputs,
    no stand-in for the fourth."""
    runner = GatedRunner()
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner) as engine:
            async with anyio.create_task_group() as group:
                found: list[ot.GroupResult] = []

                async def run() -> None:
                    found.append(await ot.generate_group(engine, req(seed=3), n=4, group_id="g"))

                group.start_soon(run)
                await runner.wait_arrived(1)
                assert engine.abort_nowait("g/1") is True
                runner.open_gate()
            stats = engine.statistics()
    result = found[0]
    assert result.is_partial
    assert [s.outcome for s in result.samples] == ["completed", "aborted", "completed", "completed"]
    aborted = result.samples[1]
    assert (aborted.reason, aborted.output) == ("user", None)
    assert isinstance(aborted.error, ot.RequestAbortedError)
    assert [s.index for s in result.completed] == [0, 2, 3]
    assert len(result.outputs) == 3
    for sample in result.completed:
        assert sample.output is not None
        assert torch.equal(sample.output.images, solo_images(req(seed=sample.seed)))
    assert (stats.completed, stats.aborted) == (3, 1)


@pytest.mark.anyio
async def test_samples_refused_at_admission_are_reported_and_the_first_raises() -> None:
    """L101: with a full queue, the samples past its bound are reported refused (the
    error ``submit`` raised), those admitted run; a group whose first sample is refused
    raises, admitting nothing."""
    runner = GatedRunner()
    options = ot.EngineConfig(max_batch_size=1, max_waiting=2)
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner, options) as engine:
            busy = engine.submit(req(seed=1), request_id="busy")
            await runner.wait_arrived(1)
            async with anyio.create_task_group() as group:
                found: list[ot.GroupResult] = []

                async def run() -> None:
                    found.append(await ot.generate_group(engine, req(seed=5), n=4, group_id="g"))

                group.start_soon(run)
                await wait_until(lambda: engine.statistics().admitted == 3)
                with pytest.raises(ot.QueueFullError):
                    await ot.generate_group(engine, req(seed=6), n=2, group_id="h")
                assert engine.statistics().admitted == 3
                runner.open_gate()
            async with busy:
                await busy.result()
    result = found[0]
    assert [s.outcome for s in result.samples] == ["completed", "completed", "refused", "refused"]
    assert all(isinstance(s.error, ot.QueueFullError) for s in result.samples[2:])
    assert len(result.outputs) == 2


@pytest.mark.trio
async def test_each_sample_keeps_the_requests_deadline(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """L101, L62: every sample is held to the request's deadline on its own: two waiting
    behind a busy worker are aborted at it (reason ``"deadline"``), reported so."""
    runner = GatedRunner()
    async with ot.open_engine(runner, ot.EngineConfig(max_batch_size=1)) as engine:
        busy = engine.submit(req(seed=1), request_id="busy")
        await runner.wait_arrived(1)
        start = trio.current_time()
        result = await ot.generate_group(engine, req(seed=2, deadline_s=100), n=2)
        assert trio.current_time() - start == pytest.approx(100)
        runner.open_gate()
        async with busy:
            await busy.result()
    assert [(s.outcome, s.reason) for s in result.samples] == [("aborted", "deadline")] * 2
    assert result.outputs == ()


@pytest.mark.anyio
async def test_cancelling_the_caller_aborts_every_live_sample() -> None:
    """L101, L11: the caller cancelled, every sample is aborted (reason ``"cancelled"``)
    and released before the call returns; nothing of the group stays live."""
    runner = GatedRunner()
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner) as engine:

            def all_cut() -> bool:
                live = probe_engine(engine).requests
                return len(live) == 3 and all(p.cancel_reason == "cancelled" for p in live)

            async def release_once_cut() -> None:
                await wait_until(all_cut)  # the step held in flight ends only then
                runner.open_gate()

            async def run() -> None:
                await ot.generate_group(engine, req(seed=4), n=3, group_id="g")

            async with anyio.create_task_group() as outer:
                with anyio.CancelScope() as scope:
                    async with anyio.create_task_group() as group:
                        group.start_soon(run)
                        await runner.wait_arrived(1)
                        outer.start_soon(release_once_cut)
                        scope.cancel()
            assert scope.cancelled_caught
            stats = engine.statistics()
            assert (stats.aborted, stats.running, stats.waiting) == (3, 0, 0)
            assert runner.live_states == 0


@pytest.mark.anyio
async def test_a_groups_arguments_are_checked_by_name() -> None:
    """L101: ``n`` or ``seeds`` (of the same count where both are given), a valid group id;
    given seeds are used as they are; without a seed the group draws one and says so."""
    runner = GatedRunner()
    runner.open_gate()
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner) as engine:
            cases: list[tuple[dict[str, object], str]] = [
                ({}, "n"),
                ({"n": 0}, "n"),
                ({"n": MAX_GROUP_SIZE + 1}, "n"),
                ({"seeds": []}, "seeds"),
                ({"seeds": [1, -1]}, "seeds"),
                ({"seeds": "12"}, "seeds"),
                ({"seeds": [1, 2], "n": 3}, "n"),
                ({"n": 2, "group_id": ""}, "request_id"),
            ]
            for arguments, field in cases:
                with pytest.raises(ot.InvalidRequestError) as info:
                    await ot.generate_group(engine, req(), **arguments)  # type: ignore[arg-type]
                assert info.value.field == field, arguments
            given = await ot.generate_group(engine, req(seed=1), seeds=[11, 12])
            assert given.seed is None and [s.seed for s in given.samples] == [11, 12]
            drawn = await ot.generate_group(engine, req(seed=None), n=2)
            assert drawn.seed is not None
            assert [s.seed for s in drawn.samples] == list(ot.group_seeds(drawn.seed, 2))
            assert given.group_id != drawn.group_id
            assert engine.statistics().admitted == 4
