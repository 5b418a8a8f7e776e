"""A group's caches: the result cache keyed by its layout (L95), the prompt cache's
statistics read from rank 0 (L94).

Determinism: seeded weights and seeds; each test starts its own groups (at most one
open at a time), runs its requests one after another, and compares exact things:
hits, counts, bytes. The read during a step is made while a gate holds rank 0
inside a denoiser block (``ModuleGate``), so the step is under way whatever the
timing.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

import omni_trio as ot
from omni_trio.runners import DiffusersRunner, PromptCacheStatistics
from tests.support.core import BUDGET
from tests.support.parallel import Kept, close, group
from tests.support.runners import ModuleGate, request, tiny

pytestmark = pytest.mark.anyio


async def generate(
    runner: Any, requests: list[ot.GenerationRequest], config: ot.EngineConfig
) -> list[ot.GenerationOutput]:
    """Each request's output, one after another, from a fresh engine on ``runner``."""
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner, config) as engine:
            return [await engine.generate(r) for r in requests]


async def test_a_groups_repeat_is_a_hit_and_another_layout_misses(tmp_path: Path) -> None:
    """L95: with a result cache in a folder, a seeded request's repeat on a ring group (a
    fresh engine: from the folder) is a hit, bytewise its first output; the same request
    on a Ulysses group, and on one process, misses (its pixels are within float tolerance
    only): the group names its layout, kind and degree, beside rank 0's model."""
    r = request("flux", seed=5)
    config = ot.EngineConfig(result_cache=ot.ResultCache(max_bytes=2**24, folder=str(tmp_path)))
    with group("flux", "ring") as ring:
        [first] = await generate(Kept(ring), [r], config)
        [again] = await generate(Kept(ring), [r], config)
    assert not first.metrics.result_cache_hit and again.metrics.result_cache_hit
    assert torch.equal(again.images, first.images)
    with group("flux", "ulysses") as ulysses:
        [other] = await generate(Kept(ulysses), [r], config)
    [alone] = await generate(DiffusersRunner(tiny("flux")), [r], config)
    assert not other.metrics.result_cache_hit and not alone.metrics.result_cache_hit
    assert close([other.images, alone.images], [first.images, first.images])


def counts(stats: PromptCacheStatistics) -> PromptCacheStatistics:
    """The statistics less the encoders' times (which no two runs share)."""
    return dataclasses.replace(stats, encode_s=0.0, saved_s=0.0)


def texts(output: ot.GenerationOutput) -> tuple[int, int]:
    """A request's own prompt-cache hits and misses."""
    figures = output.metrics.prompt_cache
    assert figures is not None
    return figures.hits, figures.misses


async def test_a_groups_prompt_cache_statistics_are_rank_0s_read_during_a_step() -> None:
    """L94: a guidance split's prompt cache statistics are one process's after the same
    requests (every rank encodes every request's texts; rank 0's counts stand for the
    group's), and they are read while rank 0 is held inside a step's model call: no
    message to a rank, no wait for the step. Each request's own figures
    (``RequestMetrics.prompt_cache``, rank 0's) are one process's too. The group's
    ``prompt_cache_bytes`` bounds each rank's cache as it bounds one process's."""
    requests = [
        request("sd", seed=1, prompt="a red fox", negative_prompt="blurry"),
        request("sd", seed=2, prompt="a red fox", negative_prompt="blurry"),
        request("sd", seed=3, prompt="a grey cat", negative_prompt="blurry"),
    ]
    bound = 2**20  # not the default: the statistics' max_bytes show it reached rank 0
    one = DiffusersRunner(tiny("sd"), prompt_cache_bytes=bound)
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(one) as engine:
            alone = [await engine.generate(r) for r in requests]
            expected = counts(one.prompt_cache_statistics())  # before the engine closes it
    assert (expected.hits, expected.misses, expected.entries) == (3, 3, 3)
    assert expected.max_bytes == bound
    with group("sd", "cfg", prompt_cache_bytes=bound) as split:
        outputs = await generate(Kept(split), requests[:2], ot.EngineConfig())
        gate = ModuleGate(split.pipeline.unet.down_blocks[0], 1)
        try:
            with anyio.fail_after(BUDGET):
                async with (
                    ot.open_engine(Kept(split)) as engine,
                    engine.submit(requests[2]) as handle,
                ):
                    await gate.wait_arrived()
                    during = split.prompt_cache_statistics()
                    assert gate.finished == 0  # the step is still held: the read did not wait
                    gate.release()
                    outputs.append(await handle.result())
        finally:
            gate.remove()
        assert counts(during) == expected
    assert [texts(out) for out in outputs] == [texts(out) for out in alone]
    assert [texts(out) for out in alone] == [(0, 2), (2, 0), (1, 1)]
    closed = split.prompt_cache_statistics()
    assert (closed.hits, closed.misses, closed.entries) == (3, 3, 0)
