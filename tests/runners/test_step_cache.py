"""DiffusersRunner's step cache (L80-L83): per row, batch-invariant, owned by the admission.

What the cache promises, on every tiny DiT family (Flux, SD3, Qwen-Image, Wan, and
LTX-Video with a second block: the tiny one has a single block, nothing to skip):

- a policy that never skips (threshold 0, interval 1) gives the uncached output
  bitwise;
- a solo Flux or Qwen-Image request skips exactly where diffusers' own
  ``FirstBlockCacheConfig`` hook skips, with its output bitwise (Wan's guided rows
  too: diffusers gives them a cache context each);
- a request's skip pattern is the same alone and in batches whose members join and
  leave at random boundaries (seeded schedules), its output within batching's
  tolerance; a row that skips runs no tail block;
- the state is the admission's: suspended and resumed bitwise, dropped at release;
  a step left at a cancel point leaves it as it was.

Thresholds: the tiny random-weight models' first-block change ratio is about 0.2 to
0.5 per step (Flux 0.23-0.45), so the tests use 0.3 to 0.6 to see skips; a real
checkpoint's ratios are smaller (diffusers' default threshold is 0.05).

Determinism: tiny pipelines with seeded weights, one torch thread; the runner is
stepped directly where the schedule matters (which requests share which step).
"""

from __future__ import annotations

import importlib
import random
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from typing import Any

import anyio
import pytest
import torch
from diffusers.hooks.first_block_cache import FirstBlockCacheConfig

