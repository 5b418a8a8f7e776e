"""The classifier-free-guidance split on two gloo ranks (L40, L48, L49).

Determinism: the tiny pipelines have seeded weights; where an abort lands is drawn
from a seeded generator (a step event, then a pause inside the next step), and
every check is of exact things: images against the single-process runner's (float
tolerance), the ranks' state digests (``ParallelRunner.report``: bitwise), statuses
and counts. One group serves the whole module (``Kept``): a group's start costs a
model load per rank. Both ranks use one torch thread.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import anyio
import pytest
import torch

import omni_trio as ot
from omni_trio.parallel import ParallelRunner
from omni_trio.runners import DiffusersRunner
from omni_trio.testing import probe, wait_until
from tests.support.core import BUDGET
from tests.support.parallel import (
    Kept,
    abort_inside_a_step,
    close,
    group,
    guided_requests,
    outputs,
    random_aborts_then_one,
    report,
    same_states,
)
from tests.support.runners import request, tiny

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def split() -> Iterator[ParallelRunner]:
    """Tiny SD over two ranks, for the whole module."""
    with group("sd", "cfg") as runner:
        yield runner


SD_REQUESTS = guided_requests("sd")


async def test_a_split_request_equals_the_single_process_runner(split: ParallelRunner) -> None:
    """L48: alone and batched, a request split over two ranks (its unconditional rows on
    one, its conditional rows on the other) makes the single-process runner's images."""
    expected = await outputs(DiffusersRunner(tiny("sd")), SD_REQUESTS)
    assert close(await outputs(Kept(split), SD_REQUESTS[:1]), expected[:1])
    assert close(await outputs(Kept(split), SD_REQUESTS), expected)
    assert same_states(await report(split))


async def test_reports_agree_while_rank_0_joins_and_drops_requests(
    split: ParallelRunner,
) -> None:
    """L40: reports read while another thread joins and drops requests on rank 0 name the
    same states on every rank, each time. (Rank 0's live states, and the drops queued for
    the other ranks, changed outside the lock a report reads them under: a report once
    failed with "dictionary changed size during iteration".)"""

    def churn(stop: threading.Event) -> int:
        joined = 0
        while not stop.is_set() or joined < 20:
            split.discard(split.prepare(request("sd", seed=joined), f"churn{joined}"))
            joined += 1
        return joined

    stop = threading.Event()
    with anyio.fail_after(BUDGET):
        async with anyio.create_task_group() as tg:
            tg.start_soon(anyio.to_thread.run_sync, churn, stop)
            agreed = [same_states(await report(split)) for _ in range(40)]
            stop.set()
    assert agreed == [True] * 40
    reports = await report(split)
    assert same_states(reports) and not reports[0].states


async def test_requests_join_and_leave_across_ranks(split: ParallelRunner) -> None:
    """L40, L49: a request joins a running one mid-way, a third is aborted mid-way: every
    rank holds exactly the live requests, bitwise equal, at every step the test looks;
    the finished ones make the single-process images; no state is left on any rank."""
    long = request("sd", seed=1, num_steps=8)
    joining = request("sd", seed=2, prompt="a cat")
    aborted = request("sd", seed=3, prompt="a dog", num_steps=8)
    expected = await outputs(DiffusersRunner(tiny("sd")), [long, joining])
    with anyio.fail_after(BUDGET):
        kept = Kept(split)
        async with ot.open_engine(kept, ot.EngineConfig(max_batch_size=4)) as engine:
            a = engine.submit(long, request_id="long")
            async with kept.held(lambda steps: steps.get("long", 0) >= 2):
                b = engine.submit(joining, request_id="joining")
                c = engine.submit(aborted, request_id="aborted")
            async with kept.held(
                lambda steps: min(steps.get("joining", 0), steps.get("aborted", 0)) >= 1
            ):
                reports = await report(split)
                assert same_states(reports)
                assert set(reports[0].states) == {"long", "joining", "aborted"}
            await c.abort()
            reports = await report(split)
            assert same_states(reports)
            assert set(reports[0].states) <= {"long", "joining"}
            got = []
            for handle in (a, b):
                async with handle:
                    got.append((await handle.result()).images)
            async with c:
                pass
    assert close(got, expected)
    reports = await report(split)
    assert same_states(reports) and not reports[0].states


