"""Ring sequence parallel on two gloo ranks, and what closing a group leaves: nothing
(L41, L48, L49).

Determinism: seeded weights and seeds; processes and sockets read from /proc.
"""

from __future__ import annotations

import os
import threading

import pytest

from omni_trio.parallel._start import KEEPER
from omni_trio.runners import DiffusersRunner
from tests.support.parallel import (
    cached_like_one_rank,
    children,
    close,
    group,
    guided_requests,
    listening,
    loopback,
    new_children,
    outputs,
)
from tests.support.runners import tiny

pytestmark = pytest.mark.anyio


def keepers() -> list[threading.Thread]:
    """The rank keepers' threads alive now."""
    return [thread for thread in threading.enumerate() if thread.name.startswith(KEEPER)]


async def test_ring_equals_one_rank_and_the_engine_reaps_every_rank() -> None:
    """L48, L41, L49: tiny Flux over two ring ranks makes one rank's images; while it
    serves, every socket the group listens on is on loopback; the engine's close closes
    the runner: its ranks are reaped (no child left, not even a zombie), its keeper
    thread joined, and nothing it opened listens any more."""
    requests = guided_requests("flux")
    expected = await outputs(DiffusersRunner(tiny("flux")), requests)
    before = children()
    listening_before = set(listening([os.getpid()]))
    with group("flux", "ring") as runner:
        ranks = set(runner.pids)
        assert len(ranks) == 1 and ranks <= children()
        addresses = listening([os.getpid(), *ranks])
        assert addresses and all(loopback(address) for address in addresses), addresses
        assert close(await outputs(runner, requests), expected)
        # The engine closed the runner as it closed: everything is gone already.
        assert not ranks & children()
        assert not new_children(before)
        assert not keepers()
        assert set(listening([os.getpid()])) <= listening_before


async def test_a_cached_request_on_two_ring_ranks_skips_where_one_rank_does() -> None:
    """L49 (L81): step caching on the ring split, as on Ulysses: every rank decides from
    the group's sums, so the skip patterns and the images are one rank's."""
    with group("flux", "ring") as runner:
        await cached_like_one_rank(runner, "flux")
