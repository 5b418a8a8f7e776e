"""The argparse value types of every command, written once.

Each takes the option's text and returns its value, or raises
``argparse.ArgumentTypeError`` with what it expected; argparse then prints
``argument --x: <that>`` (and ``_env`` names the variable instead). They refuse
nan and infinities where a finite number is meant.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from .._adapters import ADAPTER_NAME
from .._errors import InvalidRequestError
from .._stepcache import StepCache, parse_step_cache

__all__ = [
    "adapter",
    "api_keys",
    "bound",
    "count",
    "finite",
    "fraction",
    "gpus",
    "header",
    "integer",
    "positive",
    "seconds",
    "size",
    "span",
    "step_cache",
    "threshold",
]


def _number(text: str) -> float:
    """``float(text)``, or nan where it is not a number (each type says what it expects)."""
    try:
        return float(text)
    except ValueError:
        return math.nan


def count(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """An int in ``[minimum, maximum]`` (no upper bound by default)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum or (maximum is not None and value > maximum):
            bound = f">= {minimum}" if maximum is None else f"from {minimum} to {maximum}"
            raise argparse.ArgumentTypeError(f"expected an integer {bound}, got {text!r}")
        return value

    parse.__name__ = "int"
    return parse


def integer(text: str) -> int:
    """Any int."""
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def threshold(text: str) -> int | None:
    """An int >= 1, or ``never`` (``None``)."""
    if text.strip().lower() == "never":
        return None
    return count(1)(text)


def jobs_dir(text: str) -> str | None:
    """A folder for the video jobs' store, or ``none`` (``None``: in memory)."""
    if text.strip().lower() == "none":
        return None
    if not text.strip():
        raise argparse.ArgumentTypeError("expected a folder, or 'none'")
    return text


def interval(text: str) -> float | None:
    """A finite number of seconds >= 0, or ``never`` (``None``)."""
    if text.strip().lower() == "never":
        return None
    value = finite(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0 or 'never', got {text!r}")
    return value


def bound(text: str) -> float | None:
    """A finite number of seconds > 0, or ``none`` (``None``: no bound)."""
    if text.strip().lower() == "none":
        return None
    value = _number(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(
            f"expected a number of seconds > 0 or 'none', got {text!r}"
        )
    return value


def finite(text: str) -> float:
    """A finite number."""
    value = _number(text)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def positive(text: str) -> float:
    """A finite number > 0."""
    value = finite(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def fraction(text: str) -> float:
    """A number from 0 to 1."""
    value = _number(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number from 0 to 1, got {text!r}")
    return value


def api_keys(text: str) -> list[str]:
    """API keys, comma-separated (L55); never quoted back in an error: they are secrets."""
    from ..serve._keys import check_key  # here: only serve takes keys, and needs the extra

    keys = [key.strip() for key in text.split(",")]
    for key in keys:
        try:
            check_key(key)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(
                f"expected keys, comma-separated: {exc} (the value is not shown: it is a secret)"
            ) from None
    return keys


def seconds(text: str) -> float:
    """A finite number of seconds ``>= 0``."""
    value = _number(text)
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0, got {text!r}")
    return value


def span(text: str) -> tuple[float, float]:
    """``MAX`` or ``MIN:MAX`` seconds, as ``(MIN, MAX)`` (``MIN`` 0 by default)."""
    low, sep, high = text.partition(":")
    try:
        bounds = (seconds(low), seconds(high)) if sep else (0.0, seconds(text))
    except argparse.ArgumentTypeError:
        bounds = (1.0, 0.0)
    if bounds[0] > bounds[1]:
        raise argparse.ArgumentTypeError(f"expected MAX or MIN:MAX seconds, got {text!r}")
    return bounds


def gpus(text: str) -> float:
    """A number of GPUs ``>= 0`` (a fraction shares one)."""
    value = _number(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected a number of GPUs >= 0, got {text!r}")
    return value


def size(text: str) -> tuple[int, int]:
    """``WIDTHxHEIGHT``, each >= 1, as ``(width, height)``."""
    width, sep, height = text.partition("x")
    try:
        sides = int(width), int(height)
    except ValueError:
        sides = (0, 0)
    if not sep or min(sides) < 1:
        raise argparse.ArgumentTypeError(f"expected WIDTHxHEIGHT, e.g. 64x64, got {text!r}")
    return sides


def sizes(text: str) -> tuple[tuple[int, int], ...]:
    """``WIDTHxHEIGHT``, or several comma-separated, as ``(width, height)`` pairs."""
    return tuple(size(item.strip()) for item in text.split(","))


#: The binary multiples a number of bytes may end with.
_BYTE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def byte_count(text: str) -> int:
    """A number of bytes >= 1, plain or with a binary unit (``512M``, ``2G``, ``64KiB``)."""
    digits = text.strip().lower().removesuffix("ib").removesuffix("b")
    unit = digits[-1:] if digits[-1:] in _BYTE_UNITS else ""
    try:
        value = int(digits[: len(digits) - len(unit)]) * _BYTE_UNITS[unit]
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a number of bytes (512M, 2G), got {text!r}")
    return value


def result_cache(text: str) -> tuple[int, str | None]:
    """``BYTES[:DIR]``: the result cache's bound and its folder (``None``: in memory)."""
    bound_text, sep, folder = text.partition(":")
    if sep and not folder:
        raise argparse.ArgumentTypeError(f"expected BYTES[:DIR], got {text!r}")
    return byte_count(bound_text), folder or None


def header(text: str) -> tuple[str, str]:
    """An HTTP header, ``'Name: value'``, as ``(name, value)`` stripped."""
    name, sep, value = text.partition(":")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"expected 'Name: value', got {text!r}")
    return name.strip(), value.strip()


def step_cache(text: str) -> StepCache:
    """A step-cache policy: ``KIND[:THRESHOLD]`` (``first-block:0.1``, ``taylorseer:5``)."""
    try:
        policy = parse_step_cache(text)
    except InvalidRequestError as exc:
        raise argparse.ArgumentTypeError(f"expected KIND[:THRESHOLD], {exc}") from None
    assert policy is not None  # text is never None
    return policy


def adapter(text: str) -> list[tuple[str, str]]:
    """Adapters to load at start: ``NAME=PATH``, or several, comma-separated, as pairs."""
    pairs = []
    for item in text.split(","):
        name, sep, path = item.strip().partition("=")
        if not sep or not path or ADAPTER_NAME.fullmatch(name) is None:
            raise argparse.ArgumentTypeError(
                f"expected NAME=PATH (a name of letters, digits, '_', '.', '-'), got {item!r}"
            )
        pairs.append((name, path))
    return pairs