import omni_trio as ot
from benchmarks.cache import churned, company, diffusers_decisions, stepped
from omni_trio._cancelpoint import armed
from omni_trio.runners import DiffusersRunner, StopRun, tiny_pipeline
from omni_trio.runners._family import RequestState
from omni_trio.runners._stepcache import wrapped
from omni_trio.testing import probe, wait_until
from tests.support.core import BUDGET
from tests.support.runners import (
    SIZE,
    abort_inside,
    reference,
    request,
    resumed_and_uninterrupted,
    tiny,
    two_experts,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

#: The DiT families, and LTX-Video made two blocks deep (``deep_ltx``).
DIT_KINDS = ("flux", "sd3", "qwen-image", "wan", "ltx")


@cache
def pipeline(kind: str) -> Any:
    """The tiny pipeline of ``kind``; LTX-Video's with a second block (``deep_ltx``)."""
    return deep_ltx() if kind == "ltx" else tiny(kind)


@cache
def deep_ltx() -> Any:
    """Tiny LTX-Video with two transformer blocks (the tiny one has one: no tail to skip)."""
    diffusers: Any = importlib.import_module("diffusers")  # untyped constructors
    base = tiny("ltx")
    torch.manual_seed(2)
    transformer = diffusers.LTXVideoTransformer3DModel(
        **{**base.transformer.config, "num_layers": 2}
    ).eval()
    return diffusers.LTXPipeline(**{**base.components, "transformer": transformer})


def first_block(threshold: float, **fields: Any) -> ot.StepCache:
    return ot.StepCache(kind="first-block", threshold=threshold, **fields)


def cached(kind: str, policy: ot.StepCache | None, **fields: Any) -> ot.GenerationRequest:
    """The kind's test request (guided), 10 steps, with ``policy``."""
    return request(kind, num_steps=10, cache=policy, **fields)


def metrics_of(runner: DiffusersRunner, state: RequestState) -> ot.CacheMetrics:
    """What ``state``'s cache did (it has one)."""
    metrics = runner.cache_metrics(state)
    assert metrics is not None
    return metrics


def alone(runner: DiffusersRunner, r: ot.GenerationRequest) -> tuple[torch.Tensor, Any]:
    """``r`` stepped alone: its decoded output and its cache metrics (``None`` without)."""
    return stepped(runner, r)


def churning(
    runner: DiffusersRunner, kind: str, r: ot.GenerationRequest, rng: random.Random
) -> tuple[torch.Tensor, Any]:
    """``r`` in a batch of up to 4 whose other members (``company``) join and leave."""
    return churned(runner, r, rng, lambda g, n: company(kind, g, n))


@pytest.mark.parametrize("kind", DIT_KINDS)
def test_a_policy_that_never_skips_gives_the_uncached_output_bitwise(kind: str) -> None:
    """L80: first-block at threshold 0 and taylorseer at interval 1 compute every call, and
    the output is the uncached one bitwise (the head's residual, the ratios and the tails
    are kept aside; the blocks' own outputs pass on untouched).
    """
    runner = DiffusersRunner(pipeline(kind))
    try:
        assert runner.capabilities.step_cache == {"first-block", "taylorseer"}
        uncached, none = alone(runner, cached(kind, None))
        assert none is None
        for policy in (first_block(0.0), ot.StepCache(kind="taylorseer", interval=1)):
            output, metrics = alone(runner, cached(kind, policy))
            assert torch.equal(output, uncached), policy
            assert metrics.calls_skipped == 0 and set("".join(metrics.pattern)) == {"C"}
    finally:
        runner.close()


@pytest.mark.parametrize(("kind", "threshold"), [("flux", 0.4), ("flux", 0.6), ("qwen-image", 0.4)])
def test_a_solo_request_skips_where_diffusers_own_hook_does(kind: str, threshold: float) -> None:
    """L81: one row (no guidance rows): the skip pattern equals diffusers'
    FirstBlockCacheConfig hook at the same threshold, and the output is bitwise its
    pipeline's own call with that hook (the ratio is computed with the same operations
    on the same tensors). The threshold makes the tiny model skip (its ratios are
    0.2-0.5).
    """
    r = request(kind, num_steps=20, guidance_scale=3.5, cache=first_block(threshold))
    runner = DiffusersRunner(pipeline(kind))
    try:
        output, metrics = alone(runner, r)
    finally:
        runner.close()
    [ours] = metrics.pattern
    assert "S" in ours and "C" in ours[1:]
    hooked = tiny_pipeline(kind)  # a pipeline of its own: diffusers' hooks stay on it
    hooked.transformer.enable_cache(FirstBlockCacheConfig(threshold=threshold))
    with diffusers_decisions() as decisions:
        theirs = reference(kind, r, hooked)
    assert "".join("C" if computed else "S" for _, computed in decisions) == ours
    assert torch.equal(output, theirs)


def test_guided_wan_rows_skip_as_diffusers_cache_contexts_do() -> None:
    """L81: Wan's __call__ runs its unguided and guided calls in cache contexts of their
    own, so diffusers' hook decides per row there too: each of our two rows skips as its
    context does (the outputs within Wan's batched-guidance tolerance, 1e-4).
    """
    r = request("wan", num_steps=12, cache=first_block(0.3))
    runner = DiffusersRunner(pipeline("wan"))
    try:
        output, metrics = alone(runner, r)
    finally:
        runner.close()
    hooked = tiny_pipeline("wan")
    hooked.transformer.enable_cache(FirstBlockCacheConfig(threshold=0.3))
    with diffusers_decisions() as decisions:
        theirs = reference("wan", r, hooked)
    by_context = {
        name: "".join("C" if c else "S" for n, c in decisions if n == name)
        for name in ("uncond", "cond")
    }
    assert metrics.pattern == (by_context["uncond"], by_context["cond"])
    assert "S" in metrics.pattern[0]
    torch.testing.assert_close(output, theirs, atol=1e-4, rtol=0)


@pytest.mark.parametrize("kind", DIT_KINDS)
def test_decisions_are_batch_invariant_as_members_join_and_leave(kind: str) -> None:
    """L81: the same cached request alone and in batches of up to 4 whose members (of
    other prompts, seeds, steps, guidance, image counts and policies, some uncached) join
    and leave at random step boundaries, over seeded schedules: the skip pattern is
    identical (0 differing decisions) and the output within batching's tolerance (1e-4).
    """
    r = cached(kind, first_block(0.35), seed=11)
    runner = DiffusersRunner(pipeline(kind), max_batch_size=4)
    try:
        output, metrics = alone(runner, r)
        assert any("S" in row for row in metrics.pattern)
        for seed in range(3):
            churned, churned_metrics = churning(runner, kind, r, random.Random(seed))
            assert churned_metrics.pattern == metrics.pattern, seed
            torch.testing.assert_close(churned, output, atol=1e-4, rtol=0)
    finally:
        runner.close()


@contextmanager
def rows_seen(module: torch.nn.Module) -> Iterator[list[int]]:
    """The row counts of ``module``'s calls (the hidden states' first dimension)."""
    seen: list[int] = []

    def hook(_: torch.nn.Module, args: tuple[Any, ...]) -> None:
        seen.append(args[0].shape[0])

    handle = module.register_forward_pre_hook(hook)
    try:
        yield seen
    finally:
        handle.remove()


def test_rows_that_skip_run_no_tail_block() -> None:
    """L81: in one model call, a row that skips is not in the tail's work: the tail block
    (Flux's single block, seen through its norm) runs on the computing rows only, and not
    at all when every row skips.
    """
    pipe = pipeline("flux")
    runner = DiffusersRunner(pipe)
    skipper = request("flux", num_steps=6, seed=1, cache=first_block(10.0))  # skips after 1
    computer = request("flux", num_steps=6, seed=2, cache=first_block(0.0))  # never skips
    tail = pipe.transformer.single_transformer_blocks[0].norm
    try:
        states = [runner.prepare(skipper, "skipper"), runner.prepare(computer, "computer")]
        with rows_seen(tail) as seen:
            runner.step(states)  # both compute (warm-up)
            runner.step(states)  # the skipper skips
            runner.step(states[:1])  # the skipper alone: nothing runs the tail
        assert seen == [2, 1]
        assert [metrics_of(runner, s).pattern for s in states] == [("CSS",), ("CC",)]
        for state in states:
            runner.discard(state)
    finally:
        runner.close()


@pytest.mark.anyio
@pytest.mark.parametrize("park_on_host", [False, True])
async def test_a_preempted_cached_request_resumes_to_its_uninterrupted_output(
    park_on_host: bool,
) -> None:
    """L82: a cached request suspended after its first step and resumed equals its
    uninterrupted run bitwise (same batch composition: alone), skip pattern included;
    its cache's tensors are part of the parked bytes.
    """
    low = cached("flux", first_block(0.4), seed=3)
    high = request("flux", num_steps=2, seed=4, priority=1)
    resumed, uninterrupted, _ = await resumed_and_uninterrupted(
        tiny("flux"), low, high, park_on_host=park_on_host
    )
    assert torch.equal(resumed.images, uninterrupted.images)
    assert resumed.metrics.cache == uninterrupted.metrics.cache
    assert resumed.metrics.cache is not None and resumed.metrics.cache.calls_skipped > 0
    runner = DiffusersRunner(tiny("flux"))
    try:
        plain, with_cache = (runner.prepare(cached("flux", p), "bytes") for p in (None, low.cache))
        for state in (plain, with_cache):
            runner.step([state])
        assert with_cache.cache is not None
        tensors = [t for holder in with_cache.cache.holders() for t in holder.values()]
        cache_bytes = sum(t.nbytes for t in tensors)
        assert cache_bytes > 0
        assert runner.state_bytes(with_cache) == runner.state_bytes(plain) + cache_bytes
        for state in (plain, with_cache):
            runner.discard(state)
        assert with_cache.cache is None  # dropped with the state (L82)
    finally:
        runner.close()


@pytest.mark.anyio
async def test_cache_state_is_the_admissions_a_reused_id_starts_afresh() -> None:
    """L82: the same id reused after its request ended starts with no cache state: the
    same pattern and output as the first time; the runner holds no state afterwards.
    """
    r = cached("flux", first_block(0.4), seed=5)
    runner = DiffusersRunner(tiny("flux"))
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner) as engine:
            first = await engine.generate(r, request_id="same")
            second = await engine.generate(r, request_id="same")
    assert first.metrics.cache is not None
    assert first.metrics.cache == second.metrics.cache
    assert torch.equal(first.images, second.images)
    assert runner.live_states == 0


