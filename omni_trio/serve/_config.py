"""ServeConfig: what the HTTP layer adds to an engine's configuration; Admission: what it admits."""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .._request import MAX_PRIORITY

if TYPE_CHECKING:
    from .._config import EngineConfig
    from .._request import GenerationRequest
    from .._runner import RunnerCapabilities
    from .._runner_adapters import RunnerAdapters
    from ._output_store import OutputStore

__all__ = ["Admission", "OutputConfig", "ServeConfig", "with_defaults"]

#: The longest time-to-live of an output's URL: a year, in seconds.
MAX_OUTPUT_TTL_S = 366 * 24 * 3600.0

#: The fewest bytes of a URL-signing secret (HMAC-SHA256's own key size is 32).
MIN_SECRET_BYTES = 16


@dataclass(frozen=True, slots=True, kw_only=True)
class OutputConfig:
    """Where ``response_format: "url"`` outputs are kept, and how their URLs are signed (L97).

    An image asked for as a URL (and a video job's content, asked for as one) is
    written to the store, and the answer carries a URL of this server's
    ``GET /v1/files/{key}``, signed (HMAC-SHA256 of the key and the expiry, with
    ``secret``) and expiring with the object ``ttl_s`` seconds later. Every replica
    that shares the store and the secret serves every URL.

    Args:
        store: a folder (a path), ``"s3://BUCKET[/PREFIX]"`` (an S3-compatible bucket
            through boto3, the ``s3`` extra: its credentials and endpoint from the
            standard ``AWS_*`` variables), or an ``OutputStore`` (``FolderStore``,
            ``S3Store`` with an ``endpoint_url``, or one of your own).
        ttl_s: seconds an output and its URL live (a video job's never outlive its
            job); then the URL is a 404 and the object is deleted.
        secret: the key URLs are signed with, shared by the replicas (at least 16
            bytes); ``None``: random bytes at start, logged as such: the URLs then die
            with the process and no other replica serves them.
        public_url: the server's address as clients reach it (``https://img.example``,
            a load balancer's), which URLs start with; ``None``: the request's own
            (its scheme, ``Host`` and root path).
        sweep_every_s: seconds between two sweeps of the store's expired objects.
        clock: wall-clock seconds since the epoch for expiries (tests pass a fake
            one); replicas compare them, so it is no monotonic clock.

    Raises:
        ValueError: a field is out of range; the message names it.
    """

    store: str | os.PathLike[str] | OutputStore
    ttl_s: float = 3600.0
    secret: bytes | None = field(default=None, repr=False)
    public_url: str | None = None
    sweep_every_s: float = 60.0
    clock: Callable[[], float] = field(default=time.time, compare=False, repr=False)

    def __post_init__(self) -> None:
        from ._output_store import OutputStore, output_store

        store = self.store
        if isinstance(store, str | os.PathLike) and os.fspath(store):
            output_store(store)  # a bucket's name is checked
        elif not isinstance(store, OutputStore):
            raise ValueError(
                f"store: must be a folder, 's3://BUCKET[/PREFIX]' or an OutputStore, got {store!r}"
            )
        for name, most in (("ttl_s", MAX_OUTPUT_TTL_S), ("sweep_every_s", MAX_OUTPUT_TTL_S)):
            value = getattr(self, name)
            if (
                not isinstance(value, int | float)
                or isinstance(value, bool)
                or not 1 <= value <= most
            ):
                raise ValueError(f"{name}: must be a number from 1 to {most:g}, got {value!r}")
        secret = self.secret
        if secret is not None and (not isinstance(secret, bytes) or len(secret) < MIN_SECRET_BYTES):
            raise ValueError(f"secret: must be bytes, at least {MIN_SECRET_BYTES} of them")
        url = self.public_url
        if url is not None and (
            not isinstance(url, str) or not url.startswith(("http://", "https://"))
        ):
            raise ValueError(f"public_url: must start with http:// or https://, got {url!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class ServeConfig:
    """How the HTTP server names its model, fills defaults and bounds bodies.

    The limits on steps, sizes, ``n`` and the queue are the engine's
    (``EngineConfig``); these are the HTTP layer's own, for its images, image
    edits and video jobs alike unless a field says otherwise (an edit's upload
    has ``UploadLimits``, a video job's length ``VideoConfig``).

    Args:
        model_name: the model id shown by ``/v1/models``; a request's ``model``
            must be this (or absent).
        default_width: the width of an image or a video when the request has no
            ``size`` (or ``"auto"``); an edit without one keeps its image's size
            (each side rounded to the model's multiple).
        default_height: the height, likewise.
        default_steps: ``num_inference_steps`` when the request has none.
        default_guidance_scale: ``guidance_scale`` when the request has none.
        max_body_bytes: larger request bodies (a generation's, a video job's)
            are refused with 413 before parsing; an edit's is bounded by
            ``UploadLimits.max_bytes`` instead.
        retry_after_s: the ``Retry-After`` seconds sent with 429 and 503.
        max_priority: the highest ``priority`` a request body may ask for (0 to
            ``MAX_PRIORITY``); a higher one is a 400. Clients are anonymous, so by
            default (0) none can put itself ahead of the others; lower priorities
            are always accepted.
        allow_adapter_admin: whether ``POST /v1/adapters`` and ``DELETE
            /v1/adapters/{name}`` load and unload adapters (L88); off by default.
        adapter_dir: the folder those loads read from (a client names a file in it,
            never a path of its own); needed by ``allow_adapter_admin``.
        warm_up: run one request of a few steps at the default size when the
            service starts, before it answers (``omni_trio.serve._warmup``): the
            engine's ``max_step_s`` then bounds the first client's step too. Off by
            default; ``omni-trio serve`` turns it on for a real model.
        warm_up_sizes: the ``(width, height)`` sizes the warm-up runs, each its own
            request (and, for a compiled model, a batch of two: L90); empty: the
            default size. Declare the sizes clients use: the first client's request of
            each is neither slow nor refused by an estimate from another shape.
        outputs: the output store behind ``response_format: "url"`` (L97); ``None``:
            none, and a ``url`` is a 400 that names this setting.

    Raises:
        ValueError: a field is out of range; the message names it.
    """

    model_name: str = "omni-trio"
    default_width: int = 512
    default_height: int = 512
    default_steps: int = 30
    default_guidance_scale: float = 7.5
    max_body_bytes: int = 1 << 20
    retry_after_s: int = 1
    max_priority: int = 0
    allow_adapter_admin: bool = False
    adapter_dir: str | None = None
    warm_up: bool = False
    warm_up_sizes: tuple[tuple[int, int], ...] = ()
    outputs: OutputConfig | None = None

    def __post_init__(self) -> None:
        if self.outputs is not None and not isinstance(self.outputs, OutputConfig):
            raise ValueError(f"outputs: must be an OutputConfig or None, got {self.outputs!r}")
        if not isinstance(self.model_name, str) or not self.model_name:
            raise ValueError("model_name: must be a non-empty str")
        for name in ("default_width", "default_height", "default_steps", "max_body_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}: must be an int >= 1, got {value!r}")
        if not isinstance(self.retry_after_s, int) or self.retry_after_s < 0:
            raise ValueError(f"retry_after_s: must be an int >= 0, got {self.retry_after_s!r}")
        priority = self.max_priority
        if (
            not isinstance(priority, int)
            or isinstance(priority, bool)
            or not 0 <= priority <= MAX_PRIORITY
        ):
            raise ValueError(
                f"max_priority: must be an int from 0 to {MAX_PRIORITY}, got {priority!r}"
            )
        scale = self.default_guidance_scale
        if (
            not isinstance(scale, int | float)
            or isinstance(scale, bool)
            or not math.isfinite(scale)
        ):
            raise ValueError(f"default_guidance_scale: must be a finite number, got {scale!r}")
        if self.allow_adapter_admin and self.adapter_dir is None:
            raise ValueError("allow_adapter_admin: needs an adapter_dir to load adapters from")
        sizes = self.warm_up_sizes
        if not isinstance(sizes, tuple) or not all(_is_size(size) for size in sizes):
            raise ValueError(f"warm_up_sizes: (width, height) pairs of ints >= 1, got {sizes!r}")


def _is_size(size: object) -> bool:
    """Whether ``size`` is a ``(width, height)`` pair of ints >= 1."""
    return (
        isinstance(size, tuple)
        and len(size) == 2
        and all(isinstance(side, int) and not isinstance(side, bool) and side >= 1 for side in size)
    )


def with_defaults(
    fields: Mapping[str, Any], config: ServeConfig, *, num_frames: int | None = None
) -> dict[str, Any]:
    """A request's fields, with the server's defaults where one is absent or ``None``.

    The one place a request's defaults are filled: the HTTP bodies (images, edits,
    videos) and the Ray handle's ``generate`` call it, so a request that leaves a
    field out gets the same whichever way it came (the model's defaults, as
    ``build_service`` made ``config``, not ``GenerationRequest``'s own).

    Args:
        fields: ``GenerationRequest`` fields, by name.
        config: the defaults: ``width`` and ``height`` (``default_width``,
            ``default_height``), ``num_steps`` (``default_steps``) and
            ``guidance_scale`` (``default_guidance_scale``).
        num_frames: a video model's default frame count (its default length at
            its frames per second), ``None`` for an image model.

    Returns:
        A new dict: ``fields`` with every default it lacked.
    """
    defaults: dict[str, Any] = {
        "width": config.default_width,
        "height": config.default_height,
        "num_steps": config.default_steps,
        "guidance_scale": config.default_guidance_scale,
    }
    if num_frames is not None:
        defaults["num_frames"] = num_frames
    filled = dict(fields)
    for name, value in defaults.items():
        if filled.get(name) is None:
            filled[name] = value
    return filled


@dataclass(frozen=True, slots=True, kw_only=True)
class Admission:
    """The engine's limits and its runner's rules, to refuse a request before any work on it.

    ``Engine.submit`` checks the same (L4); a route checks them first where a body
    would cost work to turn into a request (an edit's upload is decoded, resized
    and copied; a video job takes a place), so that a request the engine refuses
    costs none (L4, amended).

    Args:
        engine: the engine's configuration (steps, sizes, ``n``, prompt lengths).
        capabilities: the runner's (size rules, a fixed size, images taken);
            ``None`` for a runner that declares none.
        adapters: the runners' adapters, read as the engine reads them (a request
            names only adapters every runner has, L85); ``None`` for runners that
            take none.
        step_time: the open engine's ``Engine.check_step_time`` (``max_step_s``, by
            the steps it measured), or ``None``.
    """

    engine: EngineConfig
    capabilities: RunnerCapabilities | None = None
    adapters: RunnerAdapters | None = None
    step_time: Callable[[GenerationRequest], None] | None = None

    @property
    def takes_images(self) -> bool:
        """Whether the runner takes an input image (``RunnerCapabilities.image_input``)."""
        return self.capabilities is not None and self.capabilities.image_input

    @property
    def makes_video_from_image(self) -> bool:
        """Whether the runner makes videos from an image (``image_to_video``, L69)."""
        return self.capabilities is not None and self.capabilities.image_to_video

    def check(self, request: GenerationRequest, *, image_to_come: bool = False) -> None:
        """Raise ``InvalidRequestError`` naming the field, as ``Engine.submit`` would.

        Args:
            request: the request, its image left out if ``image_to_come``.
            image_to_come: an image-to-video request whose image is decoded only once
                the rest is admitted (L4): the image it needs is not asked for yet.

        Raises:
            InvalidRequestError: a field over the engine's limits or off the runner's rules.
        """
        self.engine.check_request(request)
        capabilities = self.capabilities
        if capabilities is not None:
            if image_to_come and capabilities.image_to_video:
                capabilities = dataclasses.replace(capabilities, image_to_video=False)
            capabilities.check_request(request)
        if self.adapters is not None:
            self.adapters.check_request(request)
        if self.step_time is not None:
            self.step_time(request)
