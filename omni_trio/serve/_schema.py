"""The body of ``POST /v1/images/generations``: decoded, parsed, validated, turned into a request.

Every field of the OpenAI images API is known: the ones this server can honour are
honoured (``prompt``, ``n``, ``size``, ``response_format`` (``url`` where the server
has an output store, L97), ``output_format``,
``output_compression``, ``partial_images``, ``stream``, ``model``), the rest are
type-checked and ignored (``quality``, ``style``, ``user``, ``moderation``, ...).
Diffusion fields extend it: ``num_inference_steps``, ``guidance_scale``, ``seed``,
``negative_prompt``, ``preview_every``, scheduling: ``priority`` (at most the
server's ``max_priority``) and ``deadline_ms`` (milliseconds after submission; the
``X-Request-Deadline-Ms`` header says the same, and the earlier of the two wins),
and ``cache``, the request's step-cache policy (L84): ``"KIND[:THRESHOLD]"`` or an
object of ``StepCache``'s fields (absent: the server's ``--cache`` default), and
``adapters`` (L88), the adapters to apply: ``{"ink": 0.8}``, or the text
``"ink:0.8,film"`` (a scale of 1 where none is given; what a form field carries);
``lora``, OpenAI-style, says the same as a list of ``{"name", "scale"}`` objects (or
as ``adapters`` does); one of the two.
Rollouts (L100): ``sampler``, the request's stochastic sampler as an object of
``SDESampler``'s or ``DDIMSampler``'s fields with its ``kind`` (``{"kind": "sde",
"noise_level": 0.7, "steps": [0, 1]}``, checked by ``parse_sampler``, naming
``sampler``), and ``return_trajectory``, whose answer carries the trajectory.
Anything else is refused, naming the field.

Three stages, each refusing with a 400 that says what is wrong:

1. bytes to JSON (``invalid_json``): the body must be UTF-8 (decoded explicitly:
   ``json.loads`` would guess UTF-16 or UTF-32 from bytes), JSON, an object, and
   nested no deeper than the parser's recursion limit. An integer literal longer
   than ``HUGE_DIGITS`` digits is read as ``±10**HUGE_DIGITS`` (out of range for
   every field, and too large for a float), so no digit string is converted at a
   quadratic cost and the error still names the field;
2. JSON to ``GenerationBody``, a strict pydantic model (``unknown_parameter``,
   ``missing_required_parameter``, ``invalid_type``, ``invalid_value``,
   ``unsupported_value``): types, ranges that do not depend on the engine (every
   integer fits an int64, ``seed`` a uint64), text that is valid Unicode (no lone
   surrogate, which no UTF-8 encoder accepts), the choices this server supports;
3. the body to the engine's ``GenerationRequest`` (``invalid_value``), whose own
   checks are mapped by ``_errors.api_error_from``. Engine limits (steps, size,
   ``n``) are checked by ``Engine.submit``, mapped to the same 400.

No stage renders a value it refuses in full: messages show at most 40 characters
of it, and a container only by its kind, so no hostile value makes an answer
large, slow or recursive.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError
from pydantic_core import ErrorDetails, PydanticCustomError

from .._errors import InvalidRequestError
from .._request import (
    DEFAULT_STRENGTH,
    MAX_DEADLINE_S,
    MAX_PRIORITY,
    GenerationRequest,
    denoise_steps,
)
from .._sampling import parse_sampler
from .._stepcache import parse_step_cache
from ._config import ServeConfig, with_defaults
from ._errors import ApiError, api_error_from, invalid

__all__ = [
    "DEADLINE_HEADER",
    "HUGE_DIGITS",
    "KNOWN_FIELDS",
    "AdapterMap",
    "CachePolicy",
    "GenerationBody",
    "ImageJob",
    "LoraList",
    "body_adapters",
    "check_model",
    "checked_priority",
    "deadline_seconds",
    "job_from_body",
    "load_json",
    "no_output_store",
    "parse_generation_body",
    "parse_int",
    "parse_size",
    "shown",
    "size_given",
    "validate",
    "validate_body",
]

#: The header that carries a deadline in milliseconds, as ``deadline_ms`` does.
DEADLINE_HEADER = "X-Request-Deadline-Ms"

#: The longest ``deadline_ms``: the engine's ``MAX_DEADLINE_S``.
MAX_DEADLINE_MS = int(MAX_DEADLINE_S * 1000)

#: Output formats this server encodes (``gif`` and ``svg`` are refused).
OUTPUT_FORMATS = ("png", "jpeg", "webp")

#: Integer literals with more digits than this stand for ``±10**HUGE_DIGITS``. Above
#: any float (about 1.8e308) and any field's range, and cheap to convert.
HUGE_DIGITS = 309
_STAND_IN: int = 10**HUGE_DIGITS

#: The largest integer any count field takes before the engine's own limits.
INT64_MAX = 2**63 - 1

_SIZE = re.compile(r"([1-9][0-9]{0,5})x([1-9][0-9]{0,5})")

#: OpenAI quality values echoed back; anything else is reported as "auto".
_QUALITIES = frozenset({"low", "medium", "high", "xhigh", "max", "auto"})

#: How many characters of a refused value a message shows.
_SHOWN = 40


def shown(value: object) -> str:
    """A short, ASCII rendering of ``value`` for an error message; never recursive."""
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    if isinstance(value, int):
        if abs(value) >= _STAND_IN:  # a longer literal's stand-in
            return f"an integer of more than {HUGE_DIGITS} digits"
        text = str(value)
        return text if len(text) <= _SHOWN else f"an integer of {len(text.lstrip('-'))} digits"
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, str):
        text = ascii(value[:_SHOWN])
        return text if len(value) <= _SHOWN else f"{text[:-1]}...{text[-1]}"
    if isinstance(value, list):
        return f"an array of {len(value)}"
    if isinstance(value, dict):
        return f"an object of {len(value)} fields"
    return type(value).__name__


def _field_name(key: str) -> str:
    """A body key as a ``param``: ASCII-safe, at most 64 characters."""
    safe = key.encode("utf-8", "backslashreplace").decode("utf-8")
    return safe if len(safe) <= 64 else f"{safe[:61]}..."


# -- stage 2: the model -------------------------------------------------------------


def _unicode(value: str) -> str:
    # JSON's "\ud800" escapes decode to lone surrogates, which no encoder (the
    # tokenizer's, the log's, the response's) accepts.
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise PydanticCustomError(
            "invalid_value",
            "must be valid Unicode text, got a lone surrogate at index {index}",
            {"index": exc.start},
        ) from None
    return value


def _choice(allowed: tuple[str, ...], refused: tuple[str, ...] = ()) -> Callable[[str], str]:
    def check(value: str) -> str:
        if value in allowed:
            return value
        if value in refused:
            raise PydanticCustomError(
                "unsupported_value",
                "{value} is not supported by this server; use one of {allowed}",
                {"value": shown(value), "allowed": str(list(allowed))},
            )
        raise PydanticCustomError(
            "invalid_value",
            "must be one of {allowed}, got {value}",
            {"value": shown(value), "allowed": str(list(allowed))},
        )

    return check


Text = Annotated[str, AfterValidator(_unicode)]
Count = Annotated[int, Field(ge=1, le=INT64_MAX)]
Every = Annotated[int, Field(ge=0, le=INT64_MAX)]
Number = Annotated[float, Field(allow_inf_nan=False)]
#: A step-cache policy (L84): ``"first-block:0.1"``, or ``{"kind": "first-block", ...}``;
#: its fields are checked by ``StepCache`` (stage 3), naming ``cache``.
CachePolicy = Text | dict[str, Any]
#: Adapters (L88): ``{"ink": 0.8}`` or ``"ink:0.8,film"``; ``lora`` also takes a list of
#: ``{"name", "scale"}``. Names and scales are checked by ``GenerationRequest`` (stage 3).
AdapterMap = Text | dict[str, Any]
LoraList = AdapterMap | list[Any]

#: A stochastic sampler (L100): ``{"kind": "sde" | "ddim", ...}``, its dataclass's fields;
#: checked by ``parse_sampler`` (stage 3), naming ``sampler``.
SamplerFields = dict[str, Any]

#: The most adapters a body may name, whatever the runner's bound: keeps a hostile
#: body's parse small (the runner's ``max_adapters`` is checked at admission).
MAX_BODY_ADAPTERS = 64


def body_adapters(
    adapters: AdapterMap | None, lora: LoraList | None
) -> tuple[tuple[Any, Any], ...]:
    """The ``(name, scale)`` pairs of a body's ``adapters`` or ``lora`` (one of them).

    Raises:
        ApiError: 400 naming the field: both given, or a shape neither takes.
    """
    if adapters is not None and lora is not None:
        raise invalid("lora: give adapters or lora, not both", "lora")
    field, value = ("lora", lora) if lora is not None else ("adapters", adapters)
    if value is None:
        return ()
    pairs: list[tuple[Any, Any]] = []
    if isinstance(value, str):
        for item in value.split(",") if value.strip() else ():
            name, _, scale = item.strip().partition(":")
            pairs.append((name, _scale_text(field, scale) if scale else 1.0))
    elif isinstance(value, dict):
        pairs = list(value.items())
    else:
        for item in value:
            if not isinstance(item, dict) or set(item) - {"name", "scale"} or "name" not in item:
                raise invalid(f'{field}: each item is {{"name": ..., "scale": ...}}', field)
            pairs.append((item["name"], item.get("scale", 1.0)))
    if len(pairs) > MAX_BODY_ADAPTERS:
        raise invalid(f"{field}: at most {MAX_BODY_ADAPTERS} adapters", field)
    return tuple(pairs)


def _scale_text(field: str, text: str) -> float:
    try:
        if len(text) > 40:
            raise ValueError(text)
        return float(text)
    except ValueError:
        raise invalid(f"{field}: a scale must be a number, got {shown(text)}", field) from None


class GenerationBody(BaseModel):
    """The JSON body, type-checked: strict (no coercion: ``"2"`` is not 2, ``true`` not 1).

    ``None`` (or absence) means "the default" for every field but ``prompt``.
    """

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    prompt: Text
    model: Text | None = None
    n: Count | None = None
    size: Text | None = None
    response_format: Annotated[Text, AfterValidator(_choice(("b64_json", "url")))] | None = None
    output_format: (
        Annotated[Text, AfterValidator(_choice(OUTPUT_FORMATS, ("gif", "svg")))] | None
    ) = None
    output_compression: Annotated[int, Field(ge=0, le=100)] | None = None
    background: (
        Annotated[Text, AfterValidator(_choice(("auto", "opaque"), ("transparent",)))] | None
    ) = None
    partial_images: Annotated[int, Field(ge=0, le=3)] | None = None
    stream: bool | None = None
    num_inference_steps: Count | None = None
    guidance_scale: Number | None = None
    seed: Annotated[int, Field(ge=0, le=2**64 - 1)] | None = None
    negative_prompt: Text | None = None
    preview_every: Every | None = None
    priority: Annotated[int, Field(ge=-MAX_PRIORITY, le=MAX_PRIORITY)] | None = None
    deadline_ms: Annotated[int, Field(ge=1, le=MAX_DEADLINE_MS)] | None = None
    cache: CachePolicy | None = None
    adapters: AdapterMap | None = None
    lora: LoraList | None = None
    sampler: SamplerFields | None = None
    return_trajectory: bool | None = None
    # OpenAI fields accepted and ignored.
    quality: Text | None = None
    style: Text | None = None
    user: Text | None = None
    safety_identifier: Text | None = None
    moderation: Text | None = None
    complexity: Text | None = None
    frame_count: int | None = None
    frame_duration_ms: int | None = None
    svg: dict[str, Any] | None = None


_M = TypeVar("_M", bound=BaseModel)

#: Every field the body may have.
KNOWN_FIELDS = frozenset(GenerationBody.model_fields)

#: What a pydantic type error says a field must be.
_EXPECTED = {
    "string_type": "a string",
    "int_type": "an integer",
    "float_type": "a number",
    "bool_type": "a boolean",
    "dict_type": "an object",
}


def _api_error(error: ErrorDetails) -> ApiError:
    """The 400 for one pydantic error, in this API's words."""
    kind, value = error["type"], error["input"]
    name = str(error["loc"][0]) if error["loc"] else None
    ctx = error.get("ctx", {})
    if kind == "extra_forbidden" and name is not None:
        param = _field_name(name)
        return invalid(
            f"Unrecognized request argument supplied: {param}", param, "unknown_parameter"
        )
    if kind == "missing":
        return invalid(f"{name}: a {name} is required", name, "missing_required_parameter")
    if kind == "float_type" and isinstance(value, int) and not isinstance(value, bool):
        return invalid(f"{name}: must be a finite number, got {shown(value)}", name)
    if kind in _EXPECTED:
        return invalid(
            f"{name}: must be {_EXPECTED[kind]}, got {shown(value)}", name, "invalid_type"
        )
    if kind == "greater_than_equal":
        return invalid(f"{name}: must be >= {ctx['ge']}, got {shown(value)}", name)
    if kind == "less_than_equal":
        return invalid(f"{name}: must be <= {ctx['le']}, got {shown(value)}", name)
    if kind == "finite_number":
        return invalid(f"{name}: must be finite, got {shown(value)}", name)
    if kind == "unsupported_value":
        return invalid(f"{name}: {error['msg']}", name, "unsupported_value")
    return invalid(f"{name}: {error['msg']}", name)


