"""Step caching, the engine's side (L80, L84): the policy, admission, metrics, loosening.

The cache itself is the runner's; ``tests/runners/test_step_cache.py`` holds the real
one to its promises. Here a ``FakeRunner(step_cache=True)`` (it keeps the policy,
skips nothing, reports every row-call computed and records the thresholds it is
given) stands for it, so what the engine does is exact: the default policy, the
refusals, the metrics read at every release, and the loosening at step boundaries.

Determinism: a ``GatedRunner`` holds the worker in a step while the test sets the
measured step time (``assume_step_time``): at the next boundary the worker's moving
average is 0.8 of it (one real step of microseconds folded in), so "at risk" is
decided by numbers the test chose, far from the real time that passes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import anyio
import pytest

import omni_trio as ot
from omni_trio._cacheplan import LOOSEN_STAGES, loosened_threshold
from omni_trio._stepcache import MAX_CACHE_THRESHOLD, parse_step_cache
from omni_trio.testing import FakeRunner, FakeState, GatedRunner, assume_step_time
from tests.support.core import BUDGET, req

FIRST_BLOCK = ot.StepCache(kind="first-block", threshold=0.1)


def test_a_policy_is_checked_when_built_and_stores_its_kinds_defaults() -> None:
    """L80: each kind takes its own fields, stored with diffusers' defaults where left out."""
    assert ot.StepCache(kind="first-block") == ot.StepCache(
        kind="first-block", threshold=0.05, warmup=1
    )
    taylor = ot.StepCache(kind="taylorseer")
    assert (taylor.interval, taylor.order, taylor.warmup, taylor.threshold) == (5, 1, 3, None)
    assert ot.StepCache(kind="none").skips is False
    assert type(ot.StepCache(kind="first-block", threshold=1).threshold) is float


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"kind": "fast"}, "kind: must be one of"),
        ({"kind": 1}, "kind: must be a str"),
        ({"kind": "first-block", "interval": 2}, "interval: does not apply to kind"),
        ({"kind": "taylorseer", "threshold": 0.1}, "threshold: does not apply to kind"),
        ({"kind": "none", "warmup": 2}, "warmup: does not apply to kind"),
        ({"kind": "first-block", "threshold": -0.1}, "threshold: must be >= 0"),
        ({"kind": "first-block", "threshold": float("nan")}, "threshold: must be finite"),
        ({"kind": "first-block", "threshold": MAX_CACHE_THRESHOLD * 2}, "threshold: must be <="),
        ({"kind": "first-block", "threshold": 0.3, "max_threshold": 0.2}, "max_threshold: must"),
        ({"kind": "first-block", "warmup": 0}, "warmup: must be >= 1"),
        ({"kind": "first-block", "max_consecutive": True}, "max_consecutive: must be an int"),
        ({"kind": "taylorseer", "order": 3}, "order: must be <= 2"),
        ({"kind": "taylorseer", "interval": 0}, "interval: must be >= 1"),
    ],
)
def test_a_bad_policy_is_refused_naming_cache(fields: dict[str, Any], message: str) -> None:
    """L4, L80: a wrong type or value raises InvalidRequestError with field ``cache``."""
    with pytest.raises(ot.InvalidRequestError) as info:
        ot.StepCache(**fields)
    assert info.value.field == "cache"
    assert message in str(info.value), str(info.value)


def test_a_request_takes_a_policy_or_none() -> None:
    """L80: ``GenerationRequest.cache`` is a ``StepCache`` or ``None`` (the default)."""
    assert ot.GenerationRequest().cache is None
    assert ot.GenerationRequest(cache=FIRST_BLOCK).cache is FIRST_BLOCK
    with pytest.raises(ot.InvalidRequestError) as info:
        ot.GenerationRequest(cache="first-block")  # type: ignore[arg-type]
    assert info.value.field == "cache"
    with pytest.raises(ValueError, match="default_cache"):
        ot.EngineConfig(default_cache={"kind": "first-block"})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("first-block", ot.StepCache(kind="first-block")),
        ("first-block:0.2", ot.StepCache(kind="first-block", threshold=0.2)),
        ("taylorseer:3", ot.StepCache(kind="taylorseer", interval=3)),
        ("none", ot.StepCache(kind="none")),
        ({"kind": "first-block", "threshold": 0.3, "max_threshold": 0.6}, None),
        (None, None),
    ],
)
def test_a_policy_parses_from_text_or_a_mapping(text: object, expected: object) -> None:
    """L84: the HTTP body's and ``serve --cache``'s forms: ``KIND[:NUMBER]`` or the fields."""
    parsed = parse_step_cache(text)
    if isinstance(text, dict):
        assert parsed == ot.StepCache(**text)
    else:
        assert parsed == expected


