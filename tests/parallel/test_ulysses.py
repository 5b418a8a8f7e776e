"""Ulysses sequence parallel on two gloo ranks, through diffusers' context parallelism
(L40, L48, L49).

Determinism: as test_split.py (seeded weights, seeded abort moments, a gate where an
abort must land inside a step, exact checks against one rank's images and the ranks'
state digests). One Ulysses group on tiny Flux serves the module (``Kept``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anyio
import pytest
import torch

import omni_trio as ot
from omni_trio.parallel import ParallelRunner
from omni_trio.runners import DiffusersRunner
from tests.support.core import BUDGET
from tests.support.parallel import (
    Kept,
    abort_inside_a_step,
    cached_like_one_rank,
    capabilities_of,
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
def ulysses() -> Iterator[ParallelRunner]:
    """Tiny Flux over two Ulysses ranks, for the whole module."""
    with group("flux", "ulysses") as runner:
        yield runner


async def test_ulysses_equals_one_rank(ulysses: ParallelRunner) -> None:
    """L48: tiny Flux over two Ulysses ranks, alone and batched, makes one rank's images;
    its image sizes must divide into the ranks' tokens (the size multiple doubles)."""
    requests = guided_requests("flux")
    expected = await outputs(DiffusersRunner(tiny("flux")), requests)
    assert close(await outputs(Kept(ulysses), requests[:1]), expected[:1])
    assert close(await outputs(Kept(ulysses), requests), expected)
    assert ulysses.capabilities.size_multiple == 2 * capabilities_of("flux").size_multiple


async def test_a_cached_request_on_two_ulysses_ranks_skips_where_one_rank_does(
    ulysses: ParallelRunner,
) -> None:
    """L49 (L81): step caching on a token split: each rank's head sees a slice of every
    row's tokens, the ranks add their sums before each first-block decision, and every
    rank skips the same calls: the skip patterns are one rank's, alone and batched with a
    TaylorSeer request and an uncached one, and so are the images."""
    assert ulysses.capabilities.step_cache == capabilities_of("flux").step_cache
    await cached_like_one_rank(ulysses, "flux")


def loosened_run(runner: Any, r: ot.GenerationRequest) -> tuple[torch.Tensor, Any]:
    """``r`` stepped alone, its threshold loosened to 0.46 before its fourth step: its
    image and its cache's metrics."""
    state = runner.prepare(r, "loosened")
    try:
        for step in range(r.denoise_steps):
            if step == 3:
                runner.set_cache_threshold(state, 0.46)
            runner.step([state])
        return runner.decode(state).float().cpu(), runner.cache_metrics(state)
    finally:
        runner.discard(state)


async def test_a_loosened_threshold_reaches_every_rank(ulysses: ParallelRunner) -> None:
    """L49 (L84): the engine loosening a request's threshold (deadline at risk) on a
    parallel worker loosens it on every rank before the next step: the ranks skip alike
    from there (else their collectives would part), as one rank does."""
    policy = ot.StepCache(kind="first-block", threshold=0.2, max_threshold=0.5)
    r = request("flux", seed=3, num_steps=10, cache=policy)
    single = DiffusersRunner(tiny("flux"))
    try:
        expected, metrics = loosened_run(single, r)
    finally:
        single.close()
    assert metrics.loosened and metrics.calls_skipped > 0
    got, ours = loosened_run(ulysses, r)
    assert close([got], [expected]) and ours == metrics
    assert same_states(await report(ulysses))


async def test_a_parallel_worker_refuses_checkpoints(ulysses: ParallelRunner) -> None:
    """L49 (L78): a parallel worker declares no checkpoints, where one rank of the same
    model takes them: a checkpointed request is refused at admission naming
    ``checkpoint``; the group serves on."""
    assert capabilities_of("flux").checkpoints
    assert not ulysses.capabilities.checkpoints
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(Kept(ulysses)) as engine:
            with pytest.raises(ot.InvalidRequestError) as checkpoint:
                policy = ot.CheckpointPolicy(every_s=1.0, sink=lambda checkpoint: None)
                engine.submit(request("flux"), checkpoint=policy)
            assert engine.statistics().admitted == 0
    assert checkpoint.value.field == "checkpoint"


async def test_random_aborts_leave_every_ulysses_rank_equal(ulysses: ParallelRunner) -> None:
    """L40, L48: requests aborted at random moments, inside a step too (where the ranks,
    which exchange tokens in every block, leave one block later, at the point rank 0
    announced): no rank hangs or keeps a state; the next request's states are bitwise
    equal on every rank and its image is one rank's."""
    await random_aborts_then_one(ulysses, "flux", aborts=8, seed=2541, pause_s=0.02)


async def test_an_abort_inside_a_ulysses_step_leaves_it_at_the_announced_block(
    ulysses: ParallelRunner,
) -> None:
    """L48 (L71): aborted while rank 0 embeds the input of its second step (the other rank
    waits in the first block's exchange), rank 0 sees it at the first cancel point and
    announces the second: every rank leaves the step there, before the second block. The
    step is not counted, no rank keeps a state, the next request makes one rank's image.
    (Tiny Flux has two blocks: an abort seen at the second would let the step finish.)
    """
    after = request("flux", seed=21, prompt="after")
    [expected] = await outputs(DiffusersRunner(tiny("flux")), [after])
    embedder = ulysses.pipeline.transformer.x_embedder
    with anyio.fail_after(BUDGET):
        steps = await abort_inside_a_step(ulysses, embedder, request("flux", seed=20, num_steps=6))
        assert steps == 1
        reports = await report(ulysses)
        assert same_states(reports) and not reports[0].states
        assert close(await outputs(Kept(ulysses), [after]), [expected])
