"""Ring attention split by load (``by_load``) on two gloo ranks (L48).

Its own module: one group per process (torch.distributed's default group), and
test_by_load.py keeps a Ulysses group open for its whole module. Determinism: the
batch is driven directly (``batch_images_of``), so every call's rows are fixed.
"""

from __future__ import annotations

import pytest

from omni_trio.runners import DiffusersRunner
from tests.support.parallel import (
    Kept,
    batch_images_of,
    calls,
    close,
    group,
    outputs,
    report,
    same_states,
)
from tests.support.runners import request, tiny

pytestmark = pytest.mark.anyio


async def test_ring_by_load_equals_one_rank_both_ways() -> None:
    """L48: ring attention split by load makes one rank's images alone (by tokens, the
    ring's partial attentions) and batched (by rows, the ring switched off for the call),
    and leaves no state on any rank."""
    alone = [request("flux", seed=5)]
    batched = [*alone, request("flux", seed=6, prompt="a blue boat", num_images=2)]
    expected = await outputs(DiffusersRunner(tiny("flux")), batched)
    with group("flux", "ring", by_load=True) as runner:
        assert close(await outputs(Kept(runner), alone), expected[:1])
        assert close(batch_images_of(runner, batched), expected)
        steps = batched[0].denoise_steps
        assert await calls(runner) == {"rows": steps, "tokens": steps}
        reports = await report(runner)
        assert same_states(reports) and not reports[0].states