@pytest.mark.parametrize(
    "text", ["first-block:", "first-block:x", "first-block:inf", "taylorseer:0.5", "auto", 3]
)
def test_a_bad_policy_text_is_refused_naming_cache(text: object) -> None:
    """L84: text that is not ``KIND[:NUMBER]`` (or not a policy) is refused naming ``cache``."""
    with pytest.raises(ot.InvalidRequestError) as info:
        parse_step_cache(text)
    assert info.value.field == "cache"


@pytest.mark.anyio
async def test_a_policy_the_runner_cannot_apply_is_refused_at_admission() -> None:
    """L4, L80: a runner without ``step_cache`` refuses a policy at ``submit``, naming
    ``cache``; ``"none"`` is always taken, and an engine refuses a default it cannot apply.
    """
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(FakeRunner()) as engine:
            with pytest.raises(ot.InvalidRequestError) as info:
                engine.submit(req(cache=FIRST_BLOCK), request_id="cached")
            assert info.value.field == "cache" and info.value.request_id == "cached"
            assert "cannot apply a 'first-block' step cache (it applies: none)" in str(info.value)
            assert engine.statistics().admitted == 0
            output = await engine.generate(req(cache=ot.StepCache(kind="none")))
            assert output.metrics.cache is None
        with pytest.raises(ValueError, match="default_cache: this runner cannot apply"):
            async with ot.open_engine(FakeRunner(), ot.EngineConfig(default_cache=FIRST_BLOCK)):
                pass


@pytest.mark.anyio
async def test_the_default_applies_to_requests_without_a_policy() -> None:
    """L80, L84: ``default_cache`` is the policy of a request that gives none; a request's own
    wins; ``"none"`` opts out; the policy is in no batch key (all three share every step);
    each output's metrics say what its cache did.
    """
    runner = FakeRunner(step_cache=True)
    default = ot.StepCache(kind="taylorseer", interval=2)
    config = ot.EngineConfig(default_cache=default, max_batch_size=4)
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner, config) as engine:
            handles = [
                engine.submit(req(), request_id="default"),
                engine.submit(req(cache=FIRST_BLOCK), request_id="own"),
                engine.submit(req(cache=ot.StepCache(kind="none")), request_id="out"),
            ]
            outputs = []
            for handle in handles:
                async with handle:
                    outputs.append(await handle.result())
    # The policy is in no batch key: the three may share every step (whether they do
    # depends on when the worker thread takes the first, so the keys are compared).
    keys = {
        runner.capabilities.batch_key(config.with_default_cache(req(cache=cache)))
        for cache in (None, FIRST_BLOCK, ot.StepCache(kind="none"))
    }
    assert len(keys) == 1
    first, own, out = (output.metrics.cache for output in outputs)
    assert first is not None and first.kind == "taylorseer"
    assert own is not None and own.kind == "first-block" and own.threshold == 0.1
    assert (own.calls_computed, own.calls_skipped, own.pattern) == (3, 0, ("CCC",))
    assert own.block_fraction == 1.0 and own.loosened is False
    assert out is None


@pytest.mark.anyio
async def test_an_aborted_request_reports_its_cache_too() -> None:
    """L84: the metrics are read at the release, whatever ended the request."""
    runner = GatedRunner(step_cache=True)
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner) as engine:
            async with engine.submit(req(num_steps=5, cache=FIRST_BLOCK), request_id="r") as h:
                await runner.wait_arrived(1)
                runner.release(1)
                await runner.wait_arrived(2)
                assert h.abort_nowait() is True  # in the second step: it ends at its boundary
                runner.open_gate()
                with pytest.raises(ot.RequestAbortedError):
                    await h.result()
            assert h.metrics is not None and h.metrics.cache is not None
            assert h.metrics.cache.calls_computed == 2


class Loosening(GatedRunner):
    """A gated fake step cache that notes every threshold the engine sets, by request."""

    def __init__(self, **options: Any) -> None:
        super().__init__(step_cache=True, **options)
        self.thresholds: dict[str, list[float]] = {}

    def set_cache_threshold(self, state: FakeState, threshold: float) -> None:
        super().set_cache_threshold(state, threshold)
        self.thresholds.setdefault(state.request_id, []).append(threshold)


