"""A parallel group's weights updated in place (L102) and put to sleep (L103).

One group of tiny Flux over two Ulysses ranks (each rank's part of every attention
depends on its own weights, so one rank left on other weights changes the images).
Its images are compared with the single-process ``DiffusersRunner``'s on the same
weights, within the group's tolerance, and with its own earlier ones bitwise. An update
that rank 0 applies but rank 1 cannot (the file is gone when rank 1 reads it) is undone
on rank 0: the group's images stay those of the old weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from safetensors.torch import save_file

import omni_trio as ot
from omni_trio.runners import DiffusersRunner, tiny_pipeline
from tests.support.core import BUDGET
from tests.support.parallel import ATOL, close, group, images_of
from tests.support.runners import request

pytestmark = pytest.mark.anyio


def with_transformer_of(seed: int) -> Any:
    """A tiny Flux (seed 0) whose transformer is seed ``seed``'s."""
    base = tiny_pipeline("flux")
    return type(base)(
        **{**base.components, "transformer": tiny_pipeline("flux", seed=seed).transformer}
    )


async def test_a_groups_update_reaches_every_rank_or_none_and_sleeps_with_them(
    tmp_path: Path,
) -> None:
    """L102 (L49): an update on a parallel worker is applied on every rank or on none (rank
    1 failing leaves rank 0 reverted: the images are the old ones, bitwise); applied, the
    group makes the images of one process on the new weights; asleep and awake (L103)
    every rank gives the same images again."""
    new = {
        name: tensor.detach().contiguous()
        for name, tensor in tiny_pipeline("flux", seed=1).transformer.state_dict().items()
    }
    file, gone = tmp_path / "new.safetensors", tmp_path / "gone.safetensors"
    save_file(new, str(file))
    save_file(new, str(gone))
    r = request("flux", seed=3)
    with anyio.fail_after(4 * BUDGET), group("flux", "ulysses") as runner:
        async with ot.open_engine(runner) as engine:
            before = await engine.generate(r)
            rank_0 = runner._model
            own_update = rank_0.update_weights

            def update_then_remove(source: Any, *, key: str) -> None:
                own_update(source, key=key)
                gone.unlink()  # before any other rank reads it

            rank_0.update_weights = update_then_remove  # type: ignore[method-assign]
            try:
                with pytest.raises(ot.WeightsError, match="rank 1") as failed:
                    await engine.update_weights(gone)
            finally:
                del rank_0.update_weights
            assert failed.value.reason == "failed"
            assert engine.weight_version == ot.WeightVersion(number=0)
            assert torch.equal((await engine.generate(r)).images, before.images)
            assert await engine.update_weights(file) == ot.WeightVersion(number=1)
            updated = await engine.generate(r)
            report = await engine.sleep(1)
            assert report.offloaded_bytes > 0
            await engine.wake()
            woken = await engine.generate(r)
    one = DiffusersRunner(with_transformer_of(1))
    assert close([updated.images], [images_of(one, r)])
    assert not torch.allclose(updated.images, before.images, atol=10 * ATOL, rtol=0)
    assert torch.equal(woken.images, updated.images)
    assert woken.weight_version == ot.WeightVersion(number=1)
