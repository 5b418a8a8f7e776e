"""HTTP errors as OpenAI-style error objects, and the engine's errors mapped to them.

Every error the server sends has the body::

    {"error": {"message": "...", "type": "...", "param": "...", "code": "..."}}

``param`` names the request field at fault (``None`` when no field is), so a
client can point at it. Engine errors are mapped at this boundary only:

==========================  ======  ========================  =====================
engine error                status  type                      code
==========================  ======  ========================  =====================
InvalidRequestError         400     invalid_request_error     invalid_value
QueueFullError              429     rate_limit_error          queue_full
DeadlineError               429     rate_limit_error          deadline_unmeetable
EngineClosedError           503     server_error              shutting_down
EngineDeadError             503     server_error              engine_dead
EngineSleepingError         503     server_error              sleeping (L103)
RequestAbortedError         503     server_error              request_aborted
                                                              (reason in the message,
                                                              e.g. ``deadline``)
RequestFailedError          500     server_error              generation_failed
==========================  ======  ========================  =====================

What the model raised never reaches a client: a 5xx from a failure (the runner
raised, the worker died) says only that it failed, for which request, and that
the server's log has the details; the log gets the traceback at ERROR, once
(``omni_trio.engine`` for a runner's failure or a worker's death, as the engine
logs them; ``omni_trio.serve`` for anything else). The client's own mistakes
(400) keep their precise messages.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from types import MappingProxyType

from .._errors import (
    DeadlineError,
    EngineClosedError,
    EngineDeadError,
    InvalidRequestError,
    OmniTrioError,
    QueueFullError,
    RequestAbortedError,
    RequestError,
    RequestFailedError,
)
from .._weights import EngineSleepingError

__all__ = ["FIELD_PARAMS", "ApiError", "api_error_from", "server_error", "unexpected_error"]

_log = logging.getLogger("omni_trio.serve")

#: The HTTP body field behind each ``GenerationRequest`` field, for ``param``.
FIELD_PARAMS: Mapping[str, str] = MappingProxyType(
    {
        "prompt": "prompt",
        "negative_prompt": "negative_prompt",
        "num_steps": "num_inference_steps",
        "height": "size",
        "width": "size",
        "guidance_scale": "guidance_scale",
        "seed": "seed",
        "num_images": "n",
        "preview_every": "preview_every",
        "priority": "priority",
        "deadline_s": "deadline_ms",
    }
)

#: The metrics outcome of each rejecting status.
_OUTCOMES: Mapping[int, str] = MappingProxyType(
    {
        400: "invalid",
        401: "unauthorized",
        403: "unauthorized",
        413: "too_large",
        429: "queue_full",
        503: "unavailable",
    }
)

#: Outcomes of codes that share a status with another refusal.
_CODE_OUTCOMES: Mapping[str, str] = MappingProxyType(
    {
        "deadline_unmeetable": "deadline_refused",
        "rate_limited": "rate_limited",
        "tenant_jobs_full": "rate_limited",
    }
)


class ApiError(Exception):
    """An error to answer with an HTTP status and an OpenAI-style error object.

    Args:
        status: the HTTP status code.
        message: what went wrong, for a person.
        type: the error's ``type`` (``invalid_request_error``, ``server_error``, ...).
        param: the request field at fault, if any.
        code: a short machine-readable code.
        headers: extra response headers (``Retry-After``, ``Connection``).
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",  # the OpenAI field's name
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers: Mapping[str, str] = MappingProxyType(dict(headers or {}))

    @property
    def outcome(self) -> str:
        """The ``outcome`` label this error is counted under in ``/metrics``."""
        by_code = _CODE_OUTCOMES.get(self.code) if self.code is not None else None
        return by_code or _OUTCOMES.get(self.status, "failed")

    def body(self) -> dict[str, object]:
        """The JSON body: ``{"error": {"message", "type", "param", "code"}}``."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def invalid(message: str, param: str | None, code: str = "invalid_value") -> ApiError:
    """A 400 error naming ``param``."""
    return ApiError(400, message, param=param, code=code)


def _invalid_request(exc: InvalidRequestError) -> ApiError:
    param = FIELD_PARAMS.get(exc.field, exc.field)
    # The engine says "num_steps: must be <= 50"; the client sent num_inference_steps.
    detail = str(exc).removeprefix(f"{exc.field}: ")
    if param == "size":
        detail = f"{exc.field} {detail}"
    return invalid(f"{param}: {detail}", param)


def _hidden_failure(
    exc: OmniTrioError,
    request_id: str | None,
    what: str,
    code: str,
    status: int = 500,
    *,
    logged: bool = False,
) -> ApiError:
    """Tell the client only ``what`` happened, and to whom; log ``exc`` unless ``logged``.

    The engine logs a runner's failure and a worker's death itself, once, with
    the traceback (``omni_trio.engine``); anything else is logged here.
    """
    named = f" for request {request_id}" if request_id is not None else ""
    if not logged:
        _log.error("%s%s", what, named, exc_info=exc, extra={"request_id": request_id})
    return server_error(f"{what}{named}; the server's log has the details", code, status)


def unexpected_error() -> ApiError:
    """The answer to an error the app did not expect (a bug): generic, as JSON.

    Starlette re-raises the exception after this answer is sent, so the server that
    runs the app logs its traceback; the client learns nothing of its text.
    """
    return server_error("the server failed; the server's log has the details", "internal_error")


def server_error(message: str, code: str, status: int = 500) -> ApiError:
    """A failure of the server's (``type`` ``server_error``): ``message`` says what
    failed and where its details are (the log), never the exception's text."""
    return ApiError(status, message, type="server_error", code=code)


