"""Virtual time for the lifecycle machine: the loop's clock runs with real time, plus jumps.

Deadlines (L62) are on the event loop's clock. The machine's clock runs at the rate
of real time (so polls, hang budgets and the threads' hops behave as ever) and
``jump(seconds)`` moves it forward at once: every deadline it passes is due on the
loop's next turn, while nothing real happened. On trio it is ``trio.testing.MockClock``
at rate 1 (never autojump: an idle loop would leap to the next deadline while the
worker thread is busy); on asyncio an event loop whose ``time()`` adds an offset.
Jumps never touch the engine's threads: a step waiting at a ``GatedRunner``'s gate
waits on a ``threading`` condition with a real timeout, and the step time the worker
measures is ``time.perf_counter``'s.

A jump also passes every cancel scope's deadline, so the machine jumps only while
no hang budget (``anyio.fail_after``) and no shutdown grace period is running.
"""

from __future__ import annotations

import asyncio
from typing import Any

import trio
import trio.testing

__all__ = ["JumpLoop", "jump", "virtual_clock_options"]


class JumpLoop(asyncio.SelectorEventLoop):
    """An asyncio loop whose clock can jump forward (``time()`` plus an offset)."""

    def __init__(self) -> None:
        super().__init__()
        self._offset = 0.0

    def time(self) -> float:
        return super().time() + self._offset

    def jump(self, seconds: float) -> None:
        """Move the clock ``seconds`` forward; timers due by then run on the next turn."""
        if seconds < 0:
            raise ValueError("the clock only moves forward")
        self._offset += seconds


def virtual_clock_options(backend: str) -> dict[str, Any]:
    """The anyio backend options that give ``backend`` a clock ``jump`` can move."""
    if backend == "trio":
        return {"clock": trio.testing.MockClock(rate=1.0)}
    if backend == "asyncio":
        return {"loop_factory": JumpLoop}
    raise ValueError(f"no virtual clock for {backend!r}")


def jump(seconds: float) -> None:
    """Move the running loop's clock ``seconds`` forward (see the module's docstring).

    Raises:
        RuntimeError: the loop was not started with ``virtual_clock_options``.
    """
    if trio.lowlevel.in_trio_task():
        clock = trio.lowlevel.current_clock()
        if not isinstance(clock, trio.testing.MockClock):
            raise RuntimeError("the trio loop has no MockClock: see virtual_clock_options")
        clock.jump(seconds)
        return
    loop = asyncio.get_running_loop()
    if not isinstance(loop, JumpLoop):
        raise RuntimeError("the asyncio loop is not a JumpLoop: see virtual_clock_options")
    loop.jump(seconds)