class Faulting(DiffusersRunner):
    """A tiny runner whose third step fails (``"failure"``) or overruns (``"deadline"``:
    it holds until the test opens ``gate``, once the deadline passed); it keeps every
    state it prepared, to see their caches after the release."""

    def __init__(self, pipe: Any, fault: str) -> None:
        super().__init__(pipe)
        self.fault = fault
        self.steps = 0
        self.states: list[RequestState] = []
        self.gate = threading.Event()

    def prepare(self, request: ot.GenerationRequest, request_id: str) -> RequestState:
        state = super().prepare(request, request_id)
        self.states.append(state)
        return state

    def step(self, states: Any) -> None:
        self.steps += 1
        if self.steps == 3:
            if self.fault == "failure":
                raise RuntimeError("a model fault")
            assert self.gate.wait(BUDGET), "the test never opened the gate"
        super().step(states)


@pytest.mark.anyio
@pytest.mark.parametrize("fault", ["failure", "deadline"])
async def test_a_failed_or_overdue_cached_request_drops_its_cache(fault: str) -> None:
    """L82: a cached request failed by its runner, or ended by its deadline, leaves no cache
    state: the release discards it with the request's state, as for a finish or an abort.

    The overdue step is held until the engine asked for the deadline's abort (no sleep
    decides it: the step returns once the deadline has passed, whenever that was).
    """
    runner = Faulting(tiny("flux"), fault)
    r = cached("flux", first_block(0.4), seed=10, deadline_s=0.5)
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner) as engine:
            async with engine.submit(r, request_id="faulty") as handle:
                if fault == "deadline":
                    await wait_until(lambda: probe(handle).cancel_reason == "deadline")
                    runner.gate.set()
                with pytest.raises(
                    ot.RequestFailedError if fault == "failure" else ot.RequestError
                ):
                    await handle.result()
            if fault == "deadline":
                assert handle.status is ot.RequestStatus.ABORTED
                assert handle.abort_reason == "deadline"
            else:
                assert handle.status is ot.RequestStatus.FAILED
    [state] = runner.states
    assert state.cache is None
    assert runner.live_states == 0