def _first(errors: list[ErrorDetails], model: type[BaseModel]) -> ErrorDetails:
    # Unknown fields first (alphabetically), then the model's field order.
    order = {name: index for index, name in enumerate(model.model_fields)}

    def rank(error: ErrorDetails) -> tuple[int, int, str]:
        name = str(error["loc"][0]) if error["loc"] else ""
        unknown = error["type"] == "extra_forbidden"
        return (0 if unknown else 1, order.get(name, len(order)), name)

    return min(errors, key=rank)


# -- stage 1: bytes to JSON ---------------------------------------------------------


def parse_int(text: str) -> int:
    """An integer literal's value: ``±10**HUGE_DIGITS`` for one of more digits than that."""
    digits = len(text) - text.startswith("-")
    if digits > HUGE_DIGITS:
        return -_STAND_IN if text.startswith("-") else _STAND_IN
    return int(text)


def load_json(body: bytes, known: frozenset[str] = KNOWN_FIELDS) -> dict[str, object]:
    """Stage 1: the body as a JSON object whose keys are all in ``known``.

    Raises:
        ApiError: 400 ``invalid_json``, or ``unknown_parameter`` naming the key.
    """
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise invalid(
            f"the body is not UTF-8: {exc.reason} at byte {exc.start}", None, "invalid_json"
        ) from None
    try:
        data = json.loads(text, parse_int=parse_int)
    except RecursionError:
        raise invalid(
            "the body is not valid JSON: nested too deeply", None, "invalid_json"
        ) from None
    except ValueError as exc:  # JSONDecodeError, a UTF-8 byte-order mark
        raise invalid(f"the body is not valid JSON: {exc}", None, "invalid_json") from None
    if not isinstance(data, dict):
        raise invalid(f"the body must be a JSON object, got {shown(data)}", None, "invalid_json")
    # Here rather than by the model, which cannot even name a key with a lone surrogate.
    unknown = sorted(set(data) - known)
    if unknown:
        param = _field_name(unknown[0])
        raise invalid(
            f"Unrecognized request argument supplied: {param}", param, "unknown_parameter"
        )
    return data


