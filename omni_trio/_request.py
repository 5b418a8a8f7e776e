"""What to generate: ``GenerationRequest``, validated at construction.

Validation that needs no engine (types, signs, finiteness) happens when the
dataclass is built; the limits of an engine (``EngineConfig``) and of its runner
(``RunnerCapabilities``) are checked by ``Engine.submit``. Every failure raises
``InvalidRequestError`` naming the field.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from ._validate import check_float, check_int, fail_request

__all__ = ["GenerationRequest"]

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
        fail = fail_request
        if not isinstance(self.prompt, str):
            fail("prompt", f"must be a str, got {type(self.prompt).__name__}")
        if self.negative_prompt is not None and not isinstance(self.negative_prompt, str):
            fail("negative_prompt", "must be a str or None")
        for name in ("num_steps", "height", "width", "num_images"):
            check_int(fail, name, getattr(self, name), minimum=1)
        check_int(fail, "preview_every", self.preview_every, minimum=0)
        scale = check_float(fail, "guidance_scale", self.guidance_scale, minimum=-math.inf)
        object.__setattr__(self, "guidance_scale", scale)
        if self.seed is not None:
            check_int(fail, "seed", self.seed, minimum=0)
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
