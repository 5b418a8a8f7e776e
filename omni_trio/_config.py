"""Engine configuration and generation requests, validated at construction.

Validation that needs no engine (types, signs, finiteness) happens when the
dataclass is built; the limits of an engine (``EngineConfig``) and of its runner
(``RunnerCapabilities``) are checked by ``Engine.submit``. Every failure names the
field: ``InvalidRequestError`` for requests, ``ValueError`` for configuration.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import NoReturn

from ._errors import InvalidRequestError

__all__ = ["EngineConfig", "GenerationRequest"]

_Fail = Callable[[str, str], NoReturn]


def _fail_config(name: str, message: str) -> NoReturn:
    raise ValueError(f"{name}: {message}")


def _fail_request(name: str, message: str) -> NoReturn:
    raise InvalidRequestError(message, field=name)


def _check_int(fail: _Fail, name: str, value: object, *, minimum: int) -> int:
    # bool is an int subclass; True as a step count is a bug, not a 1.
    if not isinstance(value, int) or isinstance(value, bool):
        fail(name, f"must be an int, got {type(value).__name__}")
    if value < minimum:
        fail(name, f"must be >= {minimum}, got {value}")
    return value


def _check_float(fail: _Fail, name: str, value: object, *, minimum: float) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool):
        fail(name, f"must be a number, got {type(value).__name__}")
    if not math.isfinite(value):
        fail(name, f"must be finite, got {value}")
    if value < minimum:
        fail(name, f"must be >= {minimum}, got {value}")
    return float(value)


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineConfig:
    """How an engine schedules, buffers, bounds and shuts down.

    Args:
        max_batch_size: most requests run together in one denoise step (the
            runner's own limit applies too).
        max_waiting: most requests waiting for the worker; ``submit`` raises
            ``QueueFullError`` beyond it.
        event_buffer: step events kept per request for a slow consumer; newer
            events replace older ones.
        shutdown_grace: seconds running requests get to finish when the engine
            closes; 0 stops them at the next step boundary.
        max_steps: largest ``num_steps`` accepted.
        max_height: largest ``height`` accepted, in pixels.
        max_width: largest ``width`` accepted, in pixels.
        max_num_images: largest ``num_images`` accepted.
        max_prompt_chars: longest prompt (and negative prompt) accepted.
    """

    max_batch_size: int = 4
    max_waiting: int = 1024
    event_buffer: int = 16
    shutdown_grace: float = 0.0
    max_steps: int = 1000
    max_height: int = 2048
    max_width: int = 2048
    max_num_images: int = 16
    max_prompt_chars: int = 16_384

    def __post_init__(self) -> None:
        for name in (
            "max_batch_size",
            "max_waiting",
            "event_buffer",
            "max_steps",
            "max_height",
            "max_width",
            "max_num_images",
            "max_prompt_chars",
        ):
            _check_int(_fail_config, name, getattr(self, name), minimum=1)
        grace = _check_float(_fail_config, "shutdown_grace", self.shutdown_grace, minimum=0.0)
        object.__setattr__(self, "shutdown_grace", grace)

    def check_request(self, request: GenerationRequest) -> None:
        """Raise ``InvalidRequestError`` naming the first field over this config's limits."""
        for name, limit in (
            ("num_steps", self.max_steps),
            ("height", self.max_height),
            ("width", self.max_width),
            ("num_images", self.max_num_images),
        ):
            value: int = getattr(request, name)
            if value > limit:
                _fail_request(name, f"must be <= {limit} (engine limit), got {value}")
        for name in ("prompt", "negative_prompt"):
            text: str | None = getattr(request, name)
            if text is not None and len(text) > self.max_prompt_chars:
                _fail_request(name, f"longer than {self.max_prompt_chars} characters")


_SEED_LIMIT = 2**64


@dataclass(frozen=True, slots=True, kw_only=True)
class GenerationRequest:
    """What to generate: one prompt, one size, one seed.

    Args:
        prompt: the text prompt.
        negative_prompt: what to steer away from, where the runner supports it.
        num_steps: denoise steps, >= 1.
        height: image height in pixels.
        width: image width in pixels.
        guidance_scale: classifier-free guidance scale (finite).
        seed: the random seed; ``None`` lets the runner pick one.
        num_images: images generated for this prompt.
        preview_every: send a preview with every n-th step event (0: never).
        extra: runner-specific options; keys the runner does not know are refused.

    Raises:
        InvalidRequestError: a field has a wrong type or value; ``field`` names it.
    """

    prompt: str = ""
    negative_prompt: str | None = None
    num_steps: int = 30
    height: int = 512
    width: int = 512
    guidance_scale: float = 7.5
    seed: int | None = None
    num_images: int = 1
    preview_every: int = 0
    extra: Mapping[str, object] = field(default_factory=dict)

    def __post_init__(self) -> None:
        fail = _fail_request
        if not isinstance(self.prompt, str):
            fail("prompt", f"must be a str, got {type(self.prompt).__name__}")
        if self.negative_prompt is not None and not isinstance(self.negative_prompt, str):
            fail("negative_prompt", "must be a str or None")
        for name in ("num_steps", "height", "width", "num_images"):
            _check_int(fail, name, getattr(self, name), minimum=1)
        _check_int(fail, "preview_every", self.preview_every, minimum=0)
        scale = _check_float(fail, "guidance_scale", self.guidance_scale, minimum=-math.inf)
        object.__setattr__(self, "guidance_scale", scale)
        if self.seed is not None:
            _check_int(fail, "seed", self.seed, minimum=0)
            if self.seed >= _SEED_LIMIT:
                fail("seed", "must be < 2**64")
        if not isinstance(self.extra, Mapping):
            fail("extra", f"must be a mapping, got {type(self.extra).__name__}")
        for key in self.extra:
            if not isinstance(key, str):
                fail("extra", f"keys must be str, got {key!r}")
        # A private copy: a caller mutating its dict later must not change an
        # admitted request.
        object.__setattr__(self, "extra", MappingProxyType(dict(self.extra)))
