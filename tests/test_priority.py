"""Priorities (L60): the field's validation, and the order in which a worker starts requests.

Determinism: a ``GatedRunner`` holds the worker in a step while the test submits,
so every submitted request waits until the test releases the gate; the order of
starts is read from the runner's own calls (``prepare``, the members of each
``step``), never from timing.
"""

from __future__ import annotations

import anyio
import pytest

import omni_trio as ot
from omni_trio._request import MAX_PRIORITY
from tests.support.core import BUDGET, RecordingRunner, req


def test_priority_defaults_to_zero() -> None:
    """L60: a request without a priority has priority 0."""
    assert ot.GenerationRequest().priority == 0


@pytest.mark.parametrize(
    "priority", [True, 1.0, "1", None, MAX_PRIORITY + 1, -MAX_PRIORITY - 1, 2**100]
)
def test_bad_priority_is_refused_by_name(priority: object) -> None:
    """L4: a priority that is not an exact int within +-MAX_PRIORITY is refused, by name."""
    with pytest.raises(ot.InvalidRequestError) as info:
        ot.GenerationRequest(priority=priority)  # type: ignore[arg-type]
    assert info.value.field == "priority"
    assert "priority" in str(info.value)


class LyingInt(int):
    """Claims to be greater than everything."""

    def __gt__(self, other: object) -> bool:
        return True


def test_priority_bounds_are_accepted_and_stored_as_int() -> None:
    """The bounds themselves are valid; a subclass is stored as an exact int."""
    for priority in (MAX_PRIORITY, -MAX_PRIORITY, 0, -1):
        assert ot.GenerationRequest(priority=priority).priority == priority
    stored = ot.GenerationRequest(priority=LyingInt(3)).priority
    assert type(stored) is int and stored == 3


@pytest.mark.anyio
async def test_higher_priority_starts_first_fifo_among_equals() -> None:
    """L60: waiting requests start highest priority first, first come first served among equals.

    One request runs (gated); then low (-1), high (5), mid (0) and a second high (5)
    are submitted. Batches of one: they start in the order high, high2, mid, low.
    """
    runner = RecordingRunner()
    # Without preemption (L61), which would suspend "busy" for "high": the order of
    # starts alone is under test here.
    options = ot.EngineConfig(max_batch_size=1, preemption=False)
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner, options) as engine:
            busy = engine.submit(req(), request_id="busy")
            await runner.wait_arrived(1)
            handles = [busy]
            for name, priority in (("low", -1), ("high", 5), ("mid", 0), ("high2", 5)):
                handles.append(engine.submit(req(priority=priority), request_id=name))
            assert engine.statistics().waiting == 4
            runner.open_gate()
            for handle in handles:
                async with handle:
                    await handle.result()
    assert runner.prepared == ["busy", "high", "high2", "mid", "low"]


@pytest.mark.anyio
async def test_only_the_best_ranked_request_joins_a_running_batch() -> None:
    """L60: a request joins a running batch only if it has the batch's key and ranks best.

    "busy" runs (gated) at 16x16. Then "other" (32x32, priority 0), "joiner" (16x16,
    priority 1) and "late" (16x16, priority 0) wait. At the next boundary "joiner"
    outranks "other" and matches the batch, so it joins; "late" matches too but
    "other" outranks it (same priority, admitted first), so "late" does not join
    past it. When the batch drains, "other" runs, then "late".
    """
    runner = RecordingRunner()
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner, ot.EngineConfig(max_batch_size=4)) as engine:
            busy = engine.submit(req(), request_id="busy")
            await runner.wait_arrived(1)
            handles = [
                busy,
                engine.submit(req(height=32, width=32), request_id="other"),
                engine.submit(req(priority=1), request_id="joiner"),
                engine.submit(req(), request_id="late"),
            ]
            runner.open_gate()
            for handle in handles:
                async with handle:
                    await handle.result()
    assert runner.prepared == ["busy", "joiner", "other", "late"]
    # Three steps each: "joiner" joins at busy's second step and finishes alone.
    assert runner.batches == [
        ("busy",),
        ("busy", "joiner"),
        ("busy", "joiner"),
        ("joiner",),
        ("other",),
        ("other",),
        ("other",),
        ("late",),
        ("late",),
        ("late",),
    ]
