"""The body of ``POST /v1/images/generations``: parsed, type-checked, turned into a request.

Every field of the OpenAI images API is known: the ones this server can honour are
honoured (``prompt``, ``n``, ``size``, ``response_format``, ``output_format``,
``output_compression``, ``partial_images``, ``stream``, ``model``), the rest are
type-checked and ignored (``quality``, ``style``, ``user``, ``moderation``, ...).
Diffusion fields extend it: ``num_inference_steps``, ``guidance_scale``, ``seed``,
``negative_prompt``, ``preview_every``. Anything else is refused, naming the field.

Engine limits (steps, size, ``n``) are not checked here but by ``Engine.submit``,
whose ``InvalidRequestError`` is mapped to the same 400 (``_errors.api_error_from``).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from .._errors import InvalidRequestError
from .._request import GenerationRequest
from ._config import ServeConfig
from ._errors import ApiError, api_error_from, invalid

__all__ = ["KNOWN_FIELDS", "ImageJob", "parse_generation_body"]

#: Output formats this server encodes (``gif`` and ``svg`` are refused).
OUTPUT_FORMATS = ("png", "jpeg", "webp")

_SIZE = re.compile(r"([1-9][0-9]{0,5})x([1-9][0-9]{0,5})")

#: OpenAI quality values echoed back; anything else is reported as "auto".
_QUALITIES = frozenset({"low", "medium", "high", "xhigh", "max", "auto"})


def _any_str(value: object) -> bool:
    return isinstance(value, str)


def _any_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _any_object(value: object) -> bool:
    return isinstance(value, dict)


#: OpenAI fields accepted and ignored, with the type each must have when not null.
_IGNORED: Mapping[str, tuple[Callable[[object], bool], str]] = MappingProxyType(
    {
        "quality": (_any_str, "a string"),
        "style": (_any_str, "a string"),
        "user": (_any_str, "a string"),
        "safety_identifier": (_any_str, "a string"),
        "moderation": (_any_str, "a string"),
        "complexity": (_any_str, "a string"),
        "frame_count": (_any_int, "an integer"),
        "frame_duration_ms": (_any_int, "an integer"),
        "svg": (_any_object, "an object"),
    }
)

#: Every field the body may have.
KNOWN_FIELDS = frozenset(
    {
        "prompt",
        "model",
        "n",
        "size",
        "response_format",
        "output_format",
        "output_compression",
        "background",
        "partial_images",
        "stream",
        "num_inference_steps",
        "guidance_scale",
        "seed",
        "negative_prompt",
        "preview_every",
        *_IGNORED,
    }
)


@dataclass(frozen=True, slots=True, kw_only=True)
class ImageJob:
    """A parsed generation body: the engine request and how to answer it.

    Args:
        request: what the engine generates.
        stream: answer with server-sent events.
        output_format: ``png``, ``jpeg`` or ``webp``.
        output_compression: the JPEG/WebP quality (0-100), ``None`` for the default.
        size: ``"WxH"`` as generated.
        quality: the ``quality`` to echo back.
    """

    request: GenerationRequest
    stream: bool
    output_format: str
    output_compression: int | None
    size: str
    quality: str


def _load(body: bytes) -> dict[str, object]:
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise invalid(f"the body is not valid JSON: {exc}", None, "invalid_json") from None
    if not isinstance(data, dict):
        raise invalid(
            f"the body must be a JSON object, got {type(data).__name__}", None, "invalid_json"
        )
    unknown = sorted(set(data) - KNOWN_FIELDS)
    if unknown:
        raise invalid(
            f"Unrecognized request argument supplied: {unknown[0]}", unknown[0], "unknown_parameter"
        )
    return data


def _wrong_type(name: str, expected: str, value: object) -> ApiError:
    return invalid(
        f"{name}: must be {expected}, got {json.dumps(value)[:40]}", name, "invalid_type"
    )


def _opt_str(data: Mapping[str, object], name: str) -> str | None:
    value = data.get(name)
    if value is not None and not isinstance(value, str):
        raise _wrong_type(name, "a string", value)
    return value


def _opt_int(
    data: Mapping[str, object], name: str, *, low: int, high: int | None = None
) -> int | None:
    value = data.get(name)
    if value is None:
        return None
    if not _any_int(value):
        raise _wrong_type(name, "an integer", value)
    assert isinstance(value, int)
    if value < low or (high is not None and value > high):
        bound = f"between {low} and {high}" if high is not None else f">= {low}"
        raise invalid(f"{name}: must be {bound}, got {value}", name)
    return value


def _opt_number(data: Mapping[str, object], name: str) -> float | None:
    value = data.get(name)
    if value is None:
        return None
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise _wrong_type(name, "a number", value)
    if not math.isfinite(value):
        raise invalid(f"{name}: must be finite, got {value}", name)
    return float(value)


def _opt_choice(
    data: Mapping[str, object], name: str, allowed: tuple[str, ...], refused: tuple[str, ...] = ()
) -> str | None:
    value = _opt_str(data, name)
    if value is None or value in allowed:
        return value
    if value in refused:
        raise invalid(
            f"{name}: {value!r} is not supported by this server; use one of {list(allowed)}",
            name,
            "unsupported_value",
        )
    raise invalid(f"{name}: must be one of {list(allowed)}, got {value!r}", name)


def _size(data: Mapping[str, object], config: ServeConfig) -> tuple[int, int]:
    size = _opt_str(data, "size")
    if size is None or size == "auto":
        return config.default_width, config.default_height
    match = _SIZE.fullmatch(size)
    if match is None:
        raise invalid(
            f"size: must be 'WIDTHxHEIGHT' (e.g. '512x512') or 'auto', got {size!r}", "size"
        )
    return int(match[1]), int(match[2])


def _preview_every(data: Mapping[str, object], steps: int, stream: bool) -> int:
    every = _opt_int(data, "preview_every", low=0)
    partial = _opt_int(data, "partial_images", low=0, high=3)
    if not stream:
        return 0  # previews only travel in a stream
    if every is not None:
        return every
    if partial:
        # Spread ``partial`` previews over the steps: at most ``partial`` of them.
        return steps // (partial + 1) + 1
    return 0


def parse_generation_body(body: bytes, config: ServeConfig) -> ImageJob:
    """Parse and check a generation body; build the engine request.

    Raises:
        ApiError: 400 naming the field at fault.
    """
    data = _load(body)
    for name, (check, expected) in _IGNORED.items():
        value = data.get(name)
        if value is not None and not check(value):
            raise _wrong_type(name, expected, value)
    prompt = data.get("prompt")
    if prompt is None:
        raise invalid("prompt: a prompt is required", "prompt", "missing_required_parameter")
    if not isinstance(prompt, str):
        raise _wrong_type("prompt", "a string", prompt)
    model = _opt_str(data, "model")
    if model is not None and model != config.model_name:
        raise invalid(
            f"model: this server serves {config.model_name!r}, not {model!r}",
            "model",
            "model_not_found",
        )
    stream = data.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise _wrong_type("stream", "a boolean", stream)
    _opt_choice(data, "response_format", ("b64_json",), refused=("url",))
    output_format = _opt_choice(data, "output_format", OUTPUT_FORMATS, refused=("gif", "svg"))
    compression = _opt_int(data, "output_compression", low=0, high=100)
    _opt_choice(data, "background", ("auto", "opaque"), refused=("transparent",))
    width, height = _size(data, config)
    steps = _opt_int(data, "num_inference_steps", low=1)
    steps = config.default_steps if steps is None else steps
    n = _opt_int(data, "n", low=1)
    guidance = _opt_number(data, "guidance_scale")
    seed = _opt_int(data, "seed", low=0, high=2**64 - 1)
    negative = _opt_str(data, "negative_prompt")
    quality = data.get("quality")
    try:
        request = GenerationRequest(
            prompt=prompt,
            negative_prompt=negative,
            num_steps=steps,
            height=height,
            width=width,
            guidance_scale=config.default_guidance_scale if guidance is None else guidance,
            seed=seed,
            num_images=1 if n is None else n,
            preview_every=_preview_every(data, steps, bool(stream)),
        )
    except InvalidRequestError as exc:
        raise api_error_from(exc) from None
    return ImageJob(
        request=request,
        stream=bool(stream),
        output_format=output_format or "png",
        output_compression=compression,
        size=f"{width}x{height}",
        quality=quality if isinstance(quality, str) and quality in _QUALITIES else "auto",
    )
