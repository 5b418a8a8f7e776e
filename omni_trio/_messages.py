"""What the engine's threads tell the event loop, and the release that ends a request.

Threads never touch event-loop objects: they post one of these messages, which
the engine applies in order on the loop (see ``_engine``).
"""

from __future__ import annotations

import contextlib
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from ._workitem import WorkItem

if TYPE_CHECKING:
    import torch

    from ._runner import Runner

__all__ = [
    "Completed",
    "Died",
    "Exited",
    "Message",
    "Post",
    "Released",
    "Stepped",
    "discard_quietly",
    "discard_state",
    "release",
]


W = TypeVar("W", bound=WorkItem)


@dataclass(frozen=True, slots=True)
class Stepped(Generic[W]):
    """The request finished step ``step``; ``preview`` when one was made."""

    item: W
    step: int
    preview: torch.Tensor | None


@dataclass(frozen=True, slots=True)
class Completed(Generic[W]):
    """The request's images are decoded and on the host; its state is released."""

    item: W
    images: torch.Tensor


@dataclass(frozen=True, slots=True)
class Released(Generic[W]):
    """The request's state is released without an output.

    ``error`` is the runner's exception for a failure; without one, the request
    was cancelled and its token says why.
    """

    item: W
    error: Exception | None


@dataclass(frozen=True, slots=True)
class Died:
    """An engine thread died; nothing more will run."""

    error: BaseException


@dataclass(frozen=True, slots=True)
class Exited:
    """Every engine thread has finished; the runner is closed."""


Message = Stepped[W] | Completed[W] | Released[W] | Died | Exited
Post = Callable[[Any], None]


def discard_state(runner: Runner[Any], item: WorkItem) -> Exception | None:
    """Hand ``item``'s state back to the runner; return the runner's error, if any."""
    state, item.state = item.state, None
    item.t_released = time.perf_counter()
    if state is None:
        return None
    try:
        runner.discard(state)
    except Exception as exc:
        return exc
    return None


def discard_quietly(runner: Runner[Any], item: WorkItem) -> None:
    """Discard ``item``'s state when the engine is dying: free what we can, report nothing."""
    with contextlib.suppress(BaseException):
        discard_state(runner, item)


def release(runner: Runner[Any], item: WorkItem, post: Post, error: Exception | None) -> None:
    """Discard ``item``'s state and post how it ended (failed if anything raised)."""
    discard_error = discard_state(runner, item)  # always, failed or not
    error = error or discard_error
    if error is not None:
        # The request's error keeps the runner's exception as its cause; its
        # frames must not keep the runner's locals (batch states, tensors) alive.
        traceback.clear_frames(error.__traceback__)
    post(Released(item, error))
