"""Sequence parallel split by load (``by_load``) on two gloo ranks (L40, L48, L49).

A call with a row per rank or more (a request of two images, a batch) runs whole rows
on each rank, with no token exchange; a call of one row runs by tokens (Ulysses). The
way is chosen call by call, alike on every rank, so it changes at step boundaries as
requests join and leave; each rank counts its calls each way (``RankReport.calls``).

Determinism: as test_split.py and test_ulysses.py (seeded weights, seeded abort
moments, a gate where an abort must land inside a step, a held worker where a request
must join at a known step; exact checks against one rank's images, the ranks' state
digests and their call counts). One group on tiny Flux serves the module (``Kept``).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

import anyio
import pytest

import omni_trio as ot
from omni_trio.parallel import ParallelRunner
from omni_trio.runners import DiffusersRunner, tiny_pipeline
from tests.support.core import BUDGET
from tests.support.parallel import (
    Kept,
    abort_inside_a_step,
    batch_images_of,
    calls,
    capabilities_of,
    close,
    group,
    joined_at,
    outputs,
    random_aborts_then_one,
    report,
    same_states,
)
from tests.support.runners import request, tiny

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def by_load() -> Iterator[ParallelRunner]:
    """Tiny Flux over two Ulysses ranks split by load, for the whole module."""
    with group("flux", "ulysses", by_load=True) as runner:
        yield runner


def moved(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {way: after[way] - before[way] for way in ("rows", "tokens")}


async def test_by_load_equals_one_rank_by_tokens_alone_and_by_rows_batched(
    by_load: ParallelRunner,
) -> None:
    """L48: split by load, a one-image request alone runs every call by tokens, and with a
    request of two images beside it every call by rows; both make one rank's images."""
    alone = [request("flux", seed=3)]
    batched = [*alone, request("flux", seed=4, prompt="a blue boat", num_images=2)]
    expected = await outputs(DiffusersRunner(tiny("flux")), batched)
    start = await calls(by_load)
    assert close(await outputs(Kept(by_load), alone), expected[:1])
    middle = await calls(by_load)
    assert moved(start, middle) == {"rows": 0, "tokens": alone[0].denoise_steps}
    assert close(batch_images_of(by_load, batched), expected)
    assert moved(middle, await calls(by_load)) == {"rows": batched[0].denoise_steps, "tokens": 0}
    assert same_states(await report(by_load))


async def test_the_way_changes_at_the_boundaries_where_a_request_joins_and_leaves(
    by_load: ParallelRunner,
) -> None:
    """L40, L49: a request runs alone by tokens, a second joins it at a known boundary and
    the pair runs by rows until the second finishes, then the first runs on alone by
    tokens: every rank counts exactly those calls each way, and both images are one
    rank's."""
    long = request("flux", seed=1, num_steps=10)
    joining = request("flux", seed=2, prompt="a cat")
    expected = await outputs(DiffusersRunner(tiny("flux")), [long, joining])
    start = await calls(by_load)
    # joining is queued before long's third step, and joins it there.
    got = [o.images for o in await joined_at(by_load, long, joining, after=2, batch=4)]
    assert close(got, expected)
    together = joining.denoise_steps
    assert moved(start, await calls(by_load)) == {
        "rows": together,
        "tokens": long.denoise_steps - together,
    }
    reports = await report(by_load)
    assert same_states(reports) and not reports[0].states


async def test_an_abort_inside_a_step_by_rows_leaves_it_on_every_rank(
    by_load: ParallelRunner,
) -> None:
    """L48 (L71): a request of two images (a call by rows) aborted while rank 0 embeds the
    input of its second step: every rank leaves that step at one point (the rows' agreed
    cancel point), uncounted; no rank keeps a state; the next request makes one rank's
    image."""
    after = request("flux", seed=21, prompt="after")
    [expected] = await outputs(DiffusersRunner(tiny("flux")), [after])
    embedder = by_load.pipeline.transformer.x_embedder
    first = request("flux", seed=20, num_steps=6, num_images=2)
    with anyio.fail_after(BUDGET):
        before = await calls(by_load)
        assert await abort_inside_a_step(by_load, embedder, first) == 1
        assert moved(before, await calls(by_load)) == {"rows": 2, "tokens": 0}
        reports = await report(by_load)
        assert same_states(reports) and not reports[0].states
        assert close(await outputs(Kept(by_load), [after]), [expected])


async def test_random_aborts_by_rows_and_by_tokens_leave_every_rank_equal(
    by_load: ParallelRunner,
) -> None:
    """L40, L48: requests of one image (by tokens) and of two (by rows) aborted in turn at
    random moments: no rank hangs or keeps a state, the ranks agree on every call's way,
    and the next request's states are bitwise equal on every rank, its image one rank's."""
    await random_aborts_then_one(by_load, "flux", aborts=8, seed=2542, pause_s=0.02, images=(1, 2))
    await calls(by_load)


def test_by_load_takes_a_bool_with_a_sequence_layout_only() -> None:
    """L48: ``by_load`` with the guidance split (which already cuts every call by rows), or
    not a bool, is refused before any rank starts."""
    factory = functools.partial(tiny_pipeline, "flux")
    with pytest.raises(ValueError, match="only with ulysses or ring"):
        ParallelRunner(factory, cfg=2, by_load=True)
    with pytest.raises(ValueError, match="by_load: must be a bool"):
        ParallelRunner(factory, ulysses=2, by_load=1)  # type: ignore[arg-type]


async def test_a_worker_split_by_load_refuses_step_caching(by_load: ParallelRunner) -> None:
    """L49 (L80): split by load, a call of a batch runs a slice of the rows on each rank,
    where a row's cache would live on one rank and move with the batch: a cached request
    is refused at admission naming ``cache``, where one rank (and the same layout always
    by tokens) would cache it; the group serves on."""
    assert "first-block" in capabilities_of("flux").step_cache
    assert not by_load.capabilities.step_cache
    cached = request("flux", cache=ot.StepCache(kind="first-block", threshold=0.4))
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(Kept(by_load)) as engine:
            with pytest.raises(ot.InvalidRequestError) as refused:
                engine.submit(cached)
            assert engine.statistics().admitted == 0
    assert refused.value.field == "cache"