async def _step_at(runner: GatedRunner, engine: ot.Engine, steps: int, step_s: float) -> None:
    """Run ``steps`` steps, each measured as ``step_s`` seconds (the worker held meanwhile)."""
    for _ in range(steps):
        arrived = runner.arrived
        assume_step_time(engine, step_s)
        runner.release(1)
        await runner.wait_arrived(arrived + 1)


async def _results(handles: Sequence[ot.RequestHandle]) -> list[ot.GenerationOutput]:
    outputs = []
    for handle in handles:
        async with handle:
            outputs.append(await handle.result())
    return outputs


@pytest.mark.anyio
async def test_a_request_at_risk_has_its_threshold_loosened_in_stages() -> None:
    """L84: at each step boundary where a request's steps left times the measured step time
    exceed its time left, and its policy has a ``max_threshold``, the worker raises its
    threshold by one of ``LOOSEN_STAGES`` stages (evenly to the bound, never past it); a
    request without the bound, one whose deadline is far, and one without a policy are
    left alone; the metrics say which was loosened and the threshold it ended with.
    """
    runner = Loosening(max_batch_size=4)
    bounded = ot.StepCache(kind="first-block", threshold=0.1, max_threshold=0.5)
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner, ot.EngineConfig(max_batch_size=4)) as engine:
            handles = [engine.submit(req(num_steps=20), request_id="first")]
            await runner.wait_arrived(1)
            handles += [
                engine.submit(req(num_steps=20, deadline_s=60, cache=bounded), request_id="risk"),
                engine.submit(
                    req(num_steps=20, deadline_s=60, cache=FIRST_BLOCK), request_id="fixed"
                ),
                engine.submit(req(num_steps=20, deadline_s=1e5, cache=bounded), request_id="far"),
            ]
            # The first step runs before a step time is known: nothing is loosened then.
            # From the next boundary on, 20 steps at 8 s (0.8 x 10) miss 60 s: "risk" at risk.
            await _step_at(runner, engine, LOOSEN_STAGES + 2, step_s=10.0)
            assert runner.thresholds == {
                "risk": [loosened_threshold(0.1, 0.5, stage) for stage in range(1, 5)]
            }
            assert runner.thresholds["risk"][-1] == 0.5
            runner.open_gate()
            first, risk, fixed, far = await _results(handles)
    assert first.metrics.cache is None
    assert risk.metrics.cache is not None and risk.metrics.cache.loosened
    assert risk.metrics.cache.threshold == 0.5
    for output in (fixed, far):
        assert output.metrics.cache is not None and not output.metrics.cache.loosened
        assert output.metrics.cache.threshold == 0.1


@pytest.mark.anyio
async def test_no_loosening_while_the_deadline_is_met_or_before_a_step_is_measured() -> None:
    """L84: a request whose steps left fit its time left keeps its threshold."""
    runner = Loosening()
    bounded = ot.StepCache(kind="first-block", threshold=0.1, max_threshold=0.5)
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner) as engine:
            handle = engine.submit(req(num_steps=10, deadline_s=600, cache=bounded))
            await runner.wait_arrived(1)
            await _step_at(runner, engine, 3, step_s=10.0)  # 9 x 8 s = 72 s < 600 s
            runner.open_gate()
            [output] = await _results([handle])
    assert runner.thresholds == {}
    assert output.metrics.cache is not None and not output.metrics.cache.loosened


class BrokenThreshold(GatedRunner):
    def set_cache_threshold(self, state: FakeState, threshold: float) -> None:
        raise RuntimeError("no")


@pytest.mark.anyio
async def test_a_runner_that_cannot_loosen_fails_that_request_only() -> None:
    """L22, L84: ``set_cache_threshold`` raising fails its request, naming the call."""
    runner = BrokenThreshold(step_cache=True, max_batch_size=2)
    bounded = ot.StepCache(kind="first-block", threshold=0.1, max_threshold=0.5)
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner, ot.EngineConfig(max_batch_size=2)) as engine:
            other = engine.submit(req(num_steps=4), request_id="other")
            await runner.wait_arrived(1)
            risk = engine.submit(req(num_steps=9, deadline_s=30, cache=bounded), request_id="risk")
            await _step_at(runner, engine, 1, step_s=10.0)
            runner.open_gate()
            async with risk:
                with pytest.raises(ot.RequestFailedError, match="set_cache_threshold raised"):
                    await risk.result()
            [done] = await _results([other])
    assert done.metrics.steps_done == 4
