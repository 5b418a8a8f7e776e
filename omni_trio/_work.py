"""What the engine's threads know of a request, and what they tell the event loop.

A ``WorkItem`` is the thread-side half of a request record: the request, its
cancellation token and the fields the worker owns (runner state, step count,
timestamps). Threads never touch event-loop objects; they post ``Message``\\s.
"""

from __future__ import annotations

import contextlib
import time
import traceback
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from ._config import GenerationRequest

if TYPE_CHECKING:
    import torch

    from .runners import Runner

__all__ = [
    "SHUTDOWN",
    "CancelToken",
    "Completed",
    "Died",
    "Exited",
    "Message",
    "Released",
    "Stepped",
    "WorkItem",
    "discard_quietly",
    "discard_state",
    "release",
]

#: The cancellation reason the engine uses when shutdown cuts a request off.
SHUTDOWN = "shutdown"


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
        "decode_s",
        "denoise_s",
        "prepare_s",
        "reading",
        "request",
        "request_id",
        "state",
        "steps_done",
        "t_denoised",
        "t_released",
        "t_taken",
        "taken",
        "token",
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
        # Owned by whichever engine thread holds the item.
        self.state: object | None = None
        self.steps_done = 0
        self.t_taken: float | None = None
        self.t_denoised: float | None = None
        self.t_released: float | None = None
        self.prepare_s = 0.0
        self.denoise_s = 0.0
        self.decode_s = 0.0


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
