"""Adapters (LoRA) on a parallel worker: loaded on every rank, per row in both ways (L49).

One group of tiny Flux over two Ulysses ranks split by load serves the module
(``Kept``): a request alone runs by tokens (every rank every row, its adapters the
call's), a batch runs by rows (each rank its slice of the rows, with those rows'
adapters). Every image is compared with the single-process ``DiffusersRunner``'s with
the same files loaded (which tests/runners/test_adapters.py compares with the
pipeline's own ``set_adapters`` call); every rank's adapters (``RankReport.adapters``:
loaded or evicted, holders) must be the same. The LoRAs are tiny and random
(``omni_trio.runners.tiny_lora``). A load on a group whose rank died is in
tests/parallel/test_faults.py, which starts a group per case.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

import omni_trio as ot
from omni_trio.parallel import ParallelRunner
from omni_trio.runners import DiffusersRunner, tiny_lora
from tests.support.core import BUDGET
from tests.support.parallel import (
    ATOL,
    Kept,
    abort_inside_a_step,
    calls,
    close,
    group,
    outputs,
    report,
    same_states,
)
from tests.support.runners import request, tiny

pytestmark = pytest.mark.anyio

#: The files: (name, seed, rank).
LORAS = (("ink", 1, 4), ("film", 2, 8), ("dust", 3, 4))


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("loras")
    return {
        name: tiny_lora(tiny("flux"), folder, name, seed=seed, rank=rank)
        for name, seed, rank in LORAS
    }


@pytest.fixture(scope="module")
def by_load() -> Iterator[ParallelRunner]:
    """Tiny Flux over two Ulysses ranks split by load, at most two adapters loaded."""
    with group("flux", "ulysses", by_load=True, max_loaded_adapters=2) as runner:
        yield runner


@pytest.fixture
def loaded(by_load: ParallelRunner, files: dict[str, Path]) -> Iterator[ParallelRunner]:
    """The group with ``ink`` and ``film`` loaded; every adapter unloaded after."""
    for name in ("ink", "film"):
        by_load.load_adapter(name, files[name])
    yield by_load
    for name in sorted(by_load.adapter_names()):
        by_load.unload_adapter(name)


async def expected_of(files: dict[str, Path], requests: list[ot.GenerationRequest]) -> Any:
    """The single-process runner's images, with the files the requests name loaded."""
    runner = DiffusersRunner(tiny("flux"))
    try:
        for name in sorted({name for r in requests for name, _ in r.adapter_pairs}):
            runner.load_adapter(name, files[name])
        return await outputs(runner, requests)
    finally:
        runner.close()


def ranks_agree(reports: Any) -> bool:
    """Every rank holds the same states and knows the same adapters, alike."""
    return same_states(reports) and all(r.adapters == reports[0].adapters for r in reports)


async def resident(runner: ParallelRunner) -> dict[str, bool]:
    """Which adapters are loaded (not evicted) on rank 1, once every rank agrees."""
    reports = await report(runner)
    assert ranks_agree(reports)
    return {info.name: info.loaded for info in reports[1].adapters}


