"""Priority and deadlines over HTTP (L63): body fields, the header, the limit, the answers, metrics.

Determinism as in ``test_app``: the app runs in its own lifespan on both
backends, on ``FakeRunner`` (instant) or ``GatedRunner``; a deadline that must pass
does so while its request waits behind a gated one, so the outcome never depends on
timing; the measured step time that admission reads is set by the test.
"""

from __future__ import annotations

import json
from typing import Any

import anyio
import pytest

import omni_trio as ot
from omni_trio.serve import ServeConfig, Service
from omni_trio.serve._schema import DEADLINE_HEADER, parse_generation_body
from omni_trio.testing import (
    FakeRunner,
    FakeState,
    GatedRunner,
    assume_step_time,
    wait_until,
)
from tests.support.core import BUDGET
from tests.support.serve import PATH, AsgiCall, metric, serving

pytestmark = pytest.mark.anyio


class PromptRecorder(GatedRunner):
    """A ``GatedRunner`` that records the prompts it prepares, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.prompts: list[str] = []

    def prepare(self, request: ot.GenerationRequest, request_id: str) -> FakeState:
        """Record the prompt, then prepare."""
        self.prompts.append(request.prompt)
        return super().prepare(request, request_id)


def make(runner: FakeRunner, **config: Any) -> Service:
    """A service at 64x64, 4 steps, batches of one; ``config`` adds ServeConfig fields."""
    return Service(
        runner,
        engine_config=ot.EngineConfig(max_batch_size=1),
        config=ServeConfig(
            model_name="fake", default_width=64, default_height=64, default_steps=4, **config
        ),
    )


@pytest.mark.parametrize(
    ("body", "header", "expected"),
    [
        ({}, None, None),
        ({"deadline_ms": 3000}, None, 3.0),
        ({}, "2500", 2.5),
        ({"deadline_ms": 3000}, "2000", 2.0),
        ({"deadline_ms": 1500}, " 2000 ", 1.5),
    ],
)
def test_deadline_is_the_earlier_of_body_and_header(
    body: dict[str, Any], header: str | None, expected: float | None
) -> None:
    """L63: ``deadline_ms`` and ``X-Request-Deadline-Ms`` give the deadline; the earlier wins."""
    data = json.dumps({"prompt": "a", "priority": -2, **body}).encode()
    job = parse_generation_body(data, ServeConfig(), deadline_header=header)
    assert job.request.deadline_s == expected
    assert job.request.priority == -2


async def test_priority_orders_requests_and_is_bounded_by_max_priority() -> None:
    """L63: a body's ``priority`` orders the queue, up to ``max_priority``; above it, a 400."""
    runner = PromptRecorder()
    service = make(runner, max_priority=5)
    calls = [AsgiCall({"prompt": p, "priority": n}) for p, n in (("low", -1), ("high", 5))]
    busy = AsgiCall({"prompt": "busy"})
    with anyio.fail_after(BUDGET):
        async with serving(service) as client:
            engine = service.engine
            assert engine is not None
            refused = await client.post(PATH, json={"prompt": "x", "priority": 6})
            assert refused.status_code == 400
            error = refused.json()["error"]
            assert error["param"] == "priority" and "<= 5" in error["message"]
            async with anyio.create_task_group() as tg:
                tg.start_soon(busy.run, service)
                await runner.wait_arrived(1)
                for call in calls:
                    tg.start_soon(call.run, service)
                await wait_until(lambda: engine.statistics().waiting == 2)
                runner.open_gate()
    assert runner.prompts == ["busy", "high", "low"]
    assert [call.status for call in (busy, *calls)] == [200, 200, 200]


async def test_metrics_count_preemptions_and_suspended_requests() -> None:
    """L61, L63: a preemption over HTTP shows in ``/metrics``: the count and the suspended gauge.

    "busy" runs its first step (gated); "urgent" (priority 1) arrives and, at the
    boundary, suspends it; while "urgent" is held in its step, the scrape says one
    preemption and one suspended request. Both answers are 200 afterwards.
    """
    runner = PromptRecorder()
    service = make(runner, max_priority=1)
    busy = AsgiCall({"prompt": "busy"})
    urgent = AsgiCall({"prompt": "urgent", "priority": 1})
    with anyio.fail_after(BUDGET):
        async with serving(service) as client:
            engine = service.engine
            assert engine is not None
            async with anyio.create_task_group() as tg:
                tg.start_soon(busy.run, service)
                await runner.wait_arrived(1)
                tg.start_soon(urgent.run, service)
                await wait_until(lambda: engine.statistics().waiting == 1)
                runner.release(1)
                await runner.wait_arrived(2)
                text = (await client.get("/metrics")).text
                assert metric(text, "omni_trio_preemptions_total") == 1
                assert metric(text, "omni_trio_requests_suspended") == 1
                runner.open_gate()
            text = (await client.get("/metrics")).text
            assert metric(text, "omni_trio_requests_suspended") == 0
            assert metric(text, "omni_trio_preemptions_total") == 1
    assert runner.prompts == ["busy", "urgent"]
    assert (busy.status, urgent.status) == (200, 200)


