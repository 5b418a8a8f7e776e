"""What to generate: ``GenerationRequest``, validated at construction.

Validation that needs no engine (types, signs, finiteness, text that is text,
the guidance bound) happens when the dataclass is built; the limits of an engine
(``EngineConfig``) and of its runner (``RunnerCapabilities``) are checked by
``Engine.submit``. Every failure raises ``InvalidRequestError`` naming the field,
so hostile input is refused at admission, never counted as a model failure.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from ._validate import check_float, check_int, check_text, fail_request

__all__ = ["MAX_DEADLINE_S", "MAX_GUIDANCE_SCALE", "MAX_PRIORITY", "GenerationRequest"]

_SEED_LIMIT = 2**64

#: The largest ``abs(guidance_scale)`` accepted. Models are tuned for 1 to about
#: 30, so no useful request is refused; and guidance times a difference of noise
#: predictions of order one stays inside float16's range (65,504), where larger
#: values only overflow to inf and NaN inside the model. What still overflows is
#: caught by the engine's output check (the request fails, no NaN is delivered).
MAX_GUIDANCE_SCALE = 1e4

#: The largest ``abs(priority)`` accepted: a signed 32-bit range, which every
#: client language and wire format carries exactly, and far more levels than any
#: scheduling policy needs.
MAX_PRIORITY = 2**31 - 1

#: The longest ``deadline_s`` accepted: a million seconds (11.6 days), beyond any
#: generation, and small enough that the absolute deadline (the loop's clock plus
#: this) stays an exact, finite float.
MAX_DEADLINE_S = 1e6


@dataclass(frozen=True, slots=True, kw_only=True)
class GenerationRequest:
    """What to generate: one prompt, one size, one seed.

    Args:
        prompt: the text prompt: no lone surrogates (it must encode as UTF-8) and
            no control characters but tab, newline and carriage return.
        negative_prompt: what to steer away from, where the runner supports it
            (text, as ``prompt``).
        num_steps: denoise steps, >= 1.
        height: image height in pixels.
        width: image width in pixels.
        guidance_scale: classifier-free guidance scale, finite, at most
            ``MAX_GUIDANCE_SCALE`` (1e4) in absolute value.
        seed: the random seed; ``None`` lets the runner pick one.
        num_images: images generated for this prompt.
        preview_every: send a preview with every n-th step event (0: never).
        extra: runner-specific options; keys the runner does not know are refused.
            Keys, and values that are strings, must be text, as ``prompt``.
        priority: an int, at most ``MAX_PRIORITY`` (2**31 - 1) in absolute value
            (not a bool). A worker takes the waiting request of highest priority
            first; among equal priorities, the earliest deadline, then the
            earliest admitted (L60, L62).
        deadline_s: seconds after submission by which the request must be done,
            or ``None`` (no deadline). A finite number, > 0 and at most
            ``MAX_DEADLINE_S`` (1e6). When it passes, the request is aborted with
            reason ``"deadline"``; ``submit`` refuses it with ``DeadlineError`` when
            the engine's estimate says it cannot be met (L62).

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
    priority: int = 0
    deadline_s: float | None = None

    def __post_init__(self) -> None:
        fail = fail_request
        # Each field is stored as the exact built-in its check returns.
        store = object.__setattr__
        store(self, "prompt", check_text(fail, "prompt", self.prompt))
        if self.negative_prompt is not None:
            store(
                self, "negative_prompt", check_text(fail, "negative_prompt", self.negative_prompt)
            )
        for name in ("num_steps", "height", "width", "num_images"):
            store(self, name, check_int(fail, name, getattr(self, name), minimum=1))
        store(
            self, "preview_every", check_int(fail, "preview_every", self.preview_every, minimum=0)
        )
        scale = check_float(
            fail,
            "guidance_scale",
            self.guidance_scale,
            minimum=-MAX_GUIDANCE_SCALE,
            maximum=MAX_GUIDANCE_SCALE,
        )
        store(self, "guidance_scale", scale)
        if self.seed is not None:
            seed = check_int(fail, "seed", self.seed, minimum=0)
            if seed >= _SEED_LIMIT:
                fail("seed", "must be < 2**64")
            store(self, "seed", seed)
        store(self, "extra", MappingProxyType(_checked_extra(self.extra)))
        store(
            self,
            "priority",
            check_int(fail, "priority", self.priority, minimum=-MAX_PRIORITY, maximum=MAX_PRIORITY),
        )
        if self.deadline_s is not None:
            deadline = check_float(
                fail, "deadline_s", self.deadline_s, minimum=0.0, maximum=MAX_DEADLINE_S
            )
            if deadline == 0.0:
                fail("deadline_s", "must be > 0, got 0.0")
            store(self, "deadline_s", deadline)


def _checked_extra(extra: object) -> dict[str, object]:
    """A private copy of ``extra`` with text keys (and text string values).

    A copy, read once: a caller mutating its dict later must not change an
    admitted request, and the checks see exactly what is stored.
    """
    if not isinstance(extra, Mapping):
        fail_request("extra", f"must be a mapping, got {type(extra).__name__}")
    try:
        items = list(extra.items())
    except Exception as exc:  # a hostile mapping: refuse it, do not crash
        fail_request("extra", f"could not be read ({type(exc).__name__})")
    copy: dict[str, object] = {}
    for key, value in items:
        if not isinstance(key, str):
            fail_request("extra", f"keys must be str, got {type(key).__name__}")
        key = check_text(fail_request, "extra", key, what="a key")
        if isinstance(value, str):
            value = check_text(fail_request, "extra", value, what=f"the value of {key!r}")
        copy[key] = value
    return copy
