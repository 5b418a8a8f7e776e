"""Weights updated in place (L102), sleep and wake (L103), through the engine.

Determinism: ``WeightedRunner`` is a ``GatedRunner`` with one weight, a number that
scales every image it decodes and that each step records per request; its update,
commit, revert, sleep and wake are counted and check that no request runs meanwhile.
A test holds the worker in a step (its gate) while it starts an update or a sleep and
submits more, then releases steps one by one: where the update lands is read from exact
counts (the steps that reached the gate, the statuses, the calls), never from timing.
The real model's side (a tiny Flux updated, asleep and awake, bitwise) is in
tests/runners/test_weights.py.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import anyio
import pytest
import torch

import omni_trio as ot
from omni_trio.abc import SleepBytes
from omni_trio.testing import FakeRunner, FakeState, GatedRunner, probe_engine, wait_until
from tests.support.core import BUDGET, expected_images, req

pytestmark = pytest.mark.anyio


class WeightedRunner(GatedRunner):
    """A ``GatedRunner`` whose ``weight`` scales its images (``WeightsRunner``).

    ``update_weights({"weight": w})`` sets it (``refuse``: raises instead) and checks
    that no request's state is left; every step records the weight each member ran on
    (``seen``); a step, a prepare or a decode while asleep or with an update pending raises.
    """

    def __init__(self, *, refuse: bool = False, **options: Any) -> None:
        super().__init__(**options)
        self.weight = 1.0
        self.refuse = refuse
        self.seen: dict[str, list[float]] = {}
        self.calls: list[str] = []
        self.asleep = 0
        self._backup: float | None = None

    def _check_awake(self, call: str) -> None:
        if self.asleep or self._backup is not None:
            raise RuntimeError(f"{call} while asleep or with an update pending")

    def prepare(self, request: ot.GenerationRequest, request_id: str) -> FakeState:
        self._check_awake("prepare")
        return super().prepare(request, request_id)

    def step(self, states: Sequence[FakeState]) -> None:
        super().step(states)
        self._check_awake("step")
        for state in states:
            self.seen.setdefault(state.request_id, []).append(self.weight)

    def decode(self, state: FakeState) -> torch.Tensor:
        self._check_awake("decode")
        return super().decode(state) * self.weight

    def update_weights(self, source: Mapping[str, Any], *, key: str) -> None:
        self.calls.append("update")
        # No state made on the old weights is left (its step cache's included, L82).
        assert self.live_states == 0, "a request's state outlives the old weights"
        if self.refuse:
            raise ot.WeightsError("this runner refuses", reason="invalid")
        self._backup, self.weight = self.weight, float(source["weight"])

    def commit_weights(self) -> None:
        self.calls.append("commit")
        self._backup = None

    def revert_weights(self) -> None:
        self.calls.append("revert")
        if self._backup is not None:
            self.weight, self._backup = self._backup, None

    def sleep_weights(self, level: int) -> SleepBytes:
        self.calls.append(f"sleep {level}")
        assert self.live_states == self.parked_states, "a request runs while it sleeps"
        self.asleep = level
        return SleepBytes(offloaded=100 if level == 1 else 0, dropped=0 if level == 1 else 100)

    def wake_weights(self) -> None:
        self.calls.append("wake")
        self.asleep = 0


def images_with(request: ot.GenerationRequest, weight: float) -> torch.Tensor:
    """The images ``request`` gets alone on weights ``weight``."""
    return expected_images(request) * weight


async def test_finish_lets_the_running_request_end_on_the_old_weights() -> None:
    """L102: with ``finish`` the request in flight ends on the old weights, then the update
    applies, and the requests that came meanwhile wait and run on the new ones.

    "old" is held in its first step when the update is asked; "new" is submitted then.
    The update waits (no runner call), "new" is not taken; once "old" completes on weight
    1 the runner is updated, and "new" runs every step on weight 0.5. Each output names
    its version, the new one with its label.
    """
    runner = WeightedRunner()
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner) as engine, anyio.create_task_group() as group:
            old = engine.submit(req(num_steps=3, seed=1), request_id="old")
            await runner.wait_arrived(1)
            versions: list[ot.WeightVersion] = []

            async def update() -> None:
                versions.append(
                    await engine.update_weights({"weight": 0.5}, policy="finish", label="step-1")
                )

            group.start_soon(update)
            await wait_until(lambda: probe_engine(engine).is_held)
            new = engine.submit(req(num_steps=2, seed=2), request_id="new")
            runner.release(1)
            await runner.wait_arrived(2)
            assert new.status is ot.RequestStatus.WAITING
            assert runner.calls == []
            runner.open_gate()
            async with old:
                old_output = await old.result()
            async with new:
                new_output = await new.result()
        assert versions == [ot.WeightVersion(number=1, label="step-1")]
        assert engine.weight_version == versions[0]
    assert runner.calls == ["update", "commit"]
    assert runner.seen == {"old": [1.0] * 3, "new": [0.5] * 2}
    assert torch.equal(old_output.images, images_with(req(num_steps=3, seed=1), 1.0))
    assert torch.equal(new_output.images, images_with(req(num_steps=2, seed=2), 0.5))
    assert old_output.weight_version == ot.WeightVersion(number=0)
    assert new_output.metrics.weight_version == versions[0]


async def test_abort_ends_the_requests_in_flight_with_weights_updated() -> None:
    """L102: with ``abort`` the requests a worker holds (running, and suspended) are
    aborted with reason ``weights_updated``; a request still waiting is not, and runs on
    the new weights."""
    runner = WeightedRunner()
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner, ot.EngineConfig(max_batch_size=1)) as engine:
            low = engine.submit(req(num_steps=3, seed=1), request_id="low")
            await runner.wait_arrived(1)
            high = engine.submit(req(num_steps=2, seed=2, priority=1), request_id="high")
            runner.release(1)
            await runner.wait_arrived(2)  # "low" suspended for "high", which runs
            waiting = engine.submit(req(num_steps=1, seed=3), request_id="waiting")
            async with anyio.create_task_group() as group:
                group.start_soon(lambda: engine.update_weights({"weight": 0.25}, policy="abort"))
                # The aborts are asked as the hold begins, in one go.
                await wait_until(lambda: probe_engine(engine).is_held)
                runner.open_gate()
            for handle in (low, high):
                async with handle:
                    with pytest.raises(ot.RequestAbortedError) as caught:
                        await handle.result()
                assert caught.value.reason == ot.AbortReason.WEIGHTS_UPDATED
                assert caught.value.reason == "weights_updated"
                assert handle.abort_reason == "weights_updated"
            async with waiting:
                output = await waiting.result()
    assert runner.seen["waiting"] == [0.25]
    assert output.weight_version == ot.WeightVersion(number=1)
    assert torch.equal(output.images, images_with(req(num_steps=1, seed=3), 0.25))


async def test_one_runner_refusing_leaves_every_runner_on_the_old_weights() -> None:
    """L102: all or nothing over the workers: the second runner refuses, the first (which
    applied it) reverts it, the version stays 0, and both serve the old weights."""
    first, second = WeightedRunner(), WeightedRunner(refuse=True)
    for runner in (first, second):
        runner.open_gate()
    with anyio.fail_after(BUDGET):
        async with ot.open_engine([first, second]) as engine:
            with pytest.raises(ot.WeightsError, match="refuses") as caught:
                await engine.update_weights({"weight": 0.5})
            assert caught.value.reason == "invalid"
            assert engine.weight_version == ot.WeightVersion(number=0)
            requests = [req(num_steps=2, seed=seed) for seed in range(4)]
            outputs = [await engine.generate(r) for r in requests]
    assert first.calls == ["update", "revert"]
    assert second.calls == ["update"]
    assert (first.weight, second.weight) == (1.0, 1.0)
    for request, output in zip(requests, outputs, strict=True):
        assert torch.equal(output.images, images_with(request, 1.0))
        assert output.weight_version == ot.WeightVersion(number=0)


async def test_a_result_cache_repeat_after_an_update_misses() -> None:
    """L102: the result cache's model names the weights: a repeat after an update runs,
    and a request admitted before the update but run after it is not kept under the old
    name (the repeat of it after the update misses too)."""
    runner = WeightedRunner()
    config = ot.EngineConfig(result_cache=ot.ResultCache(max_bytes=1 << 20))
    request = req(num_steps=1, seed=5)
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner, config) as engine:
            runner.open_gate()
            first = await engine.generate(request)
            assert (await engine.generate(request)).metrics.result_cache_hit
            await engine.update_weights({"weight": 0.5})
            again = await engine.generate(request)
            repeat = await engine.generate(request)
            stats = engine.statistics().result_cache
    assert not again.metrics.result_cache_hit
    assert repeat.metrics.result_cache_hit
    assert repeat.weight_version == again.weight_version == ot.WeightVersion(number=1)
    assert torch.equal(again.images, first.images * 0.5)
    assert stats is not None and (stats.hits, stats.misses) == (2, 2)


async def test_sleep_suspends_the_running_request_and_wake_resumes_it_exactly() -> None:
    """L103: ``suspend``: the running request is suspended at its boundary, the runner
    sleeps with nothing running, a request that arrives waits; after the wake both run,
    and the suspended one's image is the uninterrupted one."""
    runner = WeightedRunner()
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner) as engine:
            running = engine.submit(req(num_steps=4, seed=1), request_id="running")
            await runner.wait_arrived(1)
            async with anyio.create_task_group() as group:
                reports: list[ot.SleepReport] = []

                async def sleep() -> None:
                    reports.append(await engine.sleep(2, policy="suspend"))

                group.start_soon(sleep)
                await wait_until(lambda: probe_engine(engine).is_held)
                runner.release(1)
            assert reports[0].level == 2 and reports[0].dropped_bytes == 100
            assert engine.sleep_level == 2
            assert running.status is ot.RequestStatus.WAITING
            assert (runner.parked_states, runner.asleep) == (1, 2)
            later = engine.submit(req(num_steps=1, seed=2), request_id="later")
            assert later.status is ot.RequestStatus.WAITING and runner.prepares == 1
            awake = await engine.wake()
            assert awake.level == 2 and engine.sleep_level == 0
            runner.open_gate()
            async with running:
                resumed = await running.result()
            async with later:
                await later.result()
    assert runner.calls == ["sleep 2", "wake"]
    assert resumed.metrics.preemptions == 1
    assert torch.equal(resumed.images, images_with(req(num_steps=4, seed=1), 1.0))