async def test_default_max_priority_refuses_any_raise() -> None:
    """L63: by default (max_priority 0) a positive priority is a 400; zero and below are fine."""
    service = make(FakeRunner())
    with anyio.fail_after(BUDGET):
        async with serving(service) as client:
            refused = await client.post(PATH, json={"prompt": "x", "priority": 1})
            assert refused.status_code == 400 and refused.json()["error"]["param"] == "priority"
            for priority in (0, -5):
                ok = await client.post(PATH, json={"prompt": "x", "priority": priority})
                assert ok.status_code == 200


@pytest.mark.parametrize(
    ("body", "headers", "param"),
    [
        ({"deadline_ms": 0}, {}, "deadline_ms"),
        ({"deadline_ms": 1.5}, {}, "deadline_ms"),
        ({}, {DEADLINE_HEADER: "soon"}, DEADLINE_HEADER),
        ({}, {DEADLINE_HEADER: "0"}, DEADLINE_HEADER),
        ({}, {DEADLINE_HEADER: "-5"}, DEADLINE_HEADER),
    ],
)
async def test_bad_deadline_gets_400_naming_it(
    body: dict[str, Any], headers: dict[str, str], param: str
) -> None:
    """L52, L63: a bad ``deadline_ms`` or deadline header is a 400 naming it."""
    service = make(FakeRunner())
    with anyio.fail_after(BUDGET):
        async with serving(service) as client:
            response = await client.post(PATH, json={"prompt": "x", **body}, headers=headers)
            assert response.status_code == 400
            assert response.json()["error"]["param"] == param


@pytest.mark.parametrize("where", ["body", "header"])
async def test_a_passed_deadline_aborts_with_reason_deadline_and_is_counted(where: str) -> None:
    """L63: a request whose deadline passes gets the abort answer (503, reason ``deadline``).

    It waits behind a gated request, so it is still waiting when its 50 ms pass;
    the other source names a far deadline, and the earlier one wins.
    """
    runner = GatedRunner()
    service = make(runner)
    late = AsgiCall({"prompt": "late", "deadline_ms": 50 if where == "body" else 600_000})
    header = b"50" if where == "header" else b"600000"
    late.scope["headers"].append((DEADLINE_HEADER.lower().encode(), header))
    busy = AsgiCall({"prompt": "busy"})
    with anyio.fail_after(BUDGET):
        async with serving(service) as client:
            engine = service.engine
            assert engine is not None
            async with anyio.create_task_group() as tg:
                tg.start_soon(busy.run, service)
                await runner.wait_arrived(1)
                tg.start_soon(late.run, service)
                await wait_until(lambda: late.status is not None)
                runner.open_gate()
            assert late.status == 503 and busy.status == 200
            assert b"request_aborted" in late.body and b"(deadline)" in late.body
            assert runner.prepares == 1
            text = (await client.get("/metrics")).text
            assert metric(text, "omni_trio_requests_total", outcome="deadline") == 1
            assert metric(text, "omni_trio_requests_total", outcome="aborted") == 0


async def test_an_unmeetable_deadline_gets_429_with_the_estimate() -> None:
    """L63: DeadlineError is a 429 ``deadline_unmeetable`` stating the estimate, counted.

    "busy" holds the only place in its first step (gated), so a request of equal
    priority can neither join nor preempt it: it waits behind its 4 steps (L62).
    """
    runner = GatedRunner()
    service = make(runner)
    busy = AsgiCall({"prompt": "busy"})
    with anyio.fail_after(BUDGET):
        async with serving(service) as client:
            engine = service.engine
            assert engine is not None
            async with anyio.create_task_group() as tg:
                tg.start_soon(busy.run, service)
                await runner.wait_arrived(1)
                assume_step_time(engine, 10.0)  # held in a step: nothing overwrites it
                refused = await client.post(PATH, json={"prompt": "x", "deadline_ms": 1000})
                runner.open_gate()
            assert busy.status == 200
            assert refused.status_code == 429
            assert refused.headers["retry-after"] == "1"
            error = refused.json()["error"]
            assert error["code"] == "deadline_unmeetable"
            # 4 steps of the running batch and 4 of its own, of 10 s each.
            assert "80.000 s" in error["message"] and "1000 ms" in error["message"]
            text = (await client.get("/metrics")).text
            assert metric(text, "omni_trio_requests_total", outcome="deadline_refused") == 1
            assert metric(text, "omni_trio_requests_total", outcome="queue_full") == 0
            assert engine.statistics().admitted == 1


def test_max_priority_is_validated() -> None:
    """L63: ServeConfig.max_priority is an int from 0 to MAX_PRIORITY."""
    for bad in (-1, True, 2**31, 1.0):
        with pytest.raises(ValueError, match="max_priority"):
            ServeConfig(max_priority=bad)  # type: ignore[arg-type]
    assert ServeConfig(max_priority=2**31 - 1).max_priority == 2**31 - 1
