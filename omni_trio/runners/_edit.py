"""Image-to-image and inpainting for the Stable Diffusion families, as diffusers does them.

What ``StableDiffusionImg2ImgPipeline``, ``StableDiffusionInpaintPipeline`` and
their SDXL counterparts add to text-to-image, for a request with ``image`` (and
``mask``), done the same way so that a seed gives the same image:

- the schedule keeps its last ``request.denoise_steps`` steps (``get_timesteps``);
- the image is encoded by the VAE (sampling its latent distribution with the
  request's generator) and noised to the first kept timestep; inpainting at
  strength 1 starts from pure noise instead;
- inpainting with a four-channel UNet (the legacy mode, the only one here): after
  every model call the unmasked area is put back to the image's latents, noised to
  the next timestep. The pipelines also encode the masked image, which only a
  nine-channel UNet reads; its sampling still draws from the generator, so the same
  draw is made here (same shape, device and dtype: the same numbers consumed)
  instead of a VAE encode whose result would be thrown away.

Inpainting keeps three tensors per request in ``RequestState.edit`` (the image's
latents, the noise, the latent-sized mask), which suspension moves with the rest.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from .._request import GenerationRequest
from ._chunks import vae_lock
from ._family import RequestState, randn

__all__ = ["EditLatents", "edit_latents", "keep_unmasked"]


class _Draw(NamedTuple):
    """What one sampling of a VAE's latent distribution draws from a generator."""

    shape: tuple[int, ...]
    device: torch.device
    dtype: torch.dtype


class EditLatents(NamedTuple):
    """An edit's start: its kept timesteps, initial latents and ``RequestState.edit``."""

    timesteps: torch.Tensor
    latents: torch.Tensor
    edit: dict[str, torch.Tensor]


def _sample(vae: Any, image: torch.Tensor, generator: torch.Generator) -> tuple[Any, _Draw | None]:
    """``retrieve_latents(vae.encode(image), generator)``, and the draw its sampling made."""
    from diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion_img2img import (
        retrieve_latents,
    )

    with vae_lock(vae):  # no decode's tiling flag seen (L72)
        encoded = vae.encode(image)
    dist = getattr(encoded, "latent_dist", None)
    draw = None
    if dist is not None:
        draw = _Draw(tuple(dist.mean.shape), dist.parameters.device, dist.parameters.dtype)
    return retrieve_latents(encoded, generator=generator), draw


def _encode(
    pipe: Any,
    image: torch.Tensor,
    generator: torch.Generator,
    dtype: torch.dtype,
    *,
    xl: bool,
    shift: bool,
) -> tuple[torch.Tensor, _Draw | None]:
    """The image's scaled latents, as the pipelines' ``prepare_latents`` encode them.

    ``xl``: SDXL's pipelines, which encode in float32 where the VAE's config says
    it overflows in float16 (``force_upcast``) and cast the latents back; ``shift``: SDXL
    img2img's use of the VAE's ``latents_mean``/``latents_std`` where it has them.
    The VAE's dtype is changed and put back under its ``vae_lock``, which the
    family's decode holds for the same change (the two run in different engine
    threads).
    """
    vae = pipe.vae
    image = image.to(device=pipe.device, dtype=dtype)
    if xl and vae.config.force_upcast:
        original = vae.dtype
        if original == torch.float32:  # nothing to change (and nothing to log about it)
            latents, draw = _sample(vae, image.float(), generator)
        else:
            with vae_lock(vae):
                vae.to(dtype=torch.float32)
                try:
                    latents, draw = _sample(vae, image.float(), generator)
                finally:
                    # Back to its own dtype: the pipelines' cast to the prompt's dtype
                    # would change the caller's VAE for good where the two differ.
                    vae.to(original)
        latents = latents.to(dtype)
    else:
        latents, draw = _sample(vae, image, generator)
        if xl:
            latents = latents.to(dtype)
    mean = getattr(vae.config, "latents_mean", None) if shift else None
    std = getattr(vae.config, "latents_std", None) if shift else None
    if mean is not None and std is not None:
        view = (1, len(mean), 1, 1)
        mean_t = torch.tensor(mean).view(view).to(device=latents.device, dtype=dtype)
        std_t = torch.tensor(std).view(view).to(device=latents.device, dtype=dtype)
        scaled: torch.Tensor = (latents - mean_t) * vae.config.scaling_factor / std_t
    else:
        scaled = vae.config.scaling_factor * latents
    return scaled, draw