# -- stage 3: the engine's request ----------------------------------------------------


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
        events: the prefix of the stream's event types: ``image_generation``, or
            ``image_edit`` for ``/v1/images/edits``, as OpenAI names them.
        response_format: ``b64_json``, or ``url`` (L97): each image written to the
            server's output store, answered as its signed URL.
    """

    request: GenerationRequest
    stream: bool
    output_format: str
    output_compression: int | None
    size: str
    quality: str
    events: str = "image_generation"
    response_format: str = "b64_json"


def no_output_store(param: str) -> ApiError:
    """The 400 of a ``url`` asked of a server without an output store (L97), naming ``param``."""
    return invalid(
        f"{param}: 'url' needs an output store, and this server has none: set"
        " ServeConfig.outputs (a folder or an s3:// bucket), or ask for b64_json",
        param,
        "unsupported_value",
    )


def check_model(model: str | None, config: ServeConfig) -> None:
    """A 400 ``model_not_found`` unless ``model`` is absent or the served model's id."""
    if model is not None and model != config.model_name:
        raise invalid(
            f"model: this server serves {shown(config.model_name)}, not {shown(model)}",
            "model",
            "model_not_found",
        )


def size_given(size: str | None) -> tuple[int | None, int | None]:
    """``(width, height)`` of a body's ``size``; ``None`` (a default) when absent or ``"auto"``."""
    if size is None or size == "auto":
        return None, None
    return parse_size(size)


