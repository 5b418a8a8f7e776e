"""The per-request record: the loop-side half of an admission and its state machine.

::

    WAITING ──taken by the worker──▶ RUNNING ──output ready──▶ COMPLETED
       │  ▲                            │ ├──token seen at a boundary──▶ ABORTED
       │  └──suspended (L61)───────────┤ ├──runner raised─────────────▶ FAILED
       └──withdrawn from the queue─────┼─┘
          (abort, shutdown) ──▶ ABORTED└──worker died──────────────────▶ FAILED

The worker takes a request under the queue lock and marks it ``taken`` there, so
WAITING and RUNNING are never stale: a request that reads WAITING is still in the
queue, and an abort then withdraws it (L6); a suspended one is released by the
materializer then, and ends when its release message arrives. Every terminal
transition happens in the event loop's thread, in ``Engine``. A record is terminal
exactly when the engine's threads hold nothing of it any more, so waiting for
``done`` is waiting for the release (L8, L11).
"""

from __future__ import annotations

import math
import time
import weakref
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING

import anyio

from ._channel import CoalescingChannel
from ._outputs import GenerationOutput, RequestMetrics, RequestStatus, RequestTimeline, StepEvent
from ._request import GenerationRequest
from ._workitem import WorkItem

if TYPE_CHECKING:
    from ._handle import RequestHandle

__all__ = ["Record", "wait_shielded"]


class _Taken:
    """Marks an output that ``result()`` already returned."""


TAKEN = _Taken()


class Record(WorkItem):
    """One admission: the worker's ``WorkItem`` plus what the event loop owns."""

    __slots__ = (
        "channel",
        "deadline",
        "done",
        "handle_ref",
        "metrics",
        "outcome",
        "result_hit",
        "result_key",
        "steps_at_abort",
        "t_abort",
        "t_admitted",
        "t_terminal",
        "terminal_status",
    )

    def __init__(
        self,
        request: GenerationRequest,
        request_id: str,
        batch_key: Hashable,
        *,
        event_buffer: int,
        deadline: float | None = None,
    ) -> None:
        super().__init__(request, request_id, batch_key)
        # The absolute deadline on the event loop's clock (L62), None for none.
        self.deadline = deadline
        # Set once, by the engine, when the request ends; before that the status
        # is WAITING or RUNNING according to the worker's ``taken`` flag.
        self.terminal_status: RequestStatus | None = None
        self.channel: CoalescingChannel[StepEvent] = CoalescingChannel(event_buffer)
        self.outcome: GenerationOutput | BaseException | _Taken | None = None
        self.metrics: RequestMetrics | None = None
        self.done = anyio.Event()
        self.handle_ref: weakref.ref[RequestHandle] | None = None
        self.t_admitted = time.perf_counter()
        self.t_abort: float | None = None
        self.steps_at_abort = 0
        self.t_terminal: float | None = None
        # L95: its key in the engine's result cache (None: never cached), and whether
        # it was answered from it at admission.
        self.result_key: str | None = None
        self.result_hit = False

    def mark_abort(self) -> None:
        """Note when, and at which step, the abort (or shutdown's cut) was asked."""
        self.t_abort = time.perf_counter()
        # The worker thread's count, read here: a step in flight counts as after.
        self.steps_at_abort = self.steps_done

    @property
    def status(self) -> RequestStatus:
        """Terminal once the engine ended it; RUNNING from the moment the worker took it."""
        if self.terminal_status is not None:
            return self.terminal_status
        return RequestStatus.RUNNING if self.taken else RequestStatus.WAITING

    def build_metrics(self, status: RequestStatus) -> RequestMetrics:
        """Fill the metrics now, as the request becomes terminal with ``status``."""
        now = self.t_terminal = time.perf_counter()
        taken = self.t_taken
        denoised = self.t_denoised
        released = self.t_released if self.t_released is not None else now
        stages: dict[str, float] = {}
        if taken is not None:
            stages["encode"] = self.prepare_s
            if self.steps_done:
                stages["denoise"] = self.denoise_s
        if self.decode_s:
            stages["decode"] = self.decode_s
        abort_latency = steps_after_abort = None
        if status is RequestStatus.ABORTED and self.t_abort is not None:
            abort_latency = max(0.0, released - self.t_abort)
            steps_after_abort = max(0, self.steps_done - self.steps_at_abort)
        suspended_s = self.suspended_s
        since = self.t_suspended
        if since is not None:  # ended while suspended (L61)
            suspended_s += max(0.0, released - since)
        admitted = self.t_admitted
        timeline = RequestTimeline(
            admitted_ns=time.time_ns() - round((now - admitted) * 1e9),
            runs=tuple((start - admitted, end - admitted) for start, end in self.runs),
            denoised_s=None if denoised is None else denoised - admitted,
            ended_s=now - admitted,
        )
        return RequestMetrics(
            queue_wait_s=(taken if taken is not None else now) - self.t_admitted,
            exec_s=0.0 if taken is None else (denoised or released) - taken,
            output_ready_wait_s=0.0 if denoised is None else now - denoised,
            stage_durations=stages,
            steps_done=self.steps_done,
            total_s=now - self.t_admitted,
            abort_latency_s=abort_latency,
            steps_after_abort=steps_after_abort,
            preemptions=self.preemptions,
            suspended_s=suspended_s,
            cache=self.cache_metrics,
            prompt_cache=self.prompt_cache,
            timeline=timeline,
            result_cache_hit=self.result_hit,
            weight_version=self.weights,
        )


async def wait_shielded(
    event: anyio.Event,
    *,
    late_s: float | None = None,
    on_late: Callable[[], None] | None = None,
) -> None:
    """Wait for ``event`` even while the caller is being cancelled.

    An anyio shield does not stop a native asyncio ``Task.cancel()`` (Ray Serve and
    Starlette use it): it raises ``CancelledError`` inside the shield. Such a
    cancellation is held until the event is set, then re-raised, never dropped.

    Args:
        event: what to wait for.
        late_s: with ``on_late``, call ``on_late()`` once if ``event`` is still not
            set after this many seconds, and go on waiting.
        on_late: see ``late_s``.

    Cancellation:
        Deferred until ``event`` is set, then propagated.
    """
    pending: BaseException | None = None
    late = math.inf if late_s is None or on_late is None else anyio.current_time() + late_s
    with anyio.CancelScope(shield=True):
        while not event.is_set():
            try:
                with anyio.move_on_at(late):
                    await event.wait()
            except anyio.get_cancelled_exc_class() as exc:
                pending = exc
                continue
            if not event.is_set() and on_late is not None and anyio.current_time() >= late:
                late = math.inf
                on_late()
    if pending is not None:
        raise pending