def _kept_timesteps(scheduler: Any, request: GenerationRequest) -> torch.Tensor:
    """As the pipelines' ``get_timesteps``: the last ``denoise_steps`` of the schedule."""
    order = int(scheduler.order)
    start = request.num_steps - request.denoise_steps
    timesteps: torch.Tensor = scheduler.timesteps[start * order :]
    if hasattr(scheduler, "set_begin_index"):
        scheduler.set_begin_index(start * order)
    return timesteps


def edit_latents(
    pipe: Any,
    request: GenerationRequest,
    generator: torch.Generator,
    scheduler: Any,
    dtype: torch.dtype,
    *,
    xl: bool,
    mask_processor: Any,
) -> EditLatents:
    """Start an image-to-image or inpainting request, after ``retrieve_timesteps``.

    Args:
        pipe: the text-to-image pipeline whose components the edit pipelines share.
        request: a request with ``image`` (and maybe ``mask``).
        generator: the request's generator, at the state the pipelines have here.
        scheduler: the request's scheduler, its timesteps set.
        dtype: the prompt embeddings' dtype, which the pipelines use for latents.
        xl: SDXL's pipelines (see ``_encode``).
        mask_processor: the inpainting pipelines' ``mask_processor``.
    """
    assert isinstance(request.image, torch.Tensor)
    count = request.num_images
    height, width = request.height, request.width
    device = pipe.device
    timesteps = _kept_timesteps(scheduler, request)
    first = timesteps[:1].repeat(count)
    pixels = pipe.image_processor.preprocess(request.image[None], height=height, width=width)
    if request.mask is None:
        # StableDiffusion(XL)Img2ImgPipeline.prepare_latents.
        latents, _ = _encode(pipe, pixels, generator, dtype, xl=xl, shift=xl)
        latents = torch.cat([latents] * count)
        noise = randn(tuple(latents.shape), generator, device, dtype)
        return EditLatents(timesteps, scheduler.add_noise(latents, noise, first), {})
    # StableDiffusion(XL)InpaintPipeline: prepare_latents, then prepare_mask_latents.
    assert isinstance(request.mask, torch.Tensor)
    pixels = pixels.to(dtype=torch.float32)
    image_latents, draw = _encode(pipe, pixels, generator, dtype, xl=xl, shift=False)
    image_latents = image_latents.repeat(count, 1, 1, 1)
    factor = int(pipe.vae_scale_factor)
    shape = (count, int(pipe.vae.config.latent_channels), height // factor, width // factor)
    noise = randn(shape, generator, device, dtype)
    if request.strength == 1.0:
        latents = noise * scheduler.init_noise_sigma
    else:
        latents = scheduler.add_noise(image_latents, noise, first)
    mask = mask_processor.preprocess(request.mask[None], height=height, width=width)
    if draw is not None:
        randn(draw.shape, generator, draw.device, draw.dtype)  # the masked image's sampling
    mask = torch.nn.functional.interpolate(mask, size=(height // factor, width // factor))
    mask = mask.to(device=device, dtype=dtype).repeat(count, 1, 1, 1)
    return EditLatents(
        timesteps, latents, {"image_latents": image_latents, "noise": noise, "mask": mask}
    )


def keep_unmasked(state: RequestState) -> None:
    """After a model call: the unmasked area back to the image, noised to the next timestep.

    As the inpainting pipelines' loop with a four-channel UNet; ``state.position``
    is the index of the timestep just stepped.
    """
    assert state.latents is not None
    edit = state.edit
    proper = edit["image_latents"]
    index = state.position
    if index < len(state.timesteps) - 1:
        upcoming = torch.tensor([state.timesteps[index + 1]])
        proper = state.scheduler.add_noise(proper, edit["noise"], upcoming)
    mask = edit["mask"]
    state.latents = (1 - mask) * proper + mask * state.latents