def parse_size(size: str) -> tuple[int, int]:
    """``"WxH"`` as ``(width, height)``; a 400 naming ``size`` if it is not one."""
    match = _SIZE.fullmatch(size)
    if match is None:
        raise invalid(
            f"size: must be 'WIDTHxHEIGHT' (e.g. '512x512') or 'auto', got {shown(size)}", "size"
        )
    return int(match[1]), int(match[2])


def _preview_every(body: GenerationBody, steps: int) -> int:
    if not body.stream:
        return 0  # previews only travel in a stream
    if body.preview_every is not None:
        return body.preview_every
    if body.partial_images:
        # Spread ``partial_images`` previews over the steps: at most that many.
        return steps // (body.partial_images + 1) + 1
    return 0


def validate_body(data: Mapping[str, object]) -> GenerationBody:
    """Type-check a parsed JSON object as a generation body.

    Raises:
        ApiError: 400 naming the field at fault.
    """
    return validate(GenerationBody, data)


def validate(model: type[_M], data: Mapping[str, object]) -> _M:
    """Stage 2: type-check a parsed JSON object (or typed form) as ``model``.

    Raises:
        ApiError: 400 naming the field at fault (unknown fields first, then the
            model's field order).
    """
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise _api_error(_first(exc.errors(include_url=False), model)) from None


