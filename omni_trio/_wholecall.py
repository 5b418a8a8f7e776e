"""A whole-call runner's loop (``RunnerCapabilities.whole_call``): its step callback is
the worker's step boundary.

A runner that must run its own loop (a pipeline called whole) gets one request at a
time; after each of its steps it calls back, and there the worker counts the step,
posts its event and reads the request's token (L7, L21): raising ``StopRun`` stops
the loop before any decode. Runs in the worker's thread.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Protocol, cast

from ._messages import Post, release
from ._runner import StopRun

if TYPE_CHECKING:
    from ._runner import Runner, WholeCallRunner
    from ._workitem import WorkItem

__all__ = ["WholeCallHost", "run_whole"]


class WholeCallHost(Protocol):
    """What the loop asks of its worker."""

    def step_done(self, item: WorkItem, elapsed: float) -> Exception | None:
        """Count one step of ``item`` that took ``elapsed`` seconds, post its event, and
        publish the batch of ``item`` alone; return a preview's error, if any."""
        ...

    def step_begins(self, at: float | None) -> None:
        """The step running now began at ``at`` (``None``: no step runs)."""
        ...

    def left_batch(self) -> None:
        """``item`` left the batch (published before its release is posted, L62)."""
        ...

    def denoised(self, item: WorkItem) -> None:
        """``item``'s last step is done: hand it to the materializer."""
        ...


def run_whole(runner: Runner[Any], post: Post, item: WorkItem, host: WholeCallHost) -> None:
    """Run ``item`` in the runner's own loop to its end, a stop or a failure."""
    last = time.perf_counter()
    error: Exception | None = None

    def on_step(total: int | None = None) -> None:
        nonlocal last, error
        if total is not None:
            item.steps_total = total
        now = time.perf_counter()
        error = host.step_done(item, now - last)
        last = now
        host.step_begins(now)
        # L7, L21: the boundary check; raising stops the loop before any decode.
        if error is not None or item.token.reason is not None:
            raise StopRun

    whole = cast("WholeCallRunner[Any]", runner)
    host.step_begins(last)
    try:
        try:
            whole.run(item.state, on_step)
        finally:
            # Out of the batch before its release is posted (L62).
            host.step_begins(None)
            host.left_batch()
    except StopRun as stop:
        if error is None and item.token.reason is None:
            # Not ours: the runner stopped itself. A failure, not a cancellation.
            release(runner, item, post, stop, call="run")
        else:
            release(runner, item, post, error, call="preview")
    except Exception as exc:
        release(runner, item, post, exc, call="run")
    else:
        if error is not None:
            # The runner swallowed the StopRun raised for a bad preview (L24).
            release(runner, item, post, error, call="preview")
        else:
            host.denoised(item)