def test_a_step_left_at_a_cancel_point_leaves_the_cache_as_it_was() -> None:
    """L83: a step left at a block's cancel point (StopRun from the pre-hook before the tail
    block) commits nothing: counters, pattern and tensors are those before the step, and
    stepping on gives the uninterrupted output bitwise.
    """
    r = cached("flux", first_block(0.4), seed=6)
    runner = DiffusersRunner(tiny("flux"))
    try:
        expected, expected_metrics = alone(runner, r)
        state = runner.prepare(r, "left")
        for _ in range(3):
            runner.step([state])
        assert state.cache is not None
        before = runner.cache_metrics(state)
        tensors = [dict(holder) for holder in state.cache.holders()]
        blocks = 0

        def at_the_tail() -> None:
            nonlocal blocks
            blocks += 1
            if blocks == 2:  # the head ran, its decision was made
                raise StopRun

        with pytest.raises(StopRun), armed(at_the_tail):
            runner.step([state])
        assert runner.cache_metrics(state) == before
        after = [dict(holder) for holder in state.cache.holders()]
        assert [{k: id(v) for k, v in h.items()} for h in after] == [
            {k: id(v) for k, v in h.items()} for h in tensors
        ]
        for _ in range(3, r.denoise_steps):
            runner.step([state])
        assert torch.equal(runner.decode(state), expected)
        assert runner.cache_metrics(state) == expected_metrics
        runner.discard(state)
    finally:
        runner.close()


@pytest.mark.anyio
async def test_an_abort_inside_a_cached_step_leaves_the_model_as_fresh() -> None:
    """L71, L83: a cached request aborted while its third step's head block runs is left at
    the tail block's cancel point (two steps done, its decision for the third made and
    dropped); the next cached request's output and pattern are a fresh engine's, bitwise.
    """
    first = cached("flux", first_block(0.4), seed=7)
    after = cached("flux", first_block(0.4), seed=8, prompt="after")
    gate, runner, handle, output, fresh = await abort_inside(
        lambda p: p.transformer.transformer_blocks[0],
        3,
        pipe=tiny("flux"),
        first=first,
        after=after,
    )
    assert gate.calls == 3 and handle.status is ot.RequestStatus.ABORTED
    assert handle.metrics is not None and handle.metrics.steps_done == 2
    assert handle.metrics.cache is not None and len(handle.metrics.cache.pattern[0]) == 2
    assert runner.decodes == 1  # the next request's only
    assert torch.equal(output.images, fresh.images)
    assert output.metrics.cache == fresh.metrics.cache