def _header_deadline_ms(text: str | None) -> int | None:
    """The ``X-Request-Deadline-Ms`` header's milliseconds; a 400 naming it if bad."""
    if text is None:
        return None
    stripped = text.strip()
    if not (stripped.isascii() and stripped.isdigit()) or len(stripped) > 12:
        raise invalid(
            f"{DEADLINE_HEADER}: must be an integer of milliseconds, got {shown(text)}",
            DEADLINE_HEADER,
            "invalid_header",
        )
    value = int(stripped)
    if not 1 <= value <= MAX_DEADLINE_MS:
        raise invalid(
            f"{DEADLINE_HEADER}: must be from 1 to {MAX_DEADLINE_MS}, got {value}",
            DEADLINE_HEADER,
            "invalid_header",
        )
    return value


def deadline_seconds(deadline_ms: int | None, header: str | None) -> float | None:
    """The request's deadline in seconds: the earlier of the body's and the header's.

    Raises:
        ApiError: 400 naming the header if it is not a number of milliseconds.
    """
    given = [ms for ms in (deadline_ms, _header_deadline_ms(header)) if ms is not None]
    return min(given) / 1000 if given else None


def checked_priority(given: int | None, config: ServeConfig) -> int:
    """The body's ``priority`` (0 if absent); a 400 above the server's ``max_priority``."""
    priority = 0 if given is None else given
    if priority > config.max_priority:
        raise invalid(
            f"priority: must be <= {config.max_priority} on this server, got {priority}",
            "priority",
        )
    return priority


