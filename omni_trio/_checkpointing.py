"""The worker's side of checkpoints (L78): restore a request from one, take them as it runs.

With a runner that declares ``checkpoints``: after a step, a member whose
``CheckpointPolicy`` interval has passed gets a copy of its state taken (the runner's
``checkpoint``: a copy, no serialization), handed to the materializer thread, which
makes it bytes and gives it to the policy's sink. A request admitted with
``resume_from`` is restored from it instead of prepared; a checkpoint the runner
refuses is logged and the request is prepared from step 0.

Runs in the worker's thread, outside the pool's lock.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

from ._checkpoint import CheckpointError
from ._log import WORKER

if TYPE_CHECKING:
    from ._materialize import Materializer
    from ._runner import CheckpointRunner, Runner
    from ._workitem import WorkItem

__all__ = ["restored", "take_checkpoints"]


def restored(runner: Runner[Any], item: WorkItem) -> object | None:
    """The state ``item``'s checkpoint holds, or ``None`` (refused: logged) to prepare.

    Reads ``item.resume_from`` once and drops it; sets ``item.steps_done``.

    Raises:
        Exception: what the runner's ``restore`` raised, other than a refusal.
    """
    data, item.resume_from = item.resume_from, None
    assert data is not None
    taking = cast("CheckpointRunner[Any]", runner)
    try:
        state, steps = taking.restore(item.request, item.request_id, data)
    except CheckpointError as exc:
        WORKER.warning(
            "the checkpoint of %s is refused (%s): it starts from step 0",
            item.request_id,
            exc,
            extra={"request_id": item.request_id},
        )
        return None
    item.steps_done = steps
    state_object: object = state
    return state_object


def take_checkpoints(
    runner: Runner[Any], materializer: Materializer, items: Sequence[WorkItem]
) -> None:
    """Hand a copy of each due member's state to the materializer, to make bytes.

    A member is due at the first boundary ``every_s`` after its last checkpoint (the
    interval counts from its first step; 0: every boundary). A runner's ``checkpoint``
    that raises is logged once, and that request is not checkpointed again.
    """
    now = time.perf_counter()
    taking = cast("CheckpointRunner[Any]", runner)
    for item in items:
        policy = item.checkpoint
        if policy is None or item.steps_done >= item.steps_total:
            continue
        last = item.t_checkpoint
        if last is None:  # its first step: the interval counts from here
            item.t_checkpoint = now
            if policy.every_s > 0:
                continue
        elif now - last < policy.every_s:
            continue
        item.t_checkpoint = now
        try:
            copy = taking.checkpoint(item.state)
        except Exception as exc:
            item.checkpoint = None  # logged once: no more checkpoints of it
            WORKER.warning(
                "%s is not checkpointed (%s: %s)",
                item.request_id,
                type(exc).__name__,
                exc,
                extra={"request_id": item.request_id},
            )
            continue
        materializer.checkpoint(item, copy, item.steps_done)