def test_wan_two_experts_keep_a_cache_each() -> None:
    """L80, L81: Wan 2.2's rows keep one cache per expert (a row crossing the boundary
    starts the second's with its warm-up); never skipping is bitwise uncached, and the
    pattern is the same alone and with company on the other expert in the same steps.
    """
    pipe = two_experts()
    runner = DiffusersRunner(pipe, max_batch_size=4)
    r = request("wan", num_steps=8, seed=1, cache=first_block(0.3))
    try:
        uncached, _ = alone(runner, request("wan", num_steps=8, seed=1))
        never, _ = alone(runner, request("wan", num_steps=8, seed=1, cache=first_block(0.0)))
        assert torch.equal(never, uncached)
        state = runner.prepare(r, "experts")
        for _ in range(r.denoise_steps):
            runner.step([state])
        assert state.cache is not None and sorted(state.cache.experts) == [0, 1]
        solo = metrics_of(runner, state)
        runner.discard(state)
        # Each expert's first call computes: the second's starts mid-way.
        assert all(row[0] == "C" for row in solo.pattern)
        assert any("S" in row for row in solo.pattern)
        for seed in range(2):
            _, churned = churning(runner, "wan", r, random.Random(seed))
            assert churned.pattern == solo.pattern
    finally:
        runner.close()


def test_a_loosened_threshold_applies_from_the_next_call() -> None:
    """L84: ``set_cache_threshold`` on a first-block request: stepped at threshold 0 (every
    call computed), then raised, it skips from the next step on, and its metrics say it
    was loosened to what; a request without a first-block cache is refused.
    """
    runner = DiffusersRunner(tiny("flux"))
    try:
        r = cached("flux", first_block(0.0), seed=9)
        state = runner.prepare(r, "loosened")
        for _ in range(3):
            runner.step([state])
        before = metrics_of(runner, state)
        assert (before.calls_skipped, before.loosened, before.threshold) == (0, False, 0.0)
        runner.set_cache_threshold(state, 0.6)
        for _ in range(3, r.denoise_steps):
            runner.step([state])
        after = metrics_of(runner, state)
        assert (after.loosened, after.threshold) == (True, 0.6)
        assert after.calls_skipped > 0
        assert all(row[:3] == "CCC" and "S" in row[3:] for row in after.pattern)
        runner.discard(state)
        for policy in (None, ot.StepCache(kind="taylorseer")):
            other = runner.prepare(cached("flux", policy), "other")
            with pytest.raises(ValueError, match="no first-block cache"):
                runner.set_cache_threshold(other, 0.6)
            runner.discard(other)
    finally:
        runner.close()


def test_unet_families_refuse_a_policy_and_dits_wrap_each_block_once() -> None:
    """L80: the UNet families declare no step cache (their blocks pass skip connections
    between down and up blocks: no one residual of "the other blocks"), so admission
    refuses a policy naming ``cache``; a DiT's blocks are wrapped once however many
    runners share the pipeline, and the last runner's close puts every forward back.
    """
    for kind in ("sd", "sdxl", "unet"):
        runner = DiffusersRunner(tiny(kind))
        runner.close()
        assert runner.capabilities.step_cache == frozenset()
        with pytest.raises(ot.InvalidRequestError) as info:
            runner.capabilities.check_request(
                request(kind, height=SIZE[kind], width=SIZE[kind], cache=first_block(0.1))
            )
        assert info.value.field == "cache"
    pipe = tiny("flux")
    blocks = [*pipe.transformer.transformer_blocks, *pipe.transformer.single_transformer_blocks]
    assert not any(wrapped(block) or "forward" in vars(block) for block in blocks)
    first, second = DiffusersRunner(pipe), DiffusersRunner(pipe)
    assert first.step_cache_blocks == second.step_cache_blocks == len(blocks)
    first.close()
    assert all(wrapped(block) for block in blocks)
    second.close()
    assert not any(wrapped(block) or "forward" in vars(block) for block in blocks)
    assert second.step_cache_blocks == 0
