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
import sys
from collections.abc import Callable
from typing import Any, NoReturn

from ._errors import InvalidRequestError
from ._fairshare import MAX_TENANT_WEIGHT, MIN_TENANT_WEIGHT

__all__ = [
    "MAX_REQUEST_ID_CHARS",
    "MAX_TENANT_CHARS",
    "Fail",
    "check_float",
    "check_image",
    "check_int",
    "check_request_id",
    "check_tenant",
    "check_tenant_weight",
    "check_text",
    "fail_config",
    "fail_request",
    "image_size",
]

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


#: The PIL modes an image field takes, by its channel count: RGB pictures, grey masks.
_PIL_MODES: dict[int, tuple[str, ...]] = {3: ("RGB",), 1: ("L", "1")}


def image_size(value: object) -> tuple[int, int] | None:
    """``(height, width)`` of a PIL image or a ``[C, H, W]`` tensor, read without converting it.

    ``None`` when ``value`` is neither (``check_image`` then says why). Imports
    nothing: a value of a module that was never imported cannot be of its types.
    """
    image_module = sys.modules.get("PIL.Image")
    if image_module is not None and isinstance(value, image_module.Image):
        width, height = value.size
        return int(height), int(width)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor) and value.ndim == 3:
        return int(value.shape[1]), int(value.shape[2])
    return None


def check_image(fail: Fail, name: str, value: object, *, channels: int) -> Any:
    """Return ``value`` as a private CPU ``float32`` tensor ``[channels, H, W]`` in [0, 1].

    Takes a PIL image (mode ``RGB`` for 3 channels, ``L`` or ``1`` for 1) or a CPU
    floating-point tensor ``[channels, H, W]`` with values in [0, 1] and no NaN. A
    copy, made once: a caller changing its image later changes no admitted request.
    Anything else fails naming ``name``; a PIL image that cannot be decoded too.
    """
    modes = _PIL_MODES[channels]
    image_module = sys.modules.get("PIL.Image")
    torch_module = sys.modules.get("torch")
    if image_module is not None and isinstance(value, image_module.Image):
        import numpy as np
        import torch

        if value.mode not in modes:
            fail(name, f"must be a PIL image of mode {' or '.join(modes)}, got mode {value.mode!r}")
        try:
            # Mode "1" reads as booleans: as grey levels first, as diffusers reads masks.
            grey = value.convert("L") if value.mode == "1" else value
            array = np.asarray(grey, dtype=np.float32) / np.float32(255)
        except Exception as exc:  # a truncated or hostile file behind a lazy image
            fail(name, f"could not be decoded ({type(exc).__name__})")
        tensor = torch.from_numpy(np.array(array, copy=True))
        tensor = tensor[None] if tensor.ndim == 2 else tensor.permute(2, 0, 1).contiguous()
    elif torch_module is not None and isinstance(value, torch_module.Tensor):
        import torch

        if type(value) is not torch.Tensor:
            fail(name, f"must be a plain torch.Tensor, got {type(value).__name__}")
        if value.layout != torch.strided or value.device.type != "cpu":
            fail(name, f"must be a dense CPU tensor, got {value.layout} on {value.device}")
        if not value.is_floating_point():
            fail(name, f"must be a floating-point tensor, got {value.dtype}")
        if value.ndim != 3 or value.shape[0] != channels:
            fail(name, f"must be a tensor [{channels}, H, W], got shape {list(value.shape)}")
        tensor = value.detach().to(torch.float32, copy=True).contiguous()
    else:
        fail(
            name,
            f"must be a PIL image or a float tensor [{channels}, H, W], got {type(value).__name__}",
        )
    if tensor.shape[1] < 1 or tensor.shape[2] < 1:
        fail(name, f"must have at least one pixel, got shape {list(tensor.shape)}")
    low, high = (float(bound) for bound in torch.aminmax(tensor))  # NaN propagates to both
    if math.isnan(low) or math.isnan(high):
        fail(name, "must not have NaN values")
    if low < 0.0 or high > 1.0:
        fail(name, f"values must be in [0, 1], got [{low:g}, {high:g}]")
    return tensor


#: Longest request id ``submit`` accepts (ids go into logs, headers and JSON; picked
#: generously, not measured: a UUID is 36 characters).
MAX_REQUEST_ID_CHARS = 1024


def check_request_id(request_id: object) -> str:
    """``request_id`` if it is a valid id: the text rule of prompts, 1 to 1024 characters."""
    # Ids end up in logs, headers and JSON.
    text = check_text(fail_request, "request_id", request_id)
    if not 0 < len(text) <= MAX_REQUEST_ID_CHARS:
        fail_request(
            "request_id", f"must be a non-empty str of at most {MAX_REQUEST_ID_CHARS} characters"
        )
    return text


#: The longest tenant name accepted: a name, as an id is, never a document (it is
#: a log field and a metrics label's value).
MAX_TENANT_CHARS = 256


def check_tenant(fail: Fail, name: str, value: object, *, what: str = "") -> str:
    """Return ``value`` as a tenant name, or fail naming ``name``.

    A name is text (``check_text``) of 1 to ``MAX_TENANT_CHARS`` characters on one
    line: no whitespace but a space, and none at either end, so that it is one field
    of a log line and a metrics label, and two names never differ by what does not
    show (``"acme"``, ``"acme "``). ``what`` names the part of the field in the
    message (a key of a table of tenants).
    """
    label = f"{what} " if what else ""
    text = check_text(fail, name, value, what=what)
    if not 0 < len(text) <= MAX_TENANT_CHARS:
        fail(name, f"{label}must have 1 to {MAX_TENANT_CHARS} characters, got {len(text)}")
    for index, char in enumerate(text):
        if char.isspace() and char != " ":
            fail(name, f"{label}must have no whitespace but spaces: {char!a} at index {index}")
    if text.strip() != text:
        fail(name, f"{label}must not be blank nor start or end with a space, got {text!a}")
    return text


def check_tenant_weight(fail: Fail, name: str, value: object) -> float:
    """Return ``value`` as a tenant's weight in fair share, or fail naming ``name``.

    A finite number from ``MIN_TENANT_WEIGHT`` to ``MAX_TENANT_WEIGHT`` (0.001 to
    1000): ``_fairshare`` says why these bounds.
    """
    return check_float(fail, name, value, minimum=MIN_TENANT_WEIGHT, maximum=MAX_TENANT_WEIGHT)
