"""Field checks shared by the validated dataclasses: each failure names the field.

``EngineConfig`` raises ``ValueError`` for a bad setting; ``GenerationRequest``
raises ``InvalidRequestError`` (also a ``ValueError``) for a bad request.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NoReturn

from ._errors import InvalidRequestError

__all__ = ["Fail", "check_float", "check_int", "fail_config", "fail_request"]

Fail = Callable[[str, str], NoReturn]


def fail_config(name: str, message: str) -> NoReturn:
    raise ValueError(f"{name}: {message}")


def fail_request(name: str, message: str) -> NoReturn:
    raise InvalidRequestError(message, field=name)


def check_int(fail: Fail, name: str, value: object, *, minimum: int) -> int:
    # bool is an int subclass; True as a step count is a bug, not a 1.
    if not isinstance(value, int) or isinstance(value, bool):
        fail(name, f"must be an int, got {type(value).__name__}")
    if value < minimum:
        fail(name, f"must be >= {minimum}, got {value}")
    return value


def check_float(fail: Fail, name: str, value: object, *, minimum: float) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool):
        fail(name, f"must be a number, got {type(value).__name__}")
    if not math.isfinite(value):
        fail(name, f"must be finite, got {value}")
    if value < minimum:
        fail(name, f"must be >= {minimum}, got {value}")
    return float(value)
