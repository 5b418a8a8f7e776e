"""What the engine's threads tell the event loop, and the release that ends a request.

Threads never touch event-loop objects: they post one of these messages, which
the engine applies in order on the loop (see ``_engine``). A failure or a death
travels with its message formatted already (``_failure``): the loop never runs a
runner's code to describe what went wrong.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from ._cacheplan import read_cache_metrics
from ._failure import Failure, describe, detach, failure, format_traceback
from ._workitem import WorkItem

if TYPE_CHECKING:
    import torch

    from ._results import KeptOutput
    from ._runner import Runner
    from ._sampling import Trajectory

__all__ = [
    "Completed",
    "Died",
    "Exited",
    "Held",
    "Message",
    "Post",
    "Released",
    "Stepped",
    "died",
    "discard_quietly",
    "discard_state",
    "ended",
    "release",
]


W = TypeVar("W", bound=WorkItem)


@dataclass(frozen=True, slots=True)
class Stepped(Generic[W]):
    """The request finished step ``step`` of ``total``; ``preview`` when one was made."""

    item: W
    step: int
    total: int
    preview: torch.Tensor | None


@dataclass(frozen=True, slots=True)
class Completed(Generic[W]):
    """The request's images are decoded and on the host; its state is released.

    ``video`` is a video request's ``[N, F, C, H, W]`` (``images`` its first frames);
    ``kept`` the copy of them its result cache keeps (L95), made in this thread;
    ``trajectory`` the request's trajectory, where it asked for one (L100).
    """

    item: W
    images: torch.Tensor
    video: torch.Tensor | None = None
    kept: KeptOutput | None = None
    trajectory: Trajectory | None = None


@dataclass(frozen=True, slots=True)
class Released(Generic[W]):
    """The request's state is released without an output.

    ``failure`` says why the runner failed it; without one, the request was
    cancelled and its token says why.
    """

    item: W
    failure: Failure | None


@dataclass(frozen=True, slots=True)
class Died:
    """An engine thread died. ``message`` is formatted already.

    ``worker`` is the index of the worker whose thread died (the other workers go
    on, L43); ``None`` for the engine itself (nothing more will run).
    """

    error: BaseException
    message: str
    traceback: str = ""
    worker: int | None = None


@dataclass(frozen=True, slots=True)
class Held:
    """Worker ``worker`` runs nothing in hold ``round`` (L103): what ran is suspended."""

    worker: int
    round: int


@dataclass(frozen=True, slots=True)
class Exited:
    """Worker ``worker``'s threads have finished; its runner is closed."""

    worker: int = 0


Message = Stepped[W] | Completed[W] | Released[W] | Died | Exited | Held
Post = Callable[[Any], None]


def discard_state(runner: Runner[Any], item: WorkItem) -> Exception | None:
    """Hand ``item``'s state back to the runner; return the runner's error, if any.

    Its step cache's metrics are read first (L84); an error there is reported as
    the discard's, and the state is discarded all the same.
    """
    state, item.state = item.state, None
    item.t_released = now = time.perf_counter()
    item.end_run(now)
    if state is None:
        return None
    error = read_cache_metrics(runner, item, state)
    try:
        runner.discard(state)
    except Exception as exc:
        return exc
    return error


def discard_quietly(runner: Runner[Any], item: WorkItem) -> None:
    """Discard ``item``'s state when the engine is dying: free what we can, report nothing."""
    with contextlib.suppress(BaseException):
        discard_state(runner, item)


def release(
    runner: Runner[Any],
    item: WorkItem,
    post: Post,
    error: Exception | None = None,
    *,
    call: str = "",
    batch: tuple[str, ...] | None = None,
) -> None:
    """Discard ``item``'s state and post how it ended.

    Failed if ``error`` (what the runner's ``call`` raised, or an
    ``InvalidOutputError``, for every request of ``batch``) or if the discard
    raised; else cancelled.
    """
    discard_error = discard_state(runner, item)  # always, failed or not
    # "is None", not "or": an exception's __bool__ is the runner's code.
    if error is None and discard_error is not None:
        error, call, batch = discard_error, "discard", None
    post(ended(item, error, call, batch))


def ended(
    item: WorkItem, error: Exception | None, call: str, batch: tuple[str, ...] | None = None
) -> Released[WorkItem]:
    """The message for ``item``, released: failed by ``error`` in ``call``, or cancelled."""
    if error is None:
        return Released(item, None)
    return Released(item, failure(item.request_id, error, call, batch))


def died(error: BaseException, what: str, *, worker: int | None = None) -> Died:
    """The message for an engine thread's death by ``error``; ``what`` says whose.

    Never raises: an engine that is dying must still say so, or nothing ends.
    """
    detach(error)
    return Died(error, f"{what}: {describe(error)}", format_traceback(error), worker)
