"""Admission's deadline estimate (L62): refuse a request whose deadline cannot be met.

The timer that aborts a request once its deadline passed is ``_deadlines``; this is
the check before it: ``submit`` asks whether the request could finish in time, from
what the workers measured. Runs in the event loop's thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ._errors import DeadlineError

if TYPE_CHECKING:
    from ._pool import Pool
    from ._request import GenerationRequest
    from ._worker import Worker

__all__ = ["check_deadline"]


def check_deadline(
    request: GenerationRequest, request_id: str, *, workers: Sequence[Worker], pool: Pool
) -> None:
    """Refuse ``request`` if the estimate of its completion misses its deadline (L62).

    The estimate, on the best of the live ``workers``, is its measured step time
    (its moving average) times the steps ahead: those left of its running batch,
    those of the waiting requests of equal or higher priority shared out over full
    batches on every live worker, and the request's own. It errs towards admitting
    (it assumes full batches; the timer aborts what still misses); while a live
    worker has measured no step yet it admits. Cost: O(k + w), k the distinct
    priorities waiting and w the workers, never a scan of the queue.

    Raises:
        DeadlineError: the estimate exceeds ``request.deadline_s``.
    """
    deadline_s = request.deadline_s
    measured = [(worker.step_s, worker.steps_left) for worker in workers]
    if deadline_s is None or not measured:
        return
    timed = [(step_s, left) for step_s, left in measured if step_s is not None]
    if len(timed) < len(measured):
        return
    waiting = pool.steps_ahead(request.priority)
    shared = -(-waiting // (workers[0].max_batch * len(workers)))
    estimate, left, step_s = min(
        ((left + shared + request.denoise_steps) * step_s, left, step_s) for step_s, left in timed
    )
    if estimate > deadline_s:
        steps = left + shared + request.denoise_steps
        raise DeadlineError(
            f"the deadline of {deadline_s:g} s cannot be met: the estimate is "
            f"{estimate:.3f} s ({steps} steps of {step_s * 1e3:.1f} ms)",
            estimate_s=estimate,
            deadline_s=deadline_s,
            request_id=request_id,
        )
