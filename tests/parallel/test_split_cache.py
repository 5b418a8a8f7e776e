"""Step caching on the guidance split (L49, L81): whole caches on every rank, exchanged.

Each rank of the split runs a slice of a call's rows and decides for those rows alone;
after each call every rank sends the others its slice's cache updates (a decision per
row, and a computed row's residuals), so every rank holds every row's cache as one
process would, and a row that moves to another rank (the batch changed) finds its
cache there. One group of tiny SD3 (a DiT that guides: two rows per request) serves
the module (``Kept``). Checked: the skip patterns (``RequestMetrics.cache``) against
one process's, the images within ``ATOL``, and the ranks' states bitwise equal.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import omni_trio as ot
from omni_trio.parallel import ParallelRunner
from omni_trio.runners import DiffusersRunner
from tests.support.parallel import Kept, close, group, joined_at, report, results, same_states
from tests.support.runners import request, tiny

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def split() -> Iterator[ParallelRunner]:
    """Tiny SD3 over two ranks of the guidance split, for the whole module."""
    with group("sd3", "cfg") as runner:
        yield runner


def first_block(threshold: float) -> ot.StepCache:
    return ot.StepCache(kind="first-block", threshold=threshold)


async def test_a_cached_request_on_the_split_skips_where_one_rank_does(
    split: ParallelRunner,
) -> None:
    """L49 (L81): a guided request with a first-block cache on the split (its
    unconditional row on rank 0, its conditional row on rank 1, each deciding for its
    own) skips the calls one process skips, row by row, and makes its image (tiny SD3's
    ratios are 0.2-0.5 a step: both thresholds skip)."""
    for threshold in (0.3, 0.4):
        r = request("sd3", seed=3, num_steps=10, cache=first_block(threshold))
        [expected] = await results(DiffusersRunner(tiny("sd3")), [r])
        [got] = await results(Kept(split), [r])
        assert got.metrics.cache == expected.metrics.cache
        assert expected.metrics.cache is not None and expected.metrics.cache.calls_skipped > 0
        assert close([got.images], [expected.images])
    reports = await report(split)
    assert same_states(reports) and not reports[0].states


async def test_cached_rows_that_move_between_ranks_keep_their_caches(
    split: ParallelRunner,
) -> None:
    """L49 (L81, L82): a cached request runs alone (a row on each rank), a second joins it
    at a known boundary (now the first request's rows are both on rank 0, the second's on
    rank 1) and leaves before it: each row finds its cache on whichever rank runs it, so
    both requests skip exactly as each does alone in one process, and make their images;
    every rank's states stay bitwise equal."""
    long = request("sd3", seed=1, num_steps=12, cache=first_block(0.4))
    joining = request(
        "sd3", seed=2, prompt="a cat", num_steps=5, cache=ot.StepCache(kind="taylorseer")
    )
    alone = [(await results(DiffusersRunner(tiny("sd3")), [r]))[0] for r in (long, joining)]
    # joining is queued before long's fourth step, and joins it there.
    got = await joined_at(split, long, joining, after=3, batch=2)
    assert [g.metrics.cache for g in got] == [e.metrics.cache for e in alone]
    assert close([g.images for g in got], [e.images for e in alone])
    reports = await report(split)
    assert same_states(reports) and not reports[0].states
