"""The exception tree of omni_trio.

::

    OmniTrioError
    ├── EngineClosedError       submit after shutdown began; result() of a request
    │                           cut off by shutdown
    ├── EngineDeadError         the worker died; every live request gets it; the engine is unusable
    ├── InvalidOutputError      a runner's output broke the output contract (shape, dtype,
    │                           NaN, range); only ever the __cause__ of a RequestFailedError
    └── RequestError            (.request_id)
        ├── InvalidRequestError     also a ValueError; bad field values, unknown extra keys
        ├── DuplicateRequestError   a live request already has this id
        ├── QueueFullError          max_waiting reached (backpressure)
        ├── DeadlineError           .estimate_s: the engine's estimate says deadline_s
        │                           cannot be met (refused at admission)
        ├── RequestAbortedError     .reason: an AbortReason ("user", "consumer_gone",
        │                           "cancelled", "deadline", ...) or the str given
        └── RequestFailedError      the runner raised or returned a bad output; __cause__ is
                                    the runner's exception or an InvalidOutputError

Cancellation is never one of these: the backend's cancellation exception always
propagates as itself.
"""

from __future__ import annotations

import copyreg
from typing import Any

__all__ = [
    "DeadlineError",
    "DuplicateRequestError",
    "EngineClosedError",
    "EngineDeadError",
    "InvalidOutputError",
    "InvalidRequestError",
    "OmniTrioError",
    "QueueFullError",
    "RequestAbortedError",
    "RequestError",
    "RequestFailedError",
]


class OmniTrioError(Exception):
    """Base class of every error that omni_trio raises on purpose."""


class EngineClosedError(OmniTrioError):
    """The engine is shutting down or closed, or shutdown cut this request off."""


class EngineDeadError(OmniTrioError):
    """The engine's worker thread died; the engine can serve nothing more."""


class InvalidOutputError(OmniTrioError):
    """A runner returned images (or a preview) that break the output contract.

    The engine never delivers such an output: the request fails with
    ``RequestFailedError``, whose ``__cause__`` is this error. The message names
    the call and what was wrong, e.g. "the runner's decode returned images of
    shape (1, 3, 8, 8), expected (2, 3, 16, 16)".
    """


class RequestError(OmniTrioError):
    """An error that concerns one request, named by ``request_id``."""

    def __init__(self, message: str, *, request_id: str | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickle (as Ray and multiprocessing do) without calling __init__ again: its
        # fields are keyword-only, which the default ``cls(*args)`` cannot pass, and
        # a subclass may have built ``args`` from them. Restore args and fields as state.
        newobj = copyreg.__newobj__  # type: ignore[attr-defined]  # missing from typeshed
        return (newobj, (type(self),), {**self.__dict__, "args": self.args})


class InvalidRequestError(RequestError, ValueError):
    """A request field has a bad type or value; ``field`` names it."""

    def __init__(self, message: str, *, field: str, request_id: str | None = None) -> None:
        super().__init__(f"{field}: {message}", request_id=request_id)
        self.field = field


class DuplicateRequestError(RequestError):
    """A live request already has this id."""


class QueueFullError(RequestError):
    """The waiting queue holds ``max_waiting`` requests already."""


class DeadlineError(RequestError):
    """The request's ``deadline_s`` cannot be met, by the engine's own estimate.

    ``estimate_s`` is the estimated time to its completion, ``deadline_s`` the
    request's deadline; the message states both.
    """

    def __init__(
        self, message: str, *, estimate_s: float, deadline_s: float, request_id: str | None = None
    ) -> None:
        super().__init__(message, request_id=request_id)
        self.estimate_s = estimate_s
        self.deadline_s = deadline_s


class RequestAbortedError(RequestError):
    """The request was aborted before it completed; ``reason`` says why."""

    def __init__(self, message: str, *, reason: str, request_id: str | None = None) -> None:
        super().__init__(message, request_id=request_id)
        self.reason = reason


class RequestFailedError(RequestError):
    """The runner failed this request; ``__cause__`` says how.

    ``__cause__`` is the exception the runner raised, or an ``InvalidOutputError``
    when it returned a bad output. The message was formatted once, when the
    failure happened, so ``str()`` of this error never runs the runner's code.
    """
