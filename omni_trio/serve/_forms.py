"""``multipart/form-data`` bodies: the parts read within limits, their text typed.

What ``/v1/images/edits`` and ``/v1/videos`` share (each endpoint checks its own
fields):

- ``read_form``: the parts of a whole body (already within its byte limit), each
  a name and its text, or a file's bytes; a body that is not a form is a 400;
- ``form_value``: a part's text as its field's type, as a JSON body would have it
  (``"3"`` for an integer, ``"0.6"`` for a number, ``"true"``/``"false"`` for
  ``stream`` and ``return_trajectory``, a JSON object's text for ``sampler``), so the
  same model checks both and names the same errors;
- ``check_known``: the 400 for a part no field has.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncGenerator, Container
from typing import TYPE_CHECKING

from ._asgi import Scope, headers
from ._errors import invalid
from ._schema import parse_int, shown

if TYPE_CHECKING:
    from ._upload import UploadLimits

__all__ = ["check_known", "form_value", "read_form"]

#: How each non-text form field is read.
_INTEGERS = frozenset(
    {
        "n",
        "output_compression",
        "partial_images",
        "num_inference_steps",
        "seed",
        "preview_every",
        "priority",
        "deadline_ms",
        "frame_count",
        "frame_duration_ms",
        "num_frames",  # /v1/videos
    }
)
_NUMBERS = frozenset({"guidance_scale", "strength"})
_BOOLEANS = frozenset({"stream", "return_trajectory"})
#: Fields whose text is a JSON object (L100: an edit's ``sampler``).
_OBJECTS = frozenset({"sampler"})
_INTEGER = re.compile(r"-?[0-9]+")
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")


async def read_form(
    scope: Scope, body: bytes, limits: UploadLimits
) -> list[tuple[str, str | bytes]]:
    """Parse a ``multipart/form-data`` body: each part's name and text, or a file's bytes.

    Args:
        scope: the request's scope (its ``content-type`` header, with the boundary).
        body: the whole body, already within ``limits.max_bytes``.
        limits: the upload limits (the most parts, the largest part).

    Raises:
        ApiError: 400 ``invalid_content_type`` for another content type,
            ``invalid_form`` for a body that is not a valid form.

    Cancellation:
        Safe: the parse holds nothing that outlives it.
    """
    from starlette.datastructures import Headers, UploadFile
    from starlette.formparsers import MultiPartException, MultiPartParser

    given = headers(scope)
    content_type = given.get("content-type", "")
    if not content_type.lower().startswith("multipart/form-data"):
        raise invalid(
            "the body must be multipart/form-data (an image file and form fields)",
            None,
            "invalid_content_type",
        )

    async def stream() -> AsyncGenerator[bytes, None]:
        yield body

    parser = MultiPartParser(
        Headers(headers=given),
        stream(),
        max_files=limits.max_fields,
        max_fields=limits.max_fields,
        max_part_size=limits.max_bytes,
    )
    try:
        form = await parser.parse()
    except MultiPartException as exc:
        raise invalid(f"the form could not be read: {exc.message}", None, "invalid_form") from None
    except (ValueError, KeyError, UnicodeDecodeError):
        # A part whose headers or text the parser cannot decode.
        raise invalid("the form could not be read", None, "invalid_form") from None
    parts: list[tuple[str, str | bytes]] = []
    try:
        for name, value in form.multi_items():
            if isinstance(value, UploadFile):
                parts.append((name, await value.read()))
            else:
                parts.append((name, value))
    finally:
        await form.close()
    return parts


def check_known(name: str, known: Container[str]) -> None:
    """Raise the 400 ``unknown_parameter`` for a part ``known`` lacks (``param`` cut to 64)."""
    if name not in known:
        param = name if len(name) <= 64 else f"{name[:61]}..."
        raise invalid(
            f"Unrecognized request argument supplied: {shown(name)}", param, "unknown_parameter"
        )


def form_value(name: str, text: str) -> object:
    """A form value as its field's type (integer, number, boolean, JSON object, text), or a
    400 naming it."""
    if name in _INTEGERS:
        if _INTEGER.fullmatch(text) is None:
            raise invalid(f"{name}: must be an integer, got {shown(text)}", name, "invalid_type")
        return parse_int(text)  # as a JSON body's: a huge literal is cheap to refuse
    if name in _NUMBERS:
        if len(text) > 400 or _NUMBER.fullmatch(text) is None:
            raise invalid(f"{name}: must be a number, got {shown(text)}", name, "invalid_type")
        return float(text)  # 1e999 is inf: the model refuses it as not finite
    if name in _BOOLEANS:
        if text not in ("true", "false"):
            raise invalid(f"{name}: must be true or false, got {shown(text)}", name, "invalid_type")
        return text == "true"
    if name in _OBJECTS:
        try:
            value = json.loads(text, parse_int=parse_int)  # as a JSON body's
        except (ValueError, RecursionError):  # RecursionError: nested too deep
            value = None
        if not isinstance(value, dict):
            raise invalid(f"{name}: must be a JSON object, got {shown(text)}", name, "invalid_type")
        return value
    return text