async def test_twenty_random_aborts_leave_every_rank_equal(split: ParallelRunner) -> None:
    """L40, L48: twenty requests aborted at random moments (at a step boundary or inside
    a step, where the ranks leave at one agreed cancel point): no rank hangs, none keeps
    a state, and the next request runs with bitwise equal states on every rank and makes
    the single-process image."""
    await random_aborts_then_one(split, "sd", aborts=20, seed=2540, pause_s=0.03)


async def test_a_preempted_request_parks_on_every_rank_and_resumes_exactly(
    split: ParallelRunner,
) -> None:
    """L49 (L61): a low-priority request suspended for a high-priority one stays parked on
    every rank, equal, and resumes to bitwise the image it makes uninterrupted."""
    low = request("sd", seed=11, prompt="low", num_steps=6)
    high = request("sd", seed=12, prompt="high", num_steps=8, priority=1)
    config = ot.EngineConfig(max_batch_size=1)
    with anyio.fail_after(BUDGET):
        kept = Kept(split)
        async with ot.open_engine(kept, config) as engine:
            uninterrupted = (await engine.generate(low)).images
            a = engine.submit(low, request_id="low")
            async with kept.held(lambda steps: steps.get("low", 0) >= 2):
                b = engine.submit(high, request_id="high")
            async with kept.held(lambda steps: steps.get("high", 0) >= 1):
                assert a.status is ot.RequestStatus.WAITING
                reports = await report(split)
                assert same_states(reports) and set(reports[0].states) == {"low", "high"}
            async with b:
                await b.result()
            async with a:
                resumed = await a.result()
    assert resumed.metrics.preemptions == 1
    assert torch.equal(resumed.images, uninterrupted)


async def test_deadlines_and_shutdown_stop_every_rank(split: ParallelRunner) -> None:
    """L49: a running request whose deadline passes, and one that shutdown cuts, stop on
    every rank: nothing decoded, no state left on any rank."""
    config = ot.EngineConfig(shutdown_grace=0.0)
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(Kept(split), config) as engine:
            late = engine.submit(request("sd", num_steps=200, deadline_s=0.5), request_id="late")
            async with late:
                with pytest.raises(ot.RequestAbortedError) as aborted:
                    await late.result()
            assert aborted.value.reason == "deadline"
            cut = engine.submit(request("sd", num_steps=200), request_id="cut")
            await wait_until(lambda: probe(cut).steps_done >= 1)
        async with cut:
            with pytest.raises(ot.EngineClosedError):
                await cut.result()
    reports = await report(split)
    assert same_states(reports) and not reports[0].states


async def test_an_abort_inside_a_step_leaves_it_on_every_rank_at_one_point(
    split: ParallelRunner,
) -> None:
    """L48 (L71): aborted while rank 0 is inside a block of its second step, the request's
    step is left at the next cancel point by every rank (agreed, no rank waits for
    another): that step is not counted, no rank keeps its state, and the next request
    makes the single-process image."""
    after = request("sd", seed=21, prompt="after")
    [expected] = await outputs(DiffusersRunner(tiny("sd")), [after])
    with anyio.fail_after(BUDGET):
        steps = await abort_inside_a_step(
            split, split.pipeline.unet.down_blocks[0], request("sd", seed=20, num_steps=6)
        )
        assert steps == 1
        reports = await report(split)
        assert same_states(reports) and not reports[0].states
        assert close(await outputs(Kept(split), [after]), [expected])
