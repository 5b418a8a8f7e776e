"""Field checks shared by the validated dataclasses: each failure names the field.

``EngineConfig`` raises ``ValueError`` for a bad setting; ``GenerationRequest``
raises ``InvalidRequestError`` (also a ``ValueError``) for a bad request.

Every check returns the value as an exact built-in (``int``, ``float``, ``str``):
a subclass's own methods (``__lt__``, ``__float__``, ``__len__``, ``__hash__``) are
never called, so they cannot lie to a later check or to batch formation, and no
check raises anything but the field's error, whatever the value (an integer too
large for a float raises the field's error, not ``OverflowError``).
"""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Callable
from typing import NoReturn

from ._errors import InvalidRequestError

__all__ = ["Fail", "check_float", "check_int", "check_text", "fail_config", "fail_request"]

Fail = Callable[[str, str], NoReturn]

# Code points that are not text: lone surrogates (category Cs), which no UTF-8
# encoder accepts (a tokenizer raises on them, deep in the model), and control
# characters (category Cc) other than tab, newline and carriage return, which
# carry nothing a text encoder can use and end a string early in C code (NUL).
_NOT_TEXT = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\ud800-\udfff]")


def fail_config(name: str, message: str) -> NoReturn:
    raise ValueError(f"{name}: {message}")


def fail_request(name: str, message: str) -> NoReturn:
    raise InvalidRequestError(message, field=name)


def _shown(number: int | float) -> str:
    # str() of an int of more than 4,300 digits raises ValueError: describe it instead.
    if isinstance(number, int) and number.bit_length() > 64:
        return f"an integer of {number.bit_length()} bits"
    return str(number)


def check_int(
    fail: Fail, name: str, value: object, *, minimum: int, maximum: int | None = None
) -> int:
    # bool is an int subclass; True as a step count is a bug, not a 1.
    if not isinstance(value, int) or isinstance(value, bool):
        fail(name, f"must be an int, got {type(value).__name__}")
    number = operator.index(value)  # an exact int; no method of a subclass runs
    if number < minimum:
        fail(name, f"must be >= {minimum}, got {_shown(number)}")
    if maximum is not None and number > maximum:
        fail(name, f"must be <= {maximum}, got {_shown(number)}")
    return number


def check_float(
    fail: Fail, name: str, value: object, *, minimum: float, maximum: float | None = None
) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool):
        fail(name, f"must be a number, got {type(value).__name__}")
    if isinstance(value, int):
        exact = operator.index(value)
        try:
            number = float(exact)
        except OverflowError:
            fail(name, f"must be finite, got {_shown(exact)} (too large for a float)")
    else:
        number = float.__float__(value)  # an exact float; a subclass's __float__ never runs
    if not math.isfinite(number):
        fail(name, f"must be finite, got {number}")
    if number < minimum:
        fail(name, f"must be >= {minimum}, got {number}")
    if maximum is not None and number > maximum:
        fail(name, f"must be <= {maximum}, got {number}")
    return number


def check_text(fail: Fail, name: str, value: object, *, what: str = "") -> str:
    """Return ``value`` as an exact ``str`` that is text, or fail naming ``name``.

    Refused: lone surrogates (the string cannot be encoded as UTF-8) and control
    characters other than tab, newline and carriage return. ``what`` names the
    part of the field in the message (a key of ``extra``).
    """
    label = f"{what} " if what else ""
    if not isinstance(value, str):
        fail(name, f"{label}must be a str, got {type(value).__name__}")
    text = str.__str__(value)  # an exact str; a subclass's methods never run
    found = _NOT_TEXT.search(text)
    if found is not None:
        char = found.group()
        if "\ud800" <= char <= "\udfff":
            problem = "a lone surrogate, which cannot be encoded as UTF-8"
        else:
            problem = "a control character"
        fail(name, f"{label}must be text: {char!a} at index {found.start()} is {problem}")
    return text
