"""The body of ``POST /v1/videos``: OpenAI's video fields and the diffusion ones, to a request.

The OpenAI SDK's ``client.videos.create`` sends a ``multipart/form-data`` form
(every value as text, ``seconds`` as ``"4"``); ``curl`` users may send JSON. Both
are read into the same strict model (form text typed by ``_forms``, as for
``/v1/images/edits``) and checked in the same three stages as a generation body (L73):

- OpenAI's fields: ``prompt`` (required), ``model`` (the served one, or absent),
  ``seconds`` (a positive number, as text or a number), ``size`` (``"WxH"``),
  ``input_reference`` (an image file, for a model that makes videos from an image,
  L69: its header is read and checked with the rest against the engine's limits,
  and it is decoded only once admitted, by ``with_reference`` in a worker thread;
  a text-to-video model refuses it);
- the extensions: ``num_frames`` (instead of ``seconds``), ``num_inference_steps``,
  ``guidance_scale``, ``seed``, ``negative_prompt``, ``priority``,
  ``deadline_ms`` (and the ``X-Request-Deadline-Ms`` header) and ``cache`` (the
  step-cache policy, L84) and ``adapters`` (or ``lora``, L88), as for images.

``seconds`` becomes a frame count: ``seconds x fps`` rounded, then moved to the
nearest count the runner's frame rule (``RunnerCapabilities.frames``: ``F % a ==
b``) takes, ties upwards unless that is over ``MAX_NUM_FRAMES`` (Wan, 4k + 1
frames, 4 s at 16 fps: 64, so 65; 270 s, the longest: 4320, so 4317). Its bound
is checked on the value sent (an integer is never made a float to compare it), and
its refusals name ``seconds``. A ``num_frames`` is taken as it is, and refused
(400 naming it) off the rule.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from .._errors import InvalidRequestError
from .._request import MAX_DEADLINE_S, MAX_NUM_FRAMES, MAX_PRIORITY, GenerationRequest
from .._stepcache import parse_step_cache
from ._config import Admission, ServeConfig, with_defaults
from ._errors import api_error_from, invalid
from ._forms import check_known, form_value
from ._schema import (
    AdapterMap,
    CachePolicy,
    Count,
    LoraList,
    Number,
    Text,
    body_adapters,
    check_model,
    checked_priority,
    deadline_seconds,
    load_json,
    shown,
    size_given,
    validate,
)
from ._upload import UploadLimits, decode, read_header

__all__ = [
    "VIDEO_FIELDS",
    "VideoBody",
    "VideoSpec",
    "default_frames",
    "frames_for",
    "video_body",
    "video_spec",
    "with_reference",
]

_NUMBER = re.compile(r"(?:0|[1-9][0-9]*)(?:\.[0-9]+)?")


class VideoBody(BaseModel):
    """A video job's body, type-checked: strict, as ``GenerationBody`` is.

    ``seconds`` is checked in stage 3 (OpenAI sends text, JSON clients may send a
    number); ``input_reference`` in stage 3 (a file's bytes, from a form).
    """

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    prompt: Text
    model: Text | None = None
    seconds: Any = None
    size: Text | None = None
    input_reference: Any = None
    num_frames: Count | None = None
    num_inference_steps: Count | None = None
    guidance_scale: Number | None = None
    seed: Annotated[int, Field(ge=0, le=2**64 - 1)] | None = None
    negative_prompt: Text | None = None
    priority: Annotated[int, Field(ge=-MAX_PRIORITY, le=MAX_PRIORITY)] | None = None
    deadline_ms: Annotated[int, Field(ge=1, le=int(MAX_DEADLINE_S * 1000))] | None = None
    cache: CachePolicy | None = None
    adapters: AdapterMap | None = None
    lora: LoraList | None = None


#: Every field the body may have.
VIDEO_FIELDS = frozenset(VideoBody.model_fields)


@dataclass(frozen=True, slots=True, kw_only=True)
class VideoSpec:
    """A parsed video body: the engine request and what the job reports.

    Args:
        request: what the engine generates (``num_frames`` set, one video).
        size: ``"WxH"`` as generated.
        seconds: the clip's length as OpenAI reports it (text): the ``seconds``
            asked for, else ``num_frames / fps``.
        fps: the frames per second of the MP4.
        reference: the ``input_reference`` image, its header read and checked, not
            decoded yet (``with_reference`` decodes it into ``request.image``).
    """

    request: GenerationRequest
    size: str
    seconds: str
    fps: float
    reference: Any = field(default=None, compare=False, repr=False)


def frames_for(
    seconds: float, fps: float, rule: tuple[int, int], *, most: int = MAX_NUM_FRAMES
) -> int:
    """The frame count nearest ``seconds x fps`` that keeps ``rule`` (``F % a == b``), >= 1.

    Ties go to the longer clip, unless it is over ``most``: so the longest length
    ``/v1/videos`` states, ``MAX_NUM_FRAMES / fps`` seconds, is the longest count on
    the rule, not one frame count too many.
    """
    period, remainder = rule
    wanted = round(seconds * fps)
    below = remainder + period * ((wanted - remainder) // period)
    above = below + period
    if below < 1 or (above - wanted <= wanted - below and above <= most):
        return above if above >= 1 else above + period
    return below


def default_frames(fps: float, default_seconds: float, rule: tuple[int, int] | None) -> int | None:
    """A video model's frame count for a request that gives no length; ``None`` for images.

    Args:
        fps: the frames per second of its clips.
        default_seconds: the length of a request that gives none.
        rule: the runner's frame rule, ``None`` for an image model.
    """
    return None if rule is None else frames_for(default_seconds, fps, rule)


def _seconds(value: object, fps: float) -> float:
    """``seconds`` as a number of seconds: positive, finite, at most ``MAX_NUM_FRAMES`` frames."""
    number: int | float
    if isinstance(value, str):
        if len(value) > 40 or _NUMBER.fullmatch(value) is None:
            raise invalid(
                f"seconds: must be a positive number of seconds (e.g. '4'), got {shown(value)}",
                "seconds",
            )
        number = float(value)  # at most 40 digits: finite
    elif isinstance(value, int | float) and not isinstance(value, bool):
        # Compared as it is: float() of an integer over about 1.8e308 overflows.
        number = value
    else:
        raise invalid(
            f"seconds: must be a string or a number, got {shown(value)}", "seconds", "invalid_type"
        )
    longest = MAX_NUM_FRAMES / fps
    if (isinstance(number, float) and not math.isfinite(number)) or not 0 < number <= longest:
        raise invalid(
            f"seconds: must be > 0 and <= {longest:g} at {fps:g} frames per second,"
            f" got {shown(value)}",
            "seconds",
        )
    return float(number)


def video_spec(
    parsed: VideoBody,
    config: ServeConfig,
    *,
    fps: float,
    default_seconds: float,
    rule: tuple[int, int],
    deadline_header: str | None = None,
    admission: Admission | None = None,
    limits: UploadLimits | None = None,
) -> VideoSpec:
    """Stage 3: a checked body to the engine's request and what the job reports.

    Args:
        parsed: the checked body.
        config: the server's configuration (model, defaults, ``max_priority``).
        fps: the MP4's frames per second, which turns ``seconds`` into frames.
        default_seconds: the length when the body gives neither ``seconds`` nor
            ``num_frames``.
        rule: the runner's frame rule (``RunnerCapabilities.frames``).
        deadline_header: the ``X-Request-Deadline-Ms`` header's text, if sent.
        admission: the engine's limits, checked here, before the job takes a
            place in the store; ``None``: left to ``Engine.submit``.
        limits: the upload limits an ``input_reference`` is checked against.

    Raises:
        ApiError: 400 naming the field at fault: ``seconds`` (not ``num_frames``)
            for a frame count made from the ``seconds`` sent.
    """
    reference = _reference(parsed.input_reference, admission, limits)
    check_model(parsed.model, config)
    if parsed.seconds is not None and parsed.num_frames is not None:
        raise invalid("num_frames: give seconds or num_frames, not both", "num_frames")
    frames = parsed.num_frames
    if frames is not None:
        seconds = f"{frames / fps:g}"
    elif parsed.seconds is not None:
        given = _seconds(parsed.seconds, fps)
        frames = frames_for(given, fps, rule)
        seconds = f"{given:g}"
    else:
        seconds = f"{default_seconds:g}"
    width, height = size_given(parsed.size)
    fields = with_defaults(
        {
            "width": width,
            "height": height,
            "num_steps": parsed.num_inference_steps,
            "guidance_scale": parsed.guidance_scale,
            "num_frames": frames,
        },
        config,
        num_frames=default_frames(fps, default_seconds, rule),
    )
    try:
        request = GenerationRequest(
            prompt=parsed.prompt,
            negative_prompt=parsed.negative_prompt,
            **fields,
            seed=parsed.seed,
            priority=checked_priority(parsed.priority, config),
            deadline_s=deadline_seconds(parsed.deadline_ms, deadline_header),
            cache=parse_step_cache(parsed.cache),
            adapters=body_adapters(parsed.adapters, parsed.lora),
        )
        if admission is not None:
            admission.check(request, image_to_come=reference is not None)
    except InvalidRequestError as exc:
        if exc.field == "image":  # an image-to-video model asked for its image
            raise invalid(
                "input_reference: this model makes videos from an image: send one (a file)",
                "input_reference",
            ) from None
        if exc.field == "num_frames" and parsed.seconds is not None:
            # The client sent seconds: name what it sent.
            raise invalid(
                f"seconds: {seconds} s at {fps:g} frames per second is {fields['num_frames']}"
                f" frames, and {exc}",
                "seconds",
            ) from None
        raise api_error_from(exc) from None
    return VideoSpec(
        request=request,
        size=f"{request.width}x{request.height}",
        seconds=seconds,
        fps=fps,
        reference=reference,
    )


def _reference(value: object, admission: Admission | None, limits: UploadLimits | None) -> Any:
    """An ``input_reference`` upload's image, its header read and checked (L4); decode nothing.

    Raises:
        ApiError: 400 naming ``input_reference`` (a model that makes videos from text,
            not a file, not an image), 413 ``image_too_large``.
    """
    if value is None:
        return None
    if admission is None or not admission.makes_video_from_image:
        raise invalid(
            "input_reference: is not supported by this model (text to video only)",
            "input_reference",
            "unsupported_value",
        )
    if not isinstance(value, bytes):
        raise invalid(
            "input_reference: must be an image file (a multipart upload)",
            "input_reference",
            "invalid_type",
        )
    return read_header(value, "input_reference", limits or UploadLimits())


def with_reference(spec: VideoSpec) -> VideoSpec:
    """``spec`` with its ``input_reference`` decoded, made RGB, resized to the video's size,
    as the request's ``image`` (a worker thread's work: decoding costs).

    Raises:
        ApiError: 400 ``invalid_image``: the file is cut short or corrupt, or its mode
            cannot be read as RGB.
    """
    from PIL import Image

    if spec.reference is None:
        return spec
    image = decode(spec.reference, "input_reference")
    try:
        picture = image.convert("RGB")
    except (ValueError, OSError):
        raise invalid(
            f"input_reference: its mode {image.mode!r} cannot be read as RGB",
            "input_reference",
            "invalid_image",
        ) from None
    size = (spec.request.width, spec.request.height)
    if picture.size != size:
        picture = picture.resize(size, Image.Resampling.LANCZOS)
    request = dataclasses.replace(spec.request, image=picture)
    return dataclasses.replace(spec, request=request, reference=None)


def video_body(body: bytes, form: list[tuple[str, str | bytes]] | None) -> VideoBody:
    """Stages 1 and 2: a JSON body, or a form's parts (``form``), as a checked ``VideoBody``.

    Raises:
        ApiError: 400 naming the field at fault, or ``invalid_json``.
    """
    if form is None:
        return validate(VideoBody, load_json(body, VIDEO_FIELDS))
    values: dict[str, object] = {}
    for name, value in form:
        check_known(name, VIDEO_FIELDS)
        if name in values:
            raise invalid(f"{name}: given more than once", name)
        if isinstance(value, bytes):
            if name != "input_reference":
                raise invalid(f"{name}: must be a form field, not a file", name, "invalid_type")
            values[name] = value
        else:
            values[name] = value if name == "seconds" else form_value(name, value)
    return validate(VideoBody, values)
