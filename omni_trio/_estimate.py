"""Admission's estimates: refuse a request whose deadline cannot be met (L62), or
whose one step would hold a worker too long (L4).

The timer that aborts a request once its deadline passed is ``_deadlines``; this is
the check before it: ``submit`` asks whether the request could finish in time, from
what the workers measured and what waits. Runs in the event loop's thread.

The estimate counts only the work that would run before the request:

- the waiting work ranked ahead of it, on every queue (new requests and every
  worker's suspended ones): requests of a higher priority, and of its priority
  those whose deadline is earlier or equal (a newcomer is admitted after
  everyone). That is ``WaitingQueue.steps_ahead``: a sum per priority above, a
  prefix sum by deadline at its own (``_stepsums``);
- per worker, its running batch's steps, and only when the request could neither
  join that batch nor preempt it: the boundary policy's own rule
  (``RunningBatch.steps_before``, ``_scheduler.make_room``), applied to the batch
  the worker last published;
- its own steps.

A request that the engine would start at the next boundary (nothing ranked ahead
of it, and an idle worker or a batch it can join or preempt) is never refused,
whatever its own steps: refusing it would only turn away work that starts now.

Cost, with n requests waiting, k distinct priorities among them, w workers of
batches of at most b: O(k + log n) for the steps ahead, O(w b) for the batches,
under the pool's lock (microseconds); never a scan of a queue.

The step-time bound (``check_step_time``, ``EngineConfig.max_step_s``) reads what
the workers measured of their warm steps by shape (``_steptimes``): a step is left
only at its end or at a cancel point, so a request whose one step alone would
outlast the bound could hold its worker past any abort, deadline or shutdown. It
refuses only on a lower bound (a shape no larger than the request's, measured warm),
never on an extrapolation. O(w s), for s shapes measured (at most 64).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING

from ._errors import DeadlineError, InvalidRequestError
from ._steptimes import lower_bound
from ._workitem import step_pixels

if TYPE_CHECKING:
    from ._pool import Pool
    from ._request import GenerationRequest
    from ._worker import Worker

__all__ = ["check_deadline", "check_step_time"]


def check_deadline(
    request: GenerationRequest,
    request_id: str,
    *,
    key: Hashable,
    deadline: float,
    workers: Sequence[Worker],
    pool: Pool,
) -> None:
    """Refuse ``request`` if the estimate of its completion misses its deadline (L62).

    On the best of the live ``workers``: its measured step time (a moving
    average) times the steps that would run before the request (see the module's
    docstring), the ranked-ahead ones shared out over full batches on every live
    worker, plus the request's own. It errs towards admitting (full batches; the
    timer aborts what still misses); while a live worker has measured no step
    yet, it admits.

    Args:
        request: the request, with its ``deadline_s``.
        request_id: its id, for the error.
        key: its batch key.
        deadline: its absolute deadline on the queue's clock, as it would be ranked.
        workers: the live workers.
        pool: their queues.

    Raises:
        DeadlineError: the estimate exceeds ``request.deadline_s``.
    """
    deadline_s = request.deadline_s
    if deadline_s is None or not workers:
        return
    priority = request.priority
    # One moment: the queues, and the batches the workers publish under this lock
    # whenever a request moves between a queue and a batch.
    ahead, batches = pool.admission_view(priority, deadline, workers)
    timed: list[tuple[int, float]] = []
    for worker, batch in zip(workers, batches, strict=True):
        step_s = batch.step_s
        if step_s is None:
            return
        wait = batch.steps_before(
            key=key, priority=priority, tenant=request.tenant, rules=worker.rules
        )
        timed.append((wait, step_s))
    if not ahead and any(wait == 0 for wait, _ in timed):
        return  # it starts at the next boundary
    shared = -(-ahead // (workers[0].max_batch * len(workers)))
    own = request.denoise_steps
    wait, step_s = min(timed, key=lambda timing: (timing[0] + shared + own) * timing[1])
    estimate = (wait + shared + own) * step_s
    if estimate > deadline_s:
        raise DeadlineError(
            f"the deadline of {deadline_s:g} s cannot be met: the estimate is "
            f"{estimate:.3f} s ({wait + shared + own} steps of {step_s * 1e3:.1f} ms: "
            f"{wait} of a running batch, {shared} for the {ahead} steps ranked ahead"
            f" shared over full batches, {own} its own)",
            estimate_s=estimate,
            deadline_s=deadline_s,
            request_id=request_id,
        )


def check_step_time(
    request: GenerationRequest, *, workers: Sequence[Worker], limit: float | None
) -> None:
    """Refuse ``request`` if one step of it alone would take longer than ``limit`` (L4).

    Refused only when every live worker measured, warm, a shape of the request's pixels
    or fewer whose step alone took longer than ``limit`` (``_steptimes``: a lower
    bound, never an extrapolation); else, or with no ``limit``, it admits.

    Raises:
        InvalidRequestError: the bound exceeds ``limit``, naming what was measured and
            the field to make smaller: ``num_images`` when it is over 1, else
            ``num_frames`` for a video, else ``height``.
    """
    if limit is None or not workers:
        return
    pixels = step_pixels(request)
    bounds = []
    for worker in workers:
        bound = lower_bound(worker.batch.shapes, pixels)
        if bound is None or bound.step_s <= limit:
            return
        bounds.append(bound)
    best = min(bounds, key=lambda shape: shape.step_s)
    if request.num_images > 1:
        field = "num_images"
    elif request.num_frames is not None:
        field = "num_frames"
    else:
        field = "height"
    frames = "" if request.num_frames is None else f" x {request.num_frames} frames"
    measured = (
        "a step of that size"
        if best.pixels == pixels
        else f"a smaller step ({best.pixels:,} pixels)"
    )
    raise InvalidRequestError(
        f"one step of {request.num_images} x {request.height} x {request.width}{frames}"
        f" ({pixels:,} pixels) would take at least {best.step_s:.1f} s: {measured} took"
        f" {best.step_s:.3g} s at its fastest of {best.warm} warm steps here, over the"
        f" engine's max_step_s of {limit:g} s: ask for fewer or smaller images",
        field=field,
    )
