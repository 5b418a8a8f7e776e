"""The body of ``POST /v1/videos``: OpenAI's video fields and the diffusion ones, to a request.

The OpenAI SDK's ``client.videos.create`` sends a ``multipart/form-data`` form
(every value as text, ``seconds`` as ``"4"``); ``curl`` users may send JSON. Both
are read into the same strict model (form text typed by ``_forms``, as for
``/v1/images/edits``) and checked in the same three stages as a generation body (L73):

- OpenAI's fields: ``prompt`` (required), ``model`` (the served one, or absent),
  ``seconds`` (a positive number, as text or a number), ``size`` (``"WxH"``);
  ``input_reference`` is refused (no image-to-video here);
- the extensions: ``num_frames`` (instead of ``seconds``), ``num_inference_steps``,
  ``guidance_scale``, ``seed``, ``negative_prompt``, ``priority``,
  ``deadline_ms`` (and the ``X-Request-Deadline-Ms`` header) and ``cache`` (the
  step-cache policy, L84), as for images.

``seconds`` becomes a frame count: ``seconds x fps`` rounded, then moved to the
nearest count the runner's frame rule (``RunnerCapabilities.frames``: ``F % a ==
b``) takes, ties upwards (Wan, 4k + 1 frames, 4 s at 16 fps: 64, so 65). A
``num_frames`` is taken as it is, and refused (400 naming it) off the rule.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from .._errors import InvalidRequestError
from .._request import MAX_DEADLINE_S, MAX_NUM_FRAMES, MAX_PRIORITY, GenerationRequest
from .._stepcache import parse_step_cache
from ._config import ServeConfig
from ._errors import api_error_from, invalid
from ._forms import check_known, form_value
from ._schema import (
    CachePolicy,
    Count,
    Number,
    Text,
    check_model,
    checked_priority,
    deadline_seconds,
    load_json,
    shown,
    size_of,
    validate,
)

__all__ = [
    "VIDEO_FIELDS",
    "VideoBody",
    "VideoSpec",
    "frames_for",
    "parse_video_body",
    "video_body",
    "video_spec",
]

_NUMBER = re.compile(r"(?:0|[1-9][0-9]*)(?:\.[0-9]+)?")


class VideoBody(BaseModel):
    """A video job's body, type-checked: strict, as ``GenerationBody`` is.

    ``seconds`` is checked in stage 3 (OpenAI sends text, JSON clients may send a
    number); ``input_reference`` only to refuse it by name.
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
    """

    request: GenerationRequest
    size: str
    seconds: str
    fps: float


def frames_for(seconds: float, fps: float, rule: tuple[int, int]) -> int:
    """The frame count nearest ``seconds x fps`` that keeps ``rule`` (``F % a == b``), >= 1.

    Ties go to the longer clip.
    """
    period, remainder = rule
    wanted = round(seconds * fps)
    below = remainder + period * ((wanted - remainder) // period)
    above = below + period
    if below < 1 or above - wanted <= wanted - below:
        return above if above >= 1 else above + period
    return below


def _seconds(value: object, fps: float) -> float:
    """``seconds`` as a number of seconds: positive, finite, at most ``MAX_NUM_FRAMES`` frames."""
    if isinstance(value, str):
        if len(value) > 40 or _NUMBER.fullmatch(value) is None:
            raise invalid(
                f"seconds: must be a positive number of seconds (e.g. '4'), got {shown(value)}",
                "seconds",
            )
        number = float(value)
    elif isinstance(value, int | float) and not isinstance(value, bool):
        number = float(value)
    else:
        raise invalid(
            f"seconds: must be a string or a number, got {shown(value)}", "seconds", "invalid_type"
        )
    longest = MAX_NUM_FRAMES / fps
    if not math.isfinite(number) or not 0 < number <= longest:
        raise invalid(
            f"seconds: must be > 0 and <= {longest:g} at {fps:g} frames per second,"
            f" got {shown(value)}",
            "seconds",
        )
    return number


def video_spec(
    parsed: VideoBody,
    config: ServeConfig,
    *,
    fps: float,
    default_seconds: float,
    rule: tuple[int, int],
    deadline_header: str | None = None,
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

    Raises:
        ApiError: 400 naming the field at fault.
    """
    if parsed.input_reference is not None:
        raise invalid(
            "input_reference: is not supported by this server (text to video only)",
            "input_reference",
            "unsupported_value",
        )
    check_model(parsed.model, config)
    if parsed.seconds is not None and parsed.num_frames is not None:
        raise invalid("num_frames: give seconds or num_frames, not both", "num_frames")
    if parsed.num_frames is not None:
        frames = parsed.num_frames
        seconds = f"{frames / fps:g}"
    else:
        given = None if parsed.seconds is None else _seconds(parsed.seconds, fps)
        length = default_seconds if given is None else given
        frames = frames_for(length, fps, rule)
        seconds = f"{length:g}"
    width, height = size_of(parsed.size, config)
    steps = parsed.num_inference_steps
    guidance = parsed.guidance_scale
    try:
        request = GenerationRequest(
            prompt=parsed.prompt,
            negative_prompt=parsed.negative_prompt,
            num_steps=config.default_steps if steps is None else steps,
            height=height,
            width=width,
            num_frames=frames,
            guidance_scale=config.default_guidance_scale if guidance is None else guidance,
            seed=parsed.seed,
            priority=checked_priority(parsed.priority, config),
            deadline_s=deadline_seconds(parsed.deadline_ms, deadline_header),
            cache=parse_step_cache(parsed.cache),
        )
    except InvalidRequestError as exc:
        raise api_error_from(exc) from None
    return VideoSpec(request=request, size=f"{width}x{height}", seconds=seconds, fps=fps)


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


def parse_video_body(
    body: bytes,
    form: list[tuple[str, str | bytes]] | None,
    config: ServeConfig,
    *,
    fps: float,
    default_seconds: float,
    rule: tuple[int, int],
    deadline_header: str | None = None,
) -> VideoSpec:
    """Read, check and turn a video body into a ``VideoSpec``.

    Args:
        body: the raw body (read as JSON when ``form`` is ``None``).
        form: the parts of a ``multipart/form-data`` body, already read.
        config: the server's configuration.
        fps: see ``video_spec``.
        default_seconds: see ``video_spec``.
        rule: the runner's frame rule.
        deadline_header: the ``X-Request-Deadline-Ms`` header's text, if sent.

    Raises:
        ApiError: 400 naming the field at fault.
    """
    parsed = video_body(body, form)
    return video_spec(
        parsed,
        config,
        fps=fps,
        default_seconds=default_seconds,
        rule=rule,
        deadline_header=deadline_header,
    )
