"""``open_engine``: the engine's structured entry, started and shut down with a block.

It creates the engine (``_engine``), starts each worker's threads, the deadline
timer and, with a result cache, its writer (``_resultstore``) in its task group, and
on leaving the block runs the shutdown sequence shielded (``Engine.aclose``), so no
thread or task outlives it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import TypeVar

import anyio

from ._config import EngineConfig
from ._engine import Engine
from ._runner import Runner, runner_sequence
from ._threads import set_torch_threads

__all__ = ["open_engine"]

StateT = TypeVar("StateT")


@asynccontextmanager
async def open_engine(
    runners: Runner[StateT] | Sequence[Runner[StateT]], config: EngineConfig | None = None
) -> AsyncIterator[Engine]:
    """Start an engine on one runner, or one runner per device; shut it down on exit.

    Args:
        runners: the model runner (see ``omni_trio.abc.Runner``), or a
            sequence of them, typically the same pipeline loaded once per device
            (``omni_trio.runners.for_devices``): each gets its own worker, all
            share one queue (L42). They must declare the same capabilities.
        config: the engine's configuration; defaults to ``EngineConfig()``.

    Raises:
        ValueError: no runner, runners that declare different capabilities, or a
            ``config.default_cache`` they cannot apply.
        EngineDeadError: on exit, if every worker died while the block ran and
            the block itself raised nothing.

    Exception policy: an exception raised in the block propagates unchanged
    (never in an exception group); the shutdown sequence still runs first.

    Cancellation:
        The shutdown sequence runs shielded when the block is left, so leaving
        waits for ``shutdown_grace`` plus at most one step.
    """
    config = config if config is not None else EngineConfig()
    runner_list = runner_sequence(runners)
    engine = Engine._create(runner_list, config)
    set_torch_threads(config, len(runner_list))
    for worker in engine._workers:
        worker.start()
    # The block's exception is held, not raised inside the task group, which would
    # wrap it in an exception group; it is raised unchanged once the group is left.
    raised: BaseException | None = None
    async with anyio.create_task_group() as group:
        try:
            await group.start(engine._deadlines.run)
            if engine._results is not None:
                # L95: ready (its folder read) before the first request.
                await group.start(engine._results.run)
            yield engine
        except BaseException as exc:
            raised = exc
        finally:
            with anyio.CancelScope(shield=True):
                await engine.aclose()
            # The timer holds nothing: told to stop, it returns at once.
            engine._deadlines.close()
            if engine._results is not None:
                # Its writer returns once the outputs kept so far are in their files.
                engine._results.close()
    if raised is not None:
        try:
            raise raised
        finally:
            raised = None  # no reference cycle through this frame
    if engine._dead is not None:
        raise engine._dead_error()
