"""What differs between diffusers model families, behind one small interface.

A family knows how its pipeline encodes a prompt, prepares the initial latents
and the per-request scheduler (exactly as the pipeline's own ``__call__`` does, so
a seed gives the same image), calls its denoiser on a batch of rows, and decodes.
The step loop itself, shared by all families, lives in ``_diffusers.py``.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .._request import GenerationRequest

__all__ = ["Family", "RequestState", "family_for", "is_supported", "supported_pipelines"]


@dataclass(eq=False)
class RequestState:
    """One request inside a ``DiffusersRunner``: its latents, scheduler and conditioning.

    ``cond`` holds per-row model inputs (with classifier-free guidance the rows
    are ``[uncond..., cond...]``); ``shared`` holds inputs that are the same for
    every request of one batch (Flux's position ids).
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
    shared: dict[str, torch.Tensor] = field(default_factory=dict)
    step_kwargs: dict[str, Any] = field(default_factory=dict)
    position: int = 0
    steps_done: int = 0
    ready: Any = None
    #: Where the tensors that a suspension moved to host memory came from.
    parked_from: dict[int, torch.device] | None = None


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


def _randn(shape: tuple[int, ...], generator: torch.Generator, device: Any, dtype: Any) -> Any:
    from diffusers.utils.torch_utils import randn_tensor

    return randn_tensor(shape, generator=generator, device=device, dtype=dtype)


def _retrieve_timesteps(scheduler: Any, steps: int, device: Any, **kwargs: Any) -> torch.Tensor:
    from diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion import (
        retrieve_timesteps,
    )

    timesteps, _ = retrieve_timesteps(scheduler, steps, device, **kwargs)
    result: torch.Tensor = timesteps
    return result


class Family(ABC):
    """The family-specific half of a ``DiffusersRunner``."""

    name: str
    #: Whether ``negative_prompt`` is honoured.
    negative_prompt = True

    def __init__(self, pipe: Any) -> None:
        self.pipe = pipe
        self.device = pipe.device

    @property
    @abstractmethod
    def size_multiple(self) -> int:
        """Height and width must be multiples of this."""

    @property
    def fixed_size(self) -> tuple[int, int] | None:
        """The only image size the model makes, if it has one."""
        return None

    def prepare(self, request: GenerationRequest, request_id: str) -> RequestState:
        """Build a request's state as the pipeline's ``__call__`` would."""
        seed = request.seed if request.seed is not None else int(torch.seed() % 2**63)
        generator = torch.Generator(device="cpu").manual_seed(seed)
        scheduler = _new_scheduler(self.pipe)
        state = self._prepare(request, request_id, generator, scheduler)
        order = int(getattr(scheduler, "order", 1))
        state.groups = step_groups(len(state.timesteps), request.num_steps, order)
        if len(state.groups) != request.num_steps:
            raise ValueError(
                f"{type(scheduler).__name__} makes {len(state.timesteps)} model calls that do"
                f" not split into {request.num_steps} steps"
            )
        state.step_kwargs = _step_kwargs(scheduler, generator)
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

    @abstractmethod
    def denoise(
        self, rows: torch.Tensor, t: torch.Tensor, cond: dict[str, torch.Tensor], shared: Any
    ) -> torch.Tensor:
        """One model call over a batch of rows; ``t`` holds one timestep per row."""

    @abstractmethod
    def decode(self, state: RequestState) -> torch.Tensor:
        """The request's final images ``[N, C, H, W]`` in [0, 1], on the model's device."""

    def preview_latents(self, state: RequestState) -> torch.Tensor:
        """The current latents as ``[N, C, h, w]``, for the preview projection."""
        assert state.latents is not None
        return state.latents


def _guidance_rows(cfg: bool, negative: torch.Tensor, positive: torch.Tensor) -> torch.Tensor:
    return torch.cat([negative, positive]) if cfg else positive


class StableDiffusion(Family):
    """``StableDiffusionPipeline``: UNet2DConditionModel with classifier-free guidance."""

    name = "sd"

    @property
    def size_multiple(self) -> int:
        return int(self.pipe.vae_scale_factor)

    def _prepare(
        self,
        request: GenerationRequest,
        request_id: str,
        generator: torch.Generator,
        scheduler: Any,
    ) -> RequestState:
        pipe = self.pipe
        unet_config = pipe.unet.config
        cfg = request.guidance_scale > 1 and unet_config.time_cond_proj_dim is None
        positive, negative = pipe.encode_prompt(
            request.prompt,
            self.device,
            request.num_images,
            cfg,
            request.negative_prompt,
        )
        cond = {"encoder_hidden_states": _guidance_rows(cfg, negative, positive)}
        if unet_config.time_cond_proj_dim is not None:
            scale = torch.tensor(request.guidance_scale - 1).repeat(request.num_images)
            cond["timestep_cond"] = pipe.get_guidance_scale_embedding(
                scale, embedding_dim=unet_config.time_cond_proj_dim
            ).to(device=self.device, dtype=positive.dtype)
        timesteps = _retrieve_timesteps(scheduler, request.num_steps, self.device)
        factor = self.size_multiple
        shape = (
            request.num_images,
            unet_config.in_channels,
            request.height // factor,
            request.width // factor,
        )
        latents = _randn(shape, generator, self.device, positive.dtype) * scheduler.init_noise_sigma
        return RequestState(
            request_id, request, generator, scheduler, timesteps, [], latents, cfg, cond
        )

    def scale_input(self, state: RequestState, rows: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        scaled: torch.Tensor = state.scheduler.scale_model_input(rows, t)
        return scaled

    def denoise(
        self, rows: torch.Tensor, t: torch.Tensor, cond: dict[str, torch.Tensor], shared: Any
    ) -> torch.Tensor:
        out: torch.Tensor = self.pipe.unet(
            rows,
            t,
            encoder_hidden_states=cond["encoder_hidden_states"],
            timestep_cond=cond.get("timestep_cond"),
            return_dict=False,
        )[0]
        return out

    def decode(self, state: RequestState) -> torch.Tensor:
        assert state.latents is not None
        vae = self.pipe.vae
        image = vae.decode(
            state.latents / vae.config.scaling_factor, return_dict=False, generator=state.generator
        )[0]
        images: torch.Tensor = self.pipe.image_processor.postprocess(image, output_type="pt")
        return images


def _calculate_shift(config: Any, image_seq_len: int, max_shift: float) -> float:
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    mu: float = calculate_shift(
        image_seq_len,
        config.get("base_image_seq_len", 256),
        config.get("max_image_seq_len", 4096),
        config.get("base_shift", 0.5),
        config.get("max_shift", max_shift),
    )
    return mu


def _vae_decode_shifted(pipe: Any, latents: torch.Tensor) -> torch.Tensor:
    vae = pipe.vae
    latents = (latents / vae.config.scaling_factor) + vae.config.shift_factor
    image = vae.decode(latents, return_dict=False)[0]
    images: torch.Tensor = pipe.image_processor.postprocess(image, output_type="pt")
    return images


class StableDiffusion3(Family):
    """``StableDiffusion3Pipeline``: an MMDiT with classifier-free guidance."""

    name = "sd3"

    @property
    def size_multiple(self) -> int:
        return int(self.pipe.vae_scale_factor * self.pipe.transformer.config.patch_size)

    def _prepare(
        self,
        request: GenerationRequest,
        request_id: str,
        generator: torch.Generator,
        scheduler: Any,
    ) -> RequestState:
        pipe = self.pipe
        cfg = request.guidance_scale > 1
        positive, negative, pooled, negative_pooled = pipe.encode_prompt(
            prompt=request.prompt,
            prompt_2=None,
            prompt_3=None,
            device=self.device,
            num_images_per_prompt=request.num_images,
            do_classifier_free_guidance=cfg,
            negative_prompt=request.negative_prompt,
        )
        cond = {
            "encoder_hidden_states": _guidance_rows(cfg, negative, positive),
            "pooled_projections": _guidance_rows(cfg, negative_pooled, pooled),
        }
        vae_factor = pipe.vae_scale_factor
        shape = (
            request.num_images,
            pipe.transformer.config.in_channels,
            request.height // vae_factor,
            request.width // vae_factor,
        )
        latents = _randn(shape, generator, self.device, positive.dtype)
        kwargs: dict[str, Any] = {}
        if scheduler.config.get("use_dynamic_shifting", None):
            patch = pipe.transformer.config.patch_size
            seq_len = (shape[2] // patch) * (shape[3] // patch)
            kwargs["mu"] = _calculate_shift(scheduler.config, seq_len, 1.16)
        timesteps = _retrieve_timesteps(scheduler, request.num_steps, self.device, **kwargs)
        return RequestState(
            request_id, request, generator, scheduler, timesteps, [], latents, cfg, cond
        )

    def denoise(
        self, rows: torch.Tensor, t: torch.Tensor, cond: dict[str, torch.Tensor], shared: Any
    ) -> torch.Tensor:
        out: torch.Tensor = self.pipe.transformer(
            hidden_states=rows,
            timestep=t,
            encoder_hidden_states=cond["encoder_hidden_states"],
            pooled_projections=cond["pooled_projections"],
            return_dict=False,
        )[0]
        return out

    def decode(self, state: RequestState) -> torch.Tensor:
        assert state.latents is not None
        return _vae_decode_shifted(self.pipe, state.latents)


class Flux(Family):
    """``FluxPipeline``: a guidance-distilled transformer over packed latents."""

    name = "flux"
    # Flux's negative prompt needs true CFG (a second model call per step and a
    # scale the request has no field for): refused rather than ignored.
    negative_prompt = False

    @property
    def size_multiple(self) -> int:
        return int(self.pipe.vae_scale_factor * 2)

    def _prepare(
        self,
        request: GenerationRequest,
        request_id: str,
        generator: torch.Generator,
        scheduler: Any,
    ) -> RequestState:
        pipe = self.pipe
        positive, pooled, text_ids = pipe.encode_prompt(
            prompt=request.prompt,
            prompt_2=None,
            device=self.device,
            num_images_per_prompt=request.num_images,
        )
        latents, image_ids = pipe.prepare_latents(
            request.num_images,
            pipe.transformer.config.in_channels // 4,
            request.height,
            request.width,
            positive.dtype,
            self.device,
            generator,
        )
        steps = request.num_steps
        sigmas: np.ndarray[Any, Any] | None = np.linspace(1.0, 1 / steps, steps)
        if getattr(scheduler.config, "use_flow_sigmas", False):
            sigmas = None
        mu = _calculate_shift(scheduler.config, latents.shape[1], 1.15)
        timesteps = _retrieve_timesteps(scheduler, steps, self.device, sigmas=sigmas, mu=mu)
        scheduler.set_begin_index(0)
        cond = {"encoder_hidden_states": positive, "pooled_projections": pooled}
        if pipe.transformer.config.guidance_embeds:
            cond["guidance"] = torch.full(
                [request.num_images],
                request.guidance_scale,
                device=self.device,
                dtype=torch.float32,
            )
        shared = {"txt_ids": text_ids, "img_ids": image_ids}
        return RequestState(
            request_id, request, generator, scheduler, timesteps, [], latents, False, cond, shared
        )

    def denoise(
        self, rows: torch.Tensor, t: torch.Tensor, cond: dict[str, torch.Tensor], shared: Any
    ) -> torch.Tensor:
        out: torch.Tensor = self.pipe.transformer(
            hidden_states=rows,
            timestep=t.to(rows.dtype) / 1000,
            guidance=cond.get("guidance"),
            pooled_projections=cond["pooled_projections"],
            encoder_hidden_states=cond["encoder_hidden_states"],
            txt_ids=shared["txt_ids"],
            img_ids=shared["img_ids"],
            return_dict=False,
        )[0]
        return out

    def _unpacked(self, state: RequestState) -> torch.Tensor:
        assert state.latents is not None
        request = state.request
        unpacked: torch.Tensor = self.pipe._unpack_latents(
            state.latents, request.height, request.width, self.pipe.vae_scale_factor
        )
        return unpacked

    def decode(self, state: RequestState) -> torch.Tensor:
        return _vae_decode_shifted(self.pipe, self._unpacked(state))

    def preview_latents(self, state: RequestState) -> torch.Tensor:
        return self._unpacked(state)


class Unconditional(Family):
    """``DDPMPipeline`` / ``DDIMPipeline``: a UNet2DModel in pixel space, no prompt."""

    name = "unet"
    negative_prompt = False

    @property
    def size_multiple(self) -> int:
        return 1

    @property
    def fixed_size(self) -> tuple[int, int]:
        size = self.pipe.unet.config.sample_size
        if isinstance(size, int):
            return (size, size)
        return (int(size[0]), int(size[1]))

    def _prepare(
        self,
        request: GenerationRequest,
        request_id: str,
        generator: torch.Generator,
        scheduler: Any,
    ) -> RequestState:
        unet = self.pipe.unet
        shape = (request.num_images, unet.config.in_channels, *self.fixed_size)
        latents = _randn(shape, generator, self.device, unet.dtype)
        scheduler.set_timesteps(request.num_steps)
        return RequestState(
            request_id, request, generator, scheduler, scheduler.timesteps, [], latents, False, {}
        )

    def denoise(
        self, rows: torch.Tensor, t: torch.Tensor, cond: dict[str, torch.Tensor], shared: Any
    ) -> torch.Tensor:
        out: torch.Tensor = self.pipe.unet(rows, t).sample
        return out

    def decode(self, state: RequestState) -> torch.Tensor:
        assert state.latents is not None
        return (state.latents / 2 + 0.5).clamp(0, 1)


_FAMILIES: dict[str, type[Family]] = {
    "StableDiffusionPipeline": StableDiffusion,
    "StableDiffusion3Pipeline": StableDiffusion3,
    "FluxPipeline": Flux,
    "DDPMPipeline": Unconditional,
    "DDIMPipeline": Unconditional,
}


def supported_pipelines() -> list[str]:
    """The pipeline classes ``DiffusersRunner`` drives step by step."""
    return list(_FAMILIES)


def _family_class(pipe: object) -> type[Family] | None:
    import diffusers

    for name, family in _FAMILIES.items():
        # The exact class: a subclass may change the loop in ways we cannot see.
        if type(pipe) is getattr(diffusers, name):
            return family
    return None


def is_supported(pipe: object) -> bool:
    """Whether ``DiffusersRunner`` can drive ``pipe`` step by step."""
    return _family_class(pipe) is not None


def family_for(pipe: object) -> Family:
    """Return the family that drives ``pipe``.

    Raises:
        TypeError: ``pipe`` is not a pipeline of a supported family.
    """
    family = _family_class(pipe)
    if family is not None:
        return family(pipe)
    raise TypeError(
        f"DiffusersRunner drives {', '.join(supported_pipelines())}; got"
        f" {type(pipe).__name__} (use omni_trio.runners.PipelineCallRunner for other pipelines)"
    )
