"""What to generate: ``GenerationRequest``, validated at construction.

Validation that needs no engine (types, signs, finiteness, text that is text,
the guidance bound) happens when the dataclass is built; the limits of an engine
(``EngineConfig``) and of its runner (``RunnerCapabilities``) are checked by
``Engine.submit``. Every failure raises ``InvalidRequestError`` naming the field,
so hostile input is refused at admission, never counted as a model failure.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Literal, TypeAlias

from ._adapters import AdapterPairs, check_adapter_pairs
from ._sampling import Sampler, check_sampler
from ._stepcache import StepCache
from ._validate import (
    MAX_TENANT_CHARS,
    check_float,
    check_image,
    check_int,
    check_tenant,
    check_text,
    fail_request,
    image_size,
)

if TYPE_CHECKING:
    import torch
    from PIL import Image

__all__ = [
    "DEFAULT_STRENGTH",
    "MAX_DEADLINE_S",
    "MAX_GUIDANCE_SCALE",
    "MAX_NUM_FRAMES",
    "MAX_PRIORITY",
    "MAX_TENANT_CHARS",
    "GenerationRequest",
    "ImageInput",
    "RequestKind",
    "denoise_steps",
]

#: What ``image`` and ``mask`` take: a PIL image or a CPU float tensor ``[C, H, W]``
#: in [0, 1]. Either is stored as a private CPU ``float32`` tensor.
ImageInput: TypeAlias = "torch.Tensor | Image.Image"

#: What a request asks for: no image, an image to vary, or an image and a mask.
RequestKind: TypeAlias = Literal["text-to-image", "image-to-image", "inpaint", "image-to-video"]

#: ``strength`` when an image is given without one: diffusers' Stable Diffusion
#: defaults (``StableDiffusionImg2ImgPipeline``: 0.8, ``...InpaintPipeline``: 1.0).
DEFAULT_STRENGTH: Mapping[str, float] = MappingProxyType({"image-to-image": 0.8, "inpaint": 1.0})

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

#: The most ``num_frames`` accepted: three minutes at 24 frames a second, beyond what
#: today's video models make in one generation (Wan: 81, LTX-Video: 257), so no
#: useful request is refused, and a hostile number never sizes an allocation.
MAX_NUM_FRAMES = 4320


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
        image: an image to start from (image-to-image), or ``None`` (text to
            image): a PIL image of mode ``RGB`` or a CPU float tensor ``[3, H, W]``
            with values in [0, 1], exactly ``height`` x ``width`` (resize it first:
            nothing is resized here). Stored as a private CPU ``float32`` tensor
            ``[3, H, W]``, so a caller changing it later changes nothing (L74).
        mask: where to repaint (inpainting): a PIL image of mode ``L`` or ``1``,
            or a CPU float tensor ``[1, H, W]`` in [0, 1], of the image's size; white
            (>= 0.5) is repainted, black kept. Needs ``image``. Stored as ``image`` is.
        strength: how much of the schedule runs from the noised image: in (0, 1],
            only with ``image``. ``None`` means ``DEFAULT_STRENGTH`` for the kind
            (0.8 for image-to-image, 1.0 for inpainting; an image to video, with
            ``num_frames``, keeps ``None``: every step runs); the stored value is the
            one that applies. ``denoise_steps`` (``num_steps * strength`` rounded
            down, as diffusers counts it) must be at least 1.
        num_frames: the frames of a video, or ``None`` for an image: an int from 1
            to ``MAX_NUM_FRAMES`` (4320). A video runner takes only counts that
            keep its frame rule (``RunnerCapabilities.frames``) and needs one; an
            image runner refuses it (L70).
        cache: the request's step-cache policy (``StepCache``, L80), or ``None``
            for the engine's ``default_cache``; ``StepCache(kind="none")`` opts out
            of that default. A runner that cannot apply it refuses it at ``submit``.
        adapters: the adapters (LoRA) to apply, name to scale (``{"ink": 0.8}``, L85),
            or ``(name, scale)`` pairs; stored as a tuple of pairs, in the order
            given. Names as ``ADAPTER_NAME``, each once; scales finite, at most
            ``MAX_ADAPTER_SCALE`` (100) in absolute value. ``submit`` refuses a name no
            runner has loaded, or more than ``RunnerCapabilities.max_adapters``.
            Never part of a batch key: requests with different adapters share
            batches (L86).
        tenant: whose request this is, for fair share (L57, L58): within a
            priority level, workers share device time between tenants by their
            weights (``EngineConfig.tenant_weights``), counted in step-seconds.
            ``None``, the default tenant, is one tenant like any other. A name:
            text, as ``prompt``, of 1 to ``MAX_TENANT_CHARS`` (256) characters on one
            line, with no whitespace but inner spaces (a log field and a metrics
            label).
        sampler: sample stochastically (L100): an ``SDESampler`` (flow matching) or a
            ``DDIMSampler`` (DDIM with ``eta > 0``), its steps below ``denoise_steps``;
            ``None`` (the default): the scheduler's own step. A runner that declares no
            such sampler (``RunnerCapabilities.samplers``) refuses it at ``submit``.
            Never part of a batch key.
        return_trajectory: return the request's trajectory with its output
            (``GenerationOutput.trajectory``: each step's latents, the noise drawn, the
            timesteps and the transition log-probabilities, L100). Needs ``sampler``.

    Equality compares every field, images by value; ``repr`` leaves the images out.

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
    image: ImageInput | None = field(default=None, repr=False)
    mask: ImageInput | None = field(default=None, repr=False)
    strength: float | None = None
    num_frames: int | None = None
    cache: StepCache | None = None
    adapters: Mapping[str, float] | AdapterPairs = ()
    tenant: str | None = None
    sampler: Sampler | None = None
    return_trajectory: bool = False

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
        if self.num_frames is not None:
            store(
                self,
                "num_frames",
                check_int(fail, "num_frames", self.num_frames, minimum=1, maximum=MAX_NUM_FRAMES),
            )
        if self.cache is not None and not isinstance(self.cache, StepCache):
            fail("cache", f"must be a StepCache or None, got {type(self.cache).__name__}")
        store(self, "adapters", check_adapter_pairs(fail, self.adapters))
        if self.tenant is not None:
            store(self, "tenant", check_tenant(fail, "tenant", self.tenant))
        self._check_edit()
        self._check_sampler()

    def _check_sampler(self) -> None:
        """L100: the sampler's steps are among those that run; a trajectory needs a sampler."""
        if self.sampler is not None:
            check_sampler(self.sampler, self.denoise_steps)
            if self.mask is not None:
                fail_request(
                    "sampler",
                    "inpainting keeps part of every step's latent: a transition's"
                    " probability would not be the sampler's; leave the mask or the sampler out",
                )
        if not isinstance(self.return_trajectory, bool):
            fail_request(
                "return_trajectory", f"must be a bool, got {type(self.return_trajectory).__name__}"
            )
        if self.return_trajectory and self.sampler is None:
            fail_request("return_trajectory", "needs a sampler (SDESampler or DDIMSampler)")

    def _check_edit(self) -> None:
        """L74: ``image``, ``mask`` and ``strength``; sizes are read before any conversion."""
        fail = fail_request
        store = object.__setattr__
        if self.image is None:
            if self.mask is not None:
                fail("mask", "needs an image to repaint")
            if self.strength is not None:
                fail("strength", "applies to an image; give one, or leave strength out")
            return
        size = (self.height, self.width)
        for name, value in (("image", self.image), ("mask", self.mask)):
            found = image_size(value)
            if found is not None and found != size:
                what = "the request is" if name == "image" else "the image is"
                fail(
                    name,
                    f"is {found[1]}x{found[0]} (width x height), {what}"
                    f" {size[1]}x{size[0]}: resize it, or set height and width to its size",
                )
        store(self, "image", check_image(fail, "image", self.image, channels=3))
        if self.mask is not None:
            store(self, "mask", check_image(fail, "mask", self.mask, channels=1))
        if self.strength is None:
            if self.kind == "image-to-video":
                return  # L69: every step runs, from noise beside the image
            strength = DEFAULT_STRENGTH[self.kind]
        else:
            strength = check_float(fail, "strength", self.strength, minimum=0.0, maximum=1.0)
            if strength == 0.0:
                fail("strength", "must be > 0 (0 would keep the image as it is), got 0.0")
        store(self, "strength", strength)
        if self.denoise_steps < 1:
            fail(
                "strength",
                f"{strength:g} x num_steps {self.num_steps} runs no step;"
                f" it must be at least 1 / num_steps",
            )

    @property
    def adapter_pairs(self) -> AdapterPairs:
        """``adapters`` as stored: ``(name, scale)`` pairs, in the order given."""
        pairs = self.adapters
        assert isinstance(pairs, tuple)
        return pairs

    @property
    def kind(self) -> RequestKind:
        """``"text-to-image"``, ``"image-to-image"`` (an image), ``"inpaint"`` (and a mask),
        or ``"image-to-video"`` (an image and ``num_frames``, no mask: L69)."""
        if self.image is None:
            return "text-to-image"
        if self.mask is None and self.num_frames is not None:
            return "image-to-video"
        return "image-to-image" if self.mask is None else "inpaint"

    @property
    def denoise_steps(self) -> int:
        """The denoise steps that run: ``num_steps``, or with an image the last
        ``min(int(num_steps * strength), num_steps)`` of its schedule, as diffusers'
        image-to-image and inpainting pipelines count them (L75).
        """
        if self.image is None:
            return self.num_steps
        return denoise_steps(self.num_steps, self.strength)

    def __eq__(self, other: object) -> bool:
        # Not the dataclass's tuple comparison: a tensor's == is elementwise.
        if other.__class__ is not self.__class__:
            return NotImplemented
        return all(_same(getattr(self, name), getattr(other, name)) for name in _FIELD_NAMES)


def denoise_steps(num_steps: int, strength: float | None) -> int:
    """The steps an image's edit runs: ``min(int(num_steps * strength), num_steps)``.

    ``None`` is a strength of 1 (all of them). Diffusers' image-to-image and
    inpainting pipelines count them so.
    """
    if strength is None:
        return num_steps
    return min(int(num_steps * strength), num_steps)


_FIELD_NAMES = tuple(f.name for f in fields(GenerationRequest))


def _same(first: Any, second: Any) -> bool:
    """Field equality: tensors (the stored images) by shape and value."""
    if first is second:
        return True
    torch = sys.modules.get("torch")  # a stored image is a tensor: torch is imported then
    if torch is not None and isinstance(first, torch.Tensor):
        return isinstance(second, torch.Tensor) and bool(torch.equal(first, second))
    return bool(first == second)


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
