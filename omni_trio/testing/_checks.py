"""Assertions that nothing leaked: threads, states, tables, buffered objects."""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import TypeVar

import anyio

from .._engine import Engine
from .._threads import ENGINE_THREAD_PREFIX, engine_threads

__all__ = [
    "ENGINE_THREAD_PREFIX",
    "assert_engine_idle",
    "assert_no_engine_threads",
    "engine_threads",
    "live_objects",
    "wait_until",
]

T = TypeVar("T")


def assert_no_engine_threads() -> None:
    """Fail if any thread started by an engine is still alive (L35)."""
    alive = engine_threads()
    assert not alive, f"engine threads still alive: {[t.name for t in alive]}"


def assert_engine_idle(engine: Engine) -> None:
    """Fail unless ``engine`` holds no request: no waiting, running or open one (L14)."""
    stats = engine.statistics()
    assert stats.waiting == 0 and stats.running == 0, stats
    assert not engine._live, f"live requests: {sorted(engine._live)}"
    assert not engine._terminal_open, f"open handles: {sorted(engine._terminal_open)}"
    assert engine._pool.counts()[0] == 0
    total = stats.waiting + stats.running + stats.completed + stats.aborted + stats.failed
    assert total == stats.admitted, stats


def live_objects(cls: type[T], *, request_id: str | None = None) -> list[T]:
    """Return the objects of ``cls`` still alive (after a full collection).

    With ``request_id``, only those whose ``request_id`` attribute equals it.
    """
    gc.collect()
    return [
        obj
        for obj in gc.get_objects()
        # type(), not isinstance(): some objects warn when their __class__ is read.
        if issubclass(type(obj), cls)
        and (request_id is None or getattr(obj, "request_id", None) == request_id)
    ]


async def wait_until(
    predicate: Callable[[], bool], *, interval: float = 0.001, max_interval: float | None = None
) -> None:
    """Poll ``predicate`` until it holds.

    Args:
        predicate: what to wait for.
        interval: the pause before the first poll.
        max_interval: with a value, each next pause doubles, up to it; ``None``:
            every pause is ``interval``. Back off for long waits beside the
            engine's threads: a poller that spins keeps the GIL from them (under
            coverage, a fixed 0.2 ms poll made the lifecycle machine 5x slower on
            trio). Keep the default under trio's ``autojump_clock``, where every
            pause is a jump of virtual time that a worker's real compute does not
            stop.

    Cancellation:
        Safe; compose with ``anyio.fail_after`` for a bound.
    """
    pause = interval
    longest = interval if max_interval is None else max(interval, max_interval)
    while not predicate():
        await anyio.sleep(pause)
        pause = min(pause * 2, longest)
