"""The family base of ``DiffusersRunner``: a request's state, and the helpers families share.

A family knows how its pipeline encodes a prompt, prepares the initial latents
and the per-request scheduler (exactly as the pipeline's own ``__call__`` does, so
a seed gives the same image), calls its denoiser on a batch of rows, and decodes.
``Family`` is that interface; the families themselves live in ``_sd``, ``_flow`` and
``_video``, the step loop shared by all of them in ``_diffusers``.

A family class also declares its facts, which the rest of the package reads off it
(through the registry, ``_registry``) instead of keeping tables of its own: the
pipelines it drives, where its denoisers and their blocks are (the cancel points'
modules, the step cache's blocks and how each is called), its clips' frames per
second, the ``__call__`` parameter its guidance is, whether sequence parallel serves
it (and the splits known wrong), whether it takes adapters. Its tiny pipeline is
``tiny_pipeline(name)``.
"""

from __future__ import annotations

import inspect
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from .._request import GenerationRequest
from ._chunks import DecodeChunks
from ._prompts import Encoded, PromptCacheMetrics, encoded, tokenizers_held
from ._sde import SamplerState, sampler_scheduler
from ._stepcache import BlockSpec, RequestCache

__all__ = [
    "Family",
    "RequestState",
    "calculate_shift",
    "guidance_rows",
    "joined",
    "per_image",
    "randn",
    "retrieve_timesteps",
    "step_groups",
    "unit_number",
    "wan_denormalized",
]


@dataclass(eq=False)
class RequestState:
    """One request inside a ``DiffusersRunner``: its latents, scheduler and conditioning.

    ``cond`` holds per-row model inputs (with classifier-free guidance the rows
    are ``[uncond..., cond...]``); ``shared`` holds inputs that are the same for
    every request of one batch (Flux's position ids, Qwen-Image's image shape).
    ``text_lengths`` is each row's count of real text tokens where the family pads
    its text conditioning to a common length (Qwen-Image); empty otherwise.
    ``edit`` holds an inpainting request's own tensors (the image's latents, the
    noise, the mask; see ``_edit``); empty otherwise. ``timesteps`` are the ones
    that run: for an image with strength < 1, the last ``denoise_steps`` (L75).
    ``cache`` is the request's step cache (``_stepcache.RequestCache``, L80-L82), or
    ``None`` without a policy. ``adapters`` are the adapters its rows run with, as the
    runner's ``AdapterSet`` resolved and holds them: ``(PEFT name, scale)`` pairs (L85).
    ``prompts`` is what the runner's prompt cache did for its texts (L94), or ``None``.
    ``sampler`` is its stochastic sampler's state (``_sde``, L100), or ``None``.
    """

    request_id: str
    request: GenerationRequest
    generator: torch.Generator
    scheduler: Any
    timesteps: torch.Tensor
    groups: list[int]
    latents: torch.Tensor | None
    cfg: bool
    cond: dict[str, torch.Tensor]
    shared: dict[str, Any] = field(default_factory=dict)
    text_lengths: list[int] = field(default_factory=list)
    edit: dict[str, torch.Tensor] = field(default_factory=dict)
    step_kwargs: dict[str, Any] = field(default_factory=dict)
    position: int = 0
    steps_done: int = 0
    ready: Any = None
    #: Where the tensors that a suspension moved to host memory came from.
    parked_from: dict[int, torch.device] | None = None
    cache: RequestCache | None = None
    adapters: tuple[tuple[str, float], ...] = ()
    prompts: PromptCacheMetrics | None = None
    sampler: SamplerState | None = None


def step_groups(calls: int, steps: int, order: int) -> list[int]:
    """Split ``calls`` model calls into ``steps`` steps, as the pipelines' progress bar does.

    Schedulers with warm-up calls (PNDM) or second-order steps (Heun) make more
    model calls than steps; each engine step runs one group of them.
    """
    warmup = calls - steps * order
    groups: list[int] = []
    pending = 0
    for i in range(calls):
        pending += 1
        if i == calls - 1 or ((i + 1) > warmup and (i + 1) % order == 0):
            groups.append(pending)
            pending = 0
    return groups