def moved(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {way: after[way] - before[way] for way in ("rows", "tokens")}


async def test_a_mixed_batch_on_two_ranks_makes_one_ranks_images(
    loaded: ParallelRunner, files: dict[str, Path]
) -> None:
    """L49 (L86): on a parallel worker, a request alone with an adapter runs by tokens and
    a batch of different adapters, two at once and none runs by rows, each rank its
    rows' adapters: every image is one rank's with the same adapters, and the adapters
    change it (by more than the tolerance)."""
    alone = [request("flux", seed=3, adapters={"ink": 0.8})]
    batched = [
        request("flux", seed=4, adapters={"film": 0.6}),
        request("flux", seed=5, prompt="a cat", adapters={"ink": 0.3, "film": 0.9}),
        request("flux", seed=6, prompt="a boat"),
    ]
    expected = await expected_of(files, alone + batched)
    plain = await expected_of(files, [request("flux", seed=3)])
    assert not torch.allclose(expected[0], plain[0], atol=10 * ATOL, rtol=0)
    start = await calls(loaded)
    assert close(await outputs(Kept(loaded), alone), expected[:1])
    middle = await calls(loaded)
    assert moved(start, middle) == {"rows": 0, "tokens": alone[0].denoise_steps}
    assert close(await outputs(Kept(loaded), batched), expected[1:])
    assert moved(middle, await calls(loaded))["rows"] > 0
    reports = await report(loaded)
    assert ranks_agree(reports) and not reports[0].states
    assert [(i.name, i.loaded, i.holders) for i in reports[1].adapters] == [
        ("film", True, 0),
        ("ink", True, 0),
    ]


async def test_a_load_refused_by_rank_0_or_failed_by_another_leaves_no_rank_with_it(
    by_load: ParallelRunner, files: dict[str, Path], tmp_path: Path
) -> None:
    """L49 (L85): a file rank 0 refuses (not a LoRA) reaches no other rank; a file that
    is gone when another rank reads it fails the load there, and rank 0 unloads it
    again: no rank knows either, and the group serves on."""
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a safetensors file")
    with pytest.raises(ot.AdapterError) as refused:
        by_load.load_adapter("bad", bad)
    assert refused.value.reason == "invalid"
    copied = tmp_path / "gone.safetensors"
    copied.write_bytes(files["ink"].read_bytes())
    rank_0 = by_load._model
    own_load = rank_0.load_adapter

    def load_then_remove(name: str, source: Any) -> None:
        own_load(name, source)
        copied.unlink()  # before any other rank reads it

    rank_0.load_adapter = load_then_remove  # type: ignore[method-assign]
    try:
        with pytest.raises(ot.AdapterError) as failed:
            by_load.load_adapter("gone", copied)
    finally:
        del rank_0.load_adapter
    assert "rank 1" in str(failed.value) and failed.value.reason == "invalid"
    reports = await report(by_load)
    assert ranks_agree(reports) and reports[0].adapters == ()
    assert not by_load.adapter_names()


async def test_a_held_adapter_stays_on_every_rank_until_its_request_is_done(
    loaded: ParallelRunner, files: dict[str, Path]
) -> None:
    """L49 (L85): while a request on a parallel worker holds ``ink``, every rank counts it
    as a holder and an unload is refused (``in-use``) on every rank; once the request is
    done it unloads from every rank."""
    held = request("flux", seed=7, num_steps=6, adapters={"ink": 0.5})
    [expected] = await expected_of(files, [held])
    with anyio.fail_after(BUDGET):
        kept = Kept(loaded)
        async with ot.open_engine(kept) as engine:
            handle = engine.submit(held, request_id="held")
            async with kept.held(lambda steps: steps.get("held", 0) >= 2):
                reports = await report(loaded)
                assert ranks_agree(reports)
                assert {i.name: i.holders for i in reports[1].adapters} == {"film": 0, "ink": 1}
                with pytest.raises(ot.AdapterError) as refused:
                    await engine.unload_adapter("ink")
                assert refused.value.reason == "in-use"
            async with handle:
                got = (await handle.result()).images
            await engine.unload_adapter("ink")
    assert close([got], [expected])
    reports = await report(loaded)
    assert ranks_agree(reports) and [i.name for i in reports[1].adapters] == ["film"]


async def test_every_rank_evicts_and_reloads_the_same_adapters(
    loaded: ParallelRunner, files: dict[str, Path]
) -> None:
    """L49 (L87): two adapters at most per rank: a third load evicts the least recently
    used on every rank, and a request naming the evicted one reloads it on every rank
    (evicting the next) and makes one rank's image."""
    loaded.load_adapter("dust", files["dust"])
    assert await resident(loaded) == {"dust": True, "film": True, "ink": False}
    again = request("flux", seed=8, adapters={"ink": 0.7})
    [expected] = await expected_of(files, [again])
    assert close(await outputs(Kept(loaded), [again]), [expected])
    assert await resident(loaded) == {"dust": True, "film": False, "ink": True}


async def test_an_abort_inside_a_step_releases_the_adapters_on_every_rank(
    loaded: ParallelRunner, files: dict[str, Path]
) -> None:
    """L49 (L85): a request of two images with adapters (a call by rows) aborted inside
    its second step leaves it on every rank; no rank keeps a state or a holder, and the
    next request with the same adapters makes one rank's image."""
    after = request("flux", seed=22, prompt="after", adapters={"film": 0.4})
    [expected] = await expected_of(files, [after])
    first = request("flux", seed=20, num_steps=6, num_images=2, adapters={"ink": 1.0})
    embedder = loaded.pipeline.transformer.x_embedder
    with anyio.fail_after(BUDGET):
        assert await abort_inside_a_step(loaded, embedder, first) == 1
        reports = await report(loaded)
        assert ranks_agree(reports) and not reports[0].states
        assert all(i.holders == 0 for i in reports[1].adapters)
        assert close(await outputs(Kept(loaded), [after]), [expected])