async def test_a_sleep_that_refuses_answers_new_requests_with_engine_sleeping() -> None:
    """L103: with ``refuse`` a request submitted while asleep is refused
    (``EngineSleepingError``); an update is refused (``asleep``); after the wake both work.
    With ``finish`` the request in flight ends before the runner sleeps."""
    runner = WeightedRunner()
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner) as engine:
            running = engine.submit(req(num_steps=2, seed=1))
            await runner.wait_arrived(1)
            async with anyio.create_task_group() as group:
                group.start_soon(lambda: engine.sleep(1, policy="finish", refuse=True))
                await wait_until(lambda: probe_engine(engine).is_held)
                with pytest.raises(ot.EngineSleepingError):
                    engine.submit(req())
                runner.open_gate()
            async with running:
                assert running.status is ot.RequestStatus.COMPLETED
            with pytest.raises(ot.EngineSleepingError):
                await engine.generate(req())
            with pytest.raises(ot.WeightsError) as caught:
                await engine.update_weights({"weight": 2.0})
            assert caught.value.reason == "asleep"
            assert (await engine.sleep(2)).freed_bytes == 0  # asleep already
            await engine.wake()
            await engine.update_weights({"weight": 0.5})
            output = await engine.generate(req(seed=3))
    assert runner.calls == ["sleep 1", "wake", "update", "commit"]
    assert torch.equal(output.images, images_with(req(seed=3), 0.5))


async def test_runners_without_weights_and_bad_arguments_are_refused() -> None:
    """L102, L103: a runner that is no ``WeightsRunner`` is refused (``unsupported``), and
    so is a sleep that suspends on runners that cannot; wrong policies and levels are
    ``ValueError``s."""
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(FakeRunner()) as engine:
            with pytest.raises(ot.WeightsError) as caught:
                await engine.update_weights({})
            assert caught.value.reason == "unsupported"
            with pytest.raises(ot.WeightsError):
                await engine.sleep()
        async with ot.open_engine(WeightedRunner(suspendable=False)) as engine:
            with pytest.raises(ot.WeightsError, match="suspend"):
                await engine.sleep(policy="suspend")
            with pytest.raises(ValueError, match="policy"):
                await engine.update_weights({}, policy="later")  # type: ignore[arg-type]
            with pytest.raises(ValueError, match="level"):
                await engine.sleep(3)
            with pytest.raises(ValueError, match="label"):
                await engine.update_weights({}, label="")