def _step_kwargs(scheduler: Any, generator: torch.Generator) -> dict[str, Any]:
    # As the pipelines' prepare_extra_step_kwargs: eta 0 where DDIM-like, the
    # request's generator where the scheduler draws noise.
    parameters = inspect.signature(scheduler.step).parameters
    kwargs: dict[str, Any] = {}
    if "eta" in parameters:
        kwargs["eta"] = 0.0
    if "generator" in parameters:
        kwargs["generator"] = generator
    return kwargs


def _new_scheduler(pipe: Any) -> Any:
    # One scheduler per request: a pipeline's own scheduler keeps a step index.
    return type(pipe.scheduler).from_config(pipe.scheduler.config)


def randn(shape: tuple[int, ...], generator: torch.Generator, device: Any, dtype: Any) -> Any:
    """Draw ``shape`` normal numbers from ``generator``, as the pipelines draw their noise."""
    from diffusers.utils.torch_utils import randn_tensor

    return randn_tensor(shape, generator=generator, device=device, dtype=dtype)


def retrieve_timesteps(scheduler: Any, steps: int, device: Any, **kwargs: Any) -> torch.Tensor:
    """Set ``scheduler``'s timesteps as the pipelines' ``retrieve_timesteps``; return them."""
    from diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion import (
        retrieve_timesteps as retrieve,
    )

    timesteps, _ = retrieve(scheduler, steps, device, **kwargs)
    result: torch.Tensor = timesteps
    return result


def per_image(tensor: torch.Tensor, count: int) -> torch.Tensor:
    """One image's text rows for ``count`` images: repeated, as ``num_images_per_prompt``
    repeats a prompt's one encoding (a copy); one image: ``tensor`` itself."""
    if count == 1:
        return tensor
    return tensor.repeat(count, *(1,) * (tensor.dim() - 1))


