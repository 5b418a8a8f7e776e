"""What the engine's threads know of a request: its ``WorkItem`` and cancel token.

A ``WorkItem`` is the thread-side half of a request record: the request, its
cancellation token and the fields the worker owns (runner state, step count,
timestamps). Threads never touch event-loop objects; they post messages
(``_messages``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Hashable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._checkpoint import CheckpointPolicy
    from ._request import GenerationRequest
    from ._stepcache import CacheMetrics, PromptCacheMetrics
    from ._weights import WeightVersion

__all__ = ["CancelToken", "WorkItem", "step_pixels"]


def step_pixels(request: GenerationRequest) -> int:
    """The pixels one denoise step of ``request`` works on: ``num_images x height x
    width x max(1, num_frames)`` (what admission's step-time estimate scales by, L4)."""
    return request.num_images * request.height * request.width * max(1, request.num_frames or 1)


class CancelToken:
    """A flag the worker reads at every step boundary; the first reason wins.

    A plain attribute read (no lock): setting and reading one reference is atomic,
    and a reader that misses a concurrent set sees it at the next boundary.
    """

    __slots__ = ("reason",)

    def __init__(self) -> None:
        self.reason: str | None = None

    def cancel(self, reason: str) -> bool:
        """Request cancellation; return whether this call was the first."""
        if self.reason is not None:
            return False
        self.reason = reason
        return True


class WorkItem:
    """One admitted request, as the engine's threads see it.

    Hashed and compared by identity: it *is* the admission.
    """

    __slots__ = (
        "batch_key",
        "cache_metrics",
        "cache_stage",
        "checkpoint",
        "decode_s",
        "denoise_s",
        "keep_result",
        "preemptions",
        "prepare_s",
        "prompt_cache",
        "rank_deadline",
        "reading",
        "request",
        "request_id",
        "resume_from",
        "runs",
        "sequence",
        "state",
        "step_pixels",
        "steps_done",
        "steps_total",
        "suspended_s",
        "t_checkpoint",
        "t_deadline",
        "t_denoised",
        "t_released",
        "t_run",
        "t_suspended",
        "t_taken",
        "taken",
        "token",
        "weights",
        "worker",
    )

    def __init__(self, request: GenerationRequest, request_id: str, batch_key: Hashable) -> None:
        self.request = request
        self.request_id = request_id
        self.batch_key = batch_key
        self.token = CancelToken()
        # Set by the event loop while a consumer iterates the handle (previews).
        self.reading = False
        # Set by the worker, under the queue lock, when it takes the item: from
        # then on the request is running, whatever messages are still in flight.
        self.taken = False
        # The index of the worker that took it (L42: it lives its life there), and the
        # weights it runs on (L102), named when it is taken.
        self.worker: int | None = None
        self.weights: WeightVersion | None = None
        # Owned by whichever engine thread holds the item.
        self.state: object | None = None
        self.steps_done = 0
        # The steps the runner runs (L75): the request's ``denoise_steps`` (fewer
        # than ``num_steps`` for an image with strength < 1), unless a whole-call
        # runner's pipeline says otherwise.
        self.steps_total = request.denoise_steps
        self.step_pixels = step_pixels(request)
        self.t_taken: float | None = None
        self.t_denoised: float | None = None
        self.t_released: float | None = None
        # Its run segments on the worker (perf_counter): each from a take or a resume
        # to a suspension, its last step or its release; the open one's start. Read by
        # the loop once the request is terminal (its timeline, for traces: L99).
        self.runs: list[tuple[float, float]] = []
        self.t_run: float | None = None
        self.prepare_s = 0.0
        self.denoise_s = 0.0
        self.decode_s = 0.0
        # Its place in the queue's ranking, kept so that a suspended request comes
        # back to the place it had (L61): the absolute deadline it was ranked by
        # and the admission sequence the queue gave it.
        self.rank_deadline = math.inf
        self.sequence = 0
        # L61: how often it was suspended, the time it spent suspended before its
        # last resume, and when its current suspension began (None: not suspended).
        self.preemptions = 0
        self.suspended_s = 0.0
        self.t_suspended: float | None = None
        # L84: the deadline on this process's perf_counter clock (the threads' own;
        # the loop's clock is not theirs to read), the stages its step-cache
        # threshold was loosened by, and what the runner said its cache did, read
        # just before the release.
        self.t_deadline = (
            None if request.deadline_s is None else time.perf_counter() + request.deadline_s
        )
        self.cache_stage = 0
        self.cache_metrics: CacheMetrics | None = None
        # L94: what the runner's prompt cache said it did for the request's texts,
        # read with the step cache's.
        self.prompt_cache: PromptCacheMetrics | None = None
        # L78: how it is checkpointed (None: never), the checkpoint its worker
        # restores instead of preparing (dropped once read), and when the last
        # checkpoint was taken (perf_counter; None until its first step).
        self.checkpoint: CheckpointPolicy | None = None
        self.resume_from: bytes | None = None
        self.t_checkpoint: float | None = None
        # L95: the materializer keeps a copy of its output for the result cache when
        # that output is at most this many bytes (0: none is kept).
        self.keep_result = 0

    def end_run(self, at: float) -> None:
        """Its run segment on the worker ends at ``at`` (a suspension, its last step, its
        release); nothing if none is open."""
        start, self.t_run = self.t_run, None
        if start is not None:
            self.runs.append((start, at))

    def rank(self) -> tuple[int, float, int]:
        """Its rank, as the queue compares them: the smallest is the best-ranked."""
        return (-self.request.priority, self.rank_deadline, self.sequence)