def _retry_later(status: int, message: str, kind: str, code: str, retry_after_s: int) -> ApiError:
    """An error the client may retry after ``retry_after_s`` (its ``Retry-After``)."""
    headers = {"Retry-After": str(retry_after_s)}
    return ApiError(status, message, type=kind, code=code, headers=headers)


def api_error_from(
    exc: OmniTrioError, *, retry_after_s: int = 1, request_id: str | None = None
) -> ApiError:
    """Map an engine error to the HTTP error that reports it.

    Failures (the runner raised, the worker died, anything unexpected) are logged
    at ERROR with their traceback (by the engine, or here), and answered with a
    message that names the request but carries none of the exception's text.

    Args:
        exc: the engine's error.
        retry_after_s: the ``Retry-After`` of 429 and 503.
        request_id: the request's id, for the message (else ``exc.request_id``).
    """
    if request_id is None and isinstance(exc, RequestError):
        request_id = exc.request_id
    match exc:
        case InvalidRequestError():
            return _invalid_request(exc)
        case QueueFullError():
            message = f"the server is busy ({exc}); retry later"
            return _retry_later(429, message, "rate_limit_error", "queue_full", retry_after_s)
        case DeadlineError():
            message = (
                f"the deadline cannot be met: the estimate is {exc.estimate_s:.3f} s,"
                f" the deadline {exc.deadline_s * 1000:.0f} ms; retry later or allow longer"
            )
            code = "deadline_unmeetable"
            return _retry_later(429, message, "rate_limit_error", code, retry_after_s)
        case EngineClosedError():
            message = "the server is shutting down"
            return _retry_later(503, message, "server_error", "shutting_down", retry_after_s)
        case EngineSleepingError():
            message = "the server sleeps (its model's weights are off the device); retry later"
            return _retry_later(503, message, "server_error", "sleeping", retry_after_s)
        case EngineDeadError():
            return _hidden_failure(
                exc, request_id, "the engine's worker died", "engine_dead", 503, logged=True
            )
        case RequestAbortedError():
            return ApiError(
                503,
                f"the request was aborted ({exc.reason})",
                type="server_error",
                code="request_aborted",
            )
        case RequestFailedError():
            return _hidden_failure(
                exc, request_id, "generation failed", "generation_failed", logged=True
            )
        case _:
            return _hidden_failure(exc, request_id, "the server failed", "internal_error")