def joined(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Concatenate along the batch; a batch of one is the common case: no copy for it."""
    return tensors[0] if len(tensors) == 1 else torch.cat(list(tensors))


class Family(ABC):
    """The family-specific half of a ``DiffusersRunner``, and the family's facts.

    The facts are class attributes without a default here: every family declares
    each one (a subclass inherits its parent's), and tests/runners/test_families.py
    holds every registered family to that and to its tiny pipeline.
    """

    #: ``runner.family``, and the kind of its tiny pipeline (``tiny_pipeline(name)``).
    name: ClassVar[str]
    #: The family's name in a message (``"LTX-Video"``).
    title: ClassVar[str]
    #: The diffusers pipeline classes it drives, by name (the exact classes).
    pipelines: ClassVar[tuple[str, ...]]
    #: The pipeline attributes that hold its denoisers, in order (Wan 2.2 has two
    #: experts; an attribute may be ``None``).
    denoisers: ClassVar[tuple[str, ...]]
    #: The attributes of a denoiser that hold its blocks, in call order: a cancel point
    #: before each block (L71), and the lists the step cache wraps (L80).
    block_lists: ClassVar[tuple[str, ...]]
    #: How each of its block classes is called, by class name, for the step cache (L80);
    #: empty: its blocks are not cached (a UNet's pass skip connections).
    block_specs: ClassVar[Mapping[str, BlockSpec]]
    #: A video family's frames per second, as its model cards export them; ``None`` for
    #: images.
    fps: ClassVar[float | None]
    #: The ``__call__`` parameter the request's ``guidance_scale`` is (its default is the
    #: server's); ``None``: the pipeline takes no guidance.
    guidance_parameter: ClassVar[str | None]
    #: Whether its denoisers carry diffusers' context-parallel plan, which sequence
    #: parallel (``ulysses``, ``ring``) runs on (L48).
    context_parallel: ClassVar[bool]
    #: The sequence-parallel layouts whose split output is known wrong although the plan
    #: is there, each with why: refused, never served wrong (L48).
    wrong_splits: ClassVar[Mapping[str, str]]
    #: Whether its pipelines take adapters (LoRA, L85) where diffusers loads them.
    takes_adapters: ClassVar[bool]

    #: Whether ``negative_prompt`` is honoured.
    negative_prompt = True
    #: The keys of ``GenerationRequest.extra`` the family reads.
    extra_keys: frozenset[str] = frozenset()
    #: Whether ``image``, ``mask`` and ``strength`` are honoured (L75).
    edits = False
    #: Whether it makes a video from ``image`` (L69): the image is needed, no mask.
    image_to_video = False
    #: The stochastic samplers it takes (L100, ``_sde``): ``"sde"`` (flow matching),
    #: ``"ddim"`` (the UNets); the runner offers those its pipeline's scheduler runs.
    samplers: frozenset[str] = frozenset()
    #: How a decode splits into chunks (L72); the runner sets its own.
    chunks = DecodeChunks()

    def __init__(self, pipe: Any) -> None:
        self.pipe = pipe
        self.device = pipe.device

    def _encoded(self, text: str, encode: Callable[[str], Encoded]) -> dict[str, torch.Tensor]:
        """``encode(text)``: one text's encoding for one image, through the runner's prompt
        cache (L94, ``_prompts``), keyed with this family's encoding too. The tensors are
        the caller's own (computed, or copies of the cache's). The encode holds the
        pipeline's tokenizers (``tokenizers_held``: runners over one pipeline, L42)."""
        parameters = (
            type(self).__name__,
            getattr(encode, "__qualname__", None),
            getattr(self, "max_sequence_length", None),
        )

        def held(text: str) -> Encoded:
            with tokenizers_held(self.pipe):
                return encode(text)

        return encoded(parameters, text, held)

    def _text_cond(
        self,
        request: GenerationRequest,
        cfg: bool,
        encode: Callable[[str], Encoded],
        names: Mapping[str, str],
    ) -> dict[str, torch.Tensor]:
        """The request's text conditioning: each tensor of ``encode``'s (``names``' keys)
        as the ``cond`` entry its value names, one row per image, and with guidance the
        negative prompt's rows first.

        The pipelines encode a negative prompt (``""`` for none) with the computation
        of a prompt, so each text goes through the prompt cache on its own (L94).
        """
        count = request.num_images
        text = self._encoded(request.prompt, encode)
        rows = {key: per_image(text[name], count) for name, key in names.items()}
        if cfg:
            negative = self._encoded(request.negative_prompt or "", encode)
            rows = {
                key: guidance_rows(cfg, per_image(negative[name], count), rows[key])
                for name, key in names.items()
            }
        return rows

    def _vae_decode(
        self, state: RequestState, rows: int, decode: Callable[[slice], torch.Tensor]
    ) -> torch.Tensor:
        """``decode`` over the request's ``rows`` in chunks (L72): see ``_chunks``."""
        request = state.request
        return self.chunks.decode(
            self.pipe.vae,
            decode,
            rows=rows,
            pixels=request.height * request.width,
            frames=request.num_frames,
        )

    @property
    @abstractmethod
    def size_multiple(self) -> int:
        """Height and width must be multiples of this."""

    @property
    def fixed_size(self) -> tuple[int, int] | None:
        """The only image size the model makes, if it has one."""
        return None

    @property
    def frames(self) -> tuple[int, int] | None:
        """A video family's frame rule (``num_frames % a == b``); ``None`` for images (L70)."""
        return None

    def prepare(self, request: GenerationRequest, request_id: str) -> RequestState:
        """Build a request's state as the pipeline's ``__call__`` would."""
        seed = request.seed if request.seed is not None else int(torch.seed() % 2**63)
        generator = torch.Generator(device="cpu").manual_seed(seed)
        sampler = request.sampler
        own = None if sampler is None else sampler_scheduler(self.pipe, sampler)
        scheduler = _new_scheduler(self.pipe) if own is None else own
        state = self._prepare(request, request_id, generator, scheduler)
        order = int(getattr(scheduler, "order", 1))
        steps = request.denoise_steps  # the engine counts these (L75)
        state.groups = step_groups(len(state.timesteps), steps, order)
        if len(state.groups) != steps:
            raise ValueError(
                f"{type(scheduler).__name__} makes {len(state.timesteps)} model calls that do"
                f" not split into {steps} steps"
            )
        state.step_kwargs = _step_kwargs(scheduler, generator)
        if sampler is not None:
            assert state.latents is not None
            state.sampler = SamplerState.create(
                sampler,
                scheduler,
                state.timesteps,
                state.latents,
                returns=request.return_trajectory,
            )
        return state

    @abstractmethod
    def _prepare(
        self,
        request: GenerationRequest,
        request_id: str,
        generator: torch.Generator,
        scheduler: Any,
    ) -> RequestState: ...

    def scale_input(self, state: RequestState, rows: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """The scheduler's input scaling (Euler-like schedulers scale by sigma)."""
        return rows

    def join_cond(self, states: Sequence[RequestState]) -> dict[str, torch.Tensor]:
        """The per-row inputs of one model call: every state's ``cond``, concatenated."""
        return {key: joined([state.cond[key] for state in states]) for key in states[0].cond}

    @abstractmethod
    def denoise(
        self, rows: torch.Tensor, t: torch.Tensor, cond: dict[str, torch.Tensor], shared: Any
    ) -> torch.Tensor:
        """One model call over a batch of rows; ``t`` holds one timestep per row."""

    def scheduler_step(
        self, state: RequestState, prediction: torch.Tensor, t: torch.Tensor
    ) -> torch.Tensor:
        """The request's latents after its scheduler's step with ``prediction`` at ``t``
        (its sampler's, where it has one: L100)."""
        assert state.latents is not None
        if state.sampler is not None:
            return state.sampler.step(state.latents, prediction, state.position, state.generator)
        stepped: torch.Tensor = state.scheduler.step(
            prediction, t, state.latents, **state.step_kwargs, return_dict=False
        )[0]
        return stepped

    def guide(self, state: RequestState, prediction: torch.Tensor) -> torch.Tensor:
        """Combine a guided state's ``[uncond, cond]`` predictions (classifier-free guidance)."""
        uncond, text = prediction.chunk(2)
        guided: torch.Tensor = uncond + state.request.guidance_scale * (text - uncond)
        return guided

    @abstractmethod
    def decode(self, state: RequestState) -> torch.Tensor:
        """The request's final images ``[N, C, H, W]`` in [0, 1], on the model's device."""

    def preview_latents(self, state: RequestState) -> torch.Tensor:
        """The current latents as ``[N, C, h, w]``, for the preview projection."""
        assert state.latents is not None
        return state.latents


def guidance_rows(cfg: bool, negative: torch.Tensor, positive: torch.Tensor) -> torch.Tensor:
    """The rows of a conditioning: ``[negative..., positive...]`` with guidance, else positive."""
    return torch.cat([negative, positive]) if cfg else positive


def unit_number(request: GenerationRequest, key: str, default: float) -> float:
    """``extra[key]``: a number in [0, 1], ``default`` when absent.

    Raises:
        ValueError: it is not such a number.
    """
    value = request.extra.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{key}: must be a number, got {type(value).__name__}")
    if not (math.isfinite(value) and 0 <= value <= 1):
        raise ValueError(f"{key}: must be in [0, 1], got {value!r}")
    return float(value)


def calculate_shift(config: Any, image_seq_len: int, max_shift: float) -> float:
    """The flow-matching shift ``mu`` for ``image_seq_len`` tokens, from a scheduler's config."""
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift as shift

    mu: float = shift(
        image_seq_len,
        config.get("base_image_seq_len", 256),
        config.get("max_image_seq_len", 4096),
        config.get("base_shift", 0.5),
        config.get("max_shift", max_shift),
    )
    return mu


def wan_denormalized(vae: Any, latents: torch.Tensor) -> torch.Tensor:
    """``latents`` ``[N, C, F, h, w]`` as a Wan VAE decodes them (Wan's; Qwen-Image's, one frame).

    In the VAE's dtype, de-normalised by its ``latents_mean`` and ``latents_std``, as
    both pipelines' ``__call__`` do before the decode.
    """
    latents = latents.to(vae.dtype)
    view = (1, vae.config.z_dim, 1, 1, 1)
    mean = torch.tensor(vae.config.latents_mean).view(view).to(latents.device, latents.dtype)
    std = 1.0 / torch.tensor(vae.config.latents_std).view(view).to(latents.device, latents.dtype)
    denormalized: torch.Tensor = latents / std + mean
    return denormalized