def parse_generation_body(
    body: bytes, config: ServeConfig, *, deadline_header: str | None = None
) -> ImageJob:
    """Decode, parse and check a generation body; build the engine request.

    Args:
        body: the raw body.
        config: the server's configuration.
        deadline_header: the ``X-Request-Deadline-Ms`` header's text, if sent.

    Raises:
        ApiError: 400 naming the field at fault (``param``), or ``invalid_json``.
    """
    return job_from_body(validate_body(load_json(body)), config, deadline_header=deadline_header)


def job_from_body(
    parsed: GenerationBody,
    config: ServeConfig,
    *,
    deadline_header: str | None = None,
    edit: Mapping[str, Any] | None = None,
    size: tuple[int, int] | None = None,
    events: str = "image_generation",
) -> ImageJob:
    """Stage 3: a checked body to the engine's request and how to answer it.

    Args:
        parsed: the checked body.
        config: the server's configuration.
        deadline_header: the ``X-Request-Deadline-Ms`` header's text, if sent.
        edit: the ``GenerationRequest`` fields of an edit (``image``, ``mask``,
            ``strength``), for ``/v1/images/edits``.
        size: ``(width, height)`` to use instead of the body's ``size`` (an edit's,
            resolved from its image).
        events: ``ImageJob.events``.

    Raises:
        ApiError: 400 naming the field at fault (``param``).
    """
    check_model(parsed.model, config)
    if parsed.response_format == "url" and config.outputs is None:
        raise no_output_store("response_format")
    width, height = size if size is not None else size_given(parsed.size)
    fields = with_defaults(
        {
            "width": width,
            "height": height,
            "num_steps": parsed.num_inference_steps,
            "guidance_scale": parsed.guidance_scale,
        },
        config,
    )
    steps: int = fields["num_steps"]
    runs = steps
    if edit is not None:
        kind = "inpaint" if edit.get("mask") is not None else "image-to-image"
        runs = denoise_steps(steps, edit.get("strength") or DEFAULT_STRENGTH[kind])
    priority = checked_priority(parsed.priority, config)
    deadline_s = deadline_seconds(parsed.deadline_ms, deadline_header)
    try:
        request = GenerationRequest(
            prompt=parsed.prompt,
            negative_prompt=parsed.negative_prompt,
            **fields,
            seed=parsed.seed,
            num_images=1 if parsed.n is None else parsed.n,
            preview_every=_preview_every(parsed, max(runs, 1)),
            priority=priority,
            deadline_s=deadline_s,
            cache=parse_step_cache(parsed.cache),
            adapters=body_adapters(parsed.adapters, parsed.lora),
            sampler=None if parsed.sampler is None else parse_sampler(parsed.sampler),
            return_trajectory=bool(parsed.return_trajectory),
            **(edit or {}),
        )
    except InvalidRequestError as exc:
        raise api_error_from(exc) from None
    quality = parsed.quality
    return ImageJob(
        request=request,
        stream=bool(parsed.stream),
        output_format=parsed.output_format or "png",
        output_compression=parsed.output_compression,
        size=f"{request.width}x{request.height}",
        quality=quality if quality in _QUALITIES else "auto",
        events=events,
        response_format=parsed.response_format or "b64_json",
    )
