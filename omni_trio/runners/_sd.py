"""The UNet families of ``DiffusersRunner``: Stable Diffusion, SDXL, and unconditional DDPM/DDIM.

SDXL is SD with a second text encoder: it overrides what differs (the pooled
embeddings and size conditioning, its begin index, guidance rescale, its VAE's
upcast and latent statistics) and inherits the rest, edits included (``_edit``).
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

import torch

from .._request import GenerationRequest
from ._chunks import vae_lock
from ._edit import EditLatents, edit_latents
from ._family import (
    Family,
    RequestState,
    guidance_rows,
    randn,
    retrieve_timesteps,
    unit_number,
)
from ._prompts import Encoded

__all__ = ["StableDiffusion", "StableDiffusionXL", "Unconditional"]

#: A UNet's blocks, in call order (a cancel point before each; the step cache wraps
#: none: they pass skip connections from the down to the up blocks).
_UNET_BLOCKS = ("down_blocks", "mid_block", "up_blocks")


class StableDiffusion(Family):
    """``StableDiffusionPipeline``: UNet2DConditionModel with classifier-free guidance.

    With ``image`` (and ``mask``), as ``StableDiffusionImg2ImgPipeline`` (and
    ``StableDiffusionInpaintPipeline``, legacy four-channel mode) built from the
    same components (see ``_edit``).
    """

    name = "sd"
    title = "Stable Diffusion"
    pipelines = ("StableDiffusionPipeline",)
    denoisers = ("unet",)
    block_lists = _UNET_BLOCKS
    block_specs = MappingProxyType({})
    fps = None
    guidance_parameter = "guidance_scale"
    context_parallel = False
    wrong_splits = MappingProxyType({})
    takes_adapters = True
    edits = True
    samplers = frozenset({"ddim"})
    #: SDXL's edit pipelines encode images their own way (see ``_edit._encode``).
    _xl = False

    def __init__(self, pipe: Any) -> None:
        super().__init__(pipe)
        self._mask_processor: Any = None

    def _edit_latents(
        self,
        request: GenerationRequest,
        generator: torch.Generator,
        scheduler: Any,
        dtype: torch.dtype,
    ) -> EditLatents:
        if self._mask_processor is None:
            from diffusers.image_processor import VaeImageProcessor

            # The inpainting pipelines' own mask processor.
            self._mask_processor = VaeImageProcessor(
                vae_scale_factor=self.pipe.vae_scale_factor,
                do_normalize=False,
                do_binarize=True,
                do_convert_grayscale=True,
            )
        return edit_latents(
            self.pipe,
            request,
            generator,
            scheduler,
            dtype,
            xl=self._xl,
            mask_processor=self._mask_processor,
        )

    @property
    def size_multiple(self) -> int:
        return int(self.pipe.vae_scale_factor)

    def _cfg(self, request: GenerationRequest) -> bool:
        # As the pipelines' do_classifier_free_guidance: never for a guidance-embedding UNet.
        return request.guidance_scale > 1 and self.pipe.unet.config.time_cond_proj_dim is None

    def _text(self, text: str) -> Encoded:
        """One text's embeddings for one image, as ``encode_prompt`` makes a prompt's.

        Its negative prompt's are the same computation (``""`` for none): each is
        encoded, and kept by the prompt cache (L94), on its own.
        """
        embeds, _ = self.pipe.encode_prompt(text, self.device, 1, False)
        return {"embeds": embeds}

    def _encode(
        self, request: GenerationRequest, cfg: bool
    ) -> tuple[dict[str, torch.Tensor], torch.dtype]:
        """The prompt's per-row UNet conditioning, and its embeddings' dtype (the latents')."""
        cond = self._text_cond(request, cfg, self._text, {"embeds": "encoder_hidden_states"})
        return cond, cond["encoder_hidden_states"].dtype

    def _latents(
        self,
        request: GenerationRequest,
        generator: torch.Generator,
        scheduler: Any,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        factor = self.size_multiple
        shape = (
            request.num_images,
            self.pipe.unet.config.in_channels,
            request.height // factor,
            request.width // factor,
        )
        latents: torch.Tensor = randn(shape, generator, self.device, dtype)
        latents = latents * scheduler.init_noise_sigma
        return latents

    def _add_timestep_cond(
        self, cond: dict[str, torch.Tensor], request: GenerationRequest, dtype: torch.dtype
    ) -> None:
        # LCM-style UNets take the guidance scale as an embedding instead of CFG.
        dim = self.pipe.unet.config.time_cond_proj_dim
        if dim is not None:
            scale = torch.tensor(request.guidance_scale - 1).repeat(request.num_images)
            cond["timestep_cond"] = self.pipe.get_guidance_scale_embedding(
                scale, embedding_dim=dim
            ).to(device=self.device, dtype=dtype)

    def _prepare(
        self,
        request: GenerationRequest,
        request_id: str,
        generator: torch.Generator,
        scheduler: Any,
    ) -> RequestState:
        cfg = self._cfg(request)
        cond, dtype = self._encode(request, cfg)
        timesteps = retrieve_timesteps(scheduler, request.num_steps, self.device)
        edit: dict[str, torch.Tensor] = {}
        if request.image is None:
            latents = self._latents(request, generator, scheduler, dtype)
        else:
            timesteps, latents, edit = self._edit_latents(request, generator, scheduler, dtype)
        self._add_timestep_cond(cond, request, latents.dtype)  # as the pipelines: latents' dtype
        state = RequestState(
            request_id, request, generator, scheduler, timesteps, [], latents, cfg, cond
        )
        state.edit = edit
        return state

    def scale_input(self, state: RequestState, rows: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        scaled: torch.Tensor = state.scheduler.scale_model_input(rows, t)
        return scaled

    def _added_cond(self, cond: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
        """The UNet's ``added_cond_kwargs`` (none for SD 1.x/2.x)."""
        return None

    def denoise(
        self, rows: torch.Tensor, t: torch.Tensor, cond: dict[str, torch.Tensor], shared: Any
    ) -> torch.Tensor:
        out: torch.Tensor = self.pipe.unet(
            rows,
            t,
            encoder_hidden_states=cond["encoder_hidden_states"],
            timestep_cond=cond.get("timestep_cond"),
            added_cond_kwargs=self._added_cond(cond),
            return_dict=False,
        )[0]
        return out

    def decode(self, state: RequestState) -> torch.Tensor:
        assert state.latents is not None
        vae = self.pipe.vae
        latents = state.latents / vae.config.scaling_factor
        image = self._vae_decode(
            state,
            latents.shape[0],
            lambda rows: vae.decode(latents[rows], return_dict=False, generator=state.generator)[0],
        )
        images: torch.Tensor = self.pipe.image_processor.postprocess(image, output_type="pt")
        return images


def _guidance_rescale(request: GenerationRequest) -> float:
    """``extra["guidance_rescale"]``: a number in [0, 1], 0 when absent.

    Raises:
        ValueError: it is not such a number.
    """
    return unit_number(request, "guidance_rescale", 0.0)


class StableDiffusionXL(StableDiffusion):
    """``StableDiffusionXLPipeline``: two CLIP encoders, pooled embeddings, size conditioning.

    ``GenerationRequest.extra["guidance_rescale"]`` is the pipeline's
    ``guidance_rescale`` (0 by default: off).
    """

    name = "sdxl"
    title = "Stable Diffusion XL"
    pipelines = ("StableDiffusionXLPipeline",)
    extra_keys = frozenset({"guidance_rescale"})
    _xl = True

    def _text(self, text: str) -> Encoded:
        """One text's embeddings and pooled embeddings for one image, as ``encode_prompt``
        makes a prompt's (and a negative prompt's; none guides against zeros where
        ``force_zeros_for_empty_prompt`` says, as there)."""
        embeds, _, pooled, _ = self.pipe.encode_prompt(
            prompt=text,
            device=self.device,
            num_images_per_prompt=1,
            do_classifier_free_guidance=False,
        )
        return {"embeds": embeds, "pooled": pooled}

    def _encode(
        self, request: GenerationRequest, cfg: bool
    ) -> tuple[dict[str, torch.Tensor], torch.dtype]:
        """SD's conditioning, plus the pooled embeddings and the size conditioning."""
        pipe = self.pipe
        _guidance_rescale(request)  # refused before any model work
        # Without a negative prompt, guidance against zeros where the pipeline says so.
        zeros = request.negative_prompt is None and pipe.config.force_zeros_for_empty_prompt
        names = {"embeds": "encoder_hidden_states", "pooled": "text_embeds"}
        cond = self._text_cond(request, cfg and not zeros, self._text, names)
        positive = cond["encoder_hidden_states"]
        if cfg and zeros:
            cond = {key: guidance_rows(cfg, torch.zeros_like(t), t) for key, t in cond.items()}
        if pipe.text_encoder_2 is None:
            projection_dim = int(cond["text_embeds"].shape[-1])
        else:
            projection_dim = pipe.text_encoder_2.config.projection_dim
        size = (request.height, request.width)
        # Original and target size both the requested one, no crop: the __call__ defaults.
        # The edit pipelines' time ids are these too: no aesthetic score (their
        # requires_aesthetics_score is off), sizes from the image, which is the
        # request's size.
        time_ids = pipe._get_add_time_ids(
            size, (0, 0), size, dtype=positive.dtype, text_encoder_projection_dim=projection_dim
        ).to(self.device)
        cond["time_ids"] = time_ids.repeat(request.num_images * (2 if cfg else 1), 1)
        return cond, positive.dtype

    def _latents(
        self,
        request: GenerationRequest,
        generator: torch.Generator,
        scheduler: Any,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        latents = super()._latents(request, generator, scheduler, dtype)
        if hasattr(scheduler, "set_begin_index"):
            # As __call__ (text to image only: an edit's begin index is where its steps start).
            scheduler.set_begin_index(0)
        return latents

    def _added_cond(self, cond: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"text_embeds": cond["text_embeds"], "time_ids": cond["time_ids"]}

    def guide(self, state: RequestState, prediction: torch.Tensor) -> torch.Tensor:
        guided = super().guide(state, prediction)
        rescale = _guidance_rescale(state.request)
        if rescale > 0:
            from diffusers.pipelines.stable_diffusion_xl.pipeline_stable_diffusion_xl import (
                rescale_noise_cfg,
            )

            unannotated: Any = rescale_noise_cfg
            guided = unannotated(guided, prediction.chunk(2)[1], guidance_rescale=rescale)
        return guided

    def decode(self, state: RequestState) -> torch.Tensor:
        assert state.latents is not None
        vae = self.pipe.vae
        # As __call__: a float16 VAE that overflows there decodes in float32, and is
        # put back afterwards (the UNet, which the steps use, is not touched).
        if vae.dtype == torch.float16 and vae.config.force_upcast:
            # An edit's prepare changes the VAE's dtype too, from the worker thread.
            with vae_lock(vae):
                return self._decode(state, state.latents.to(torch.float32), upcast=True)
        return self._decode(state, state.latents, upcast=False)

    def _decode(self, state: RequestState, latents: torch.Tensor, *, upcast: bool) -> torch.Tensor:
        pipe = self.pipe
        vae = pipe.vae
        if upcast:
            vae.to(dtype=torch.float32)
        try:
            mean = getattr(vae.config, "latents_mean", None)
            std = getattr(vae.config, "latents_std", None)
            if mean is not None and std is not None:
                view = (1, len(mean), 1, 1)
                mean_t = torch.tensor(mean).view(view).to(latents.device, latents.dtype)
                std_t = torch.tensor(std).view(view).to(latents.device, latents.dtype)
                latents = latents * std_t / vae.config.scaling_factor + mean_t
            else:
                latents = latents / vae.config.scaling_factor
            scaled = latents
            image = self._vae_decode(
                state,
                scaled.shape[0],
                lambda rows: vae.decode(scaled[rows], return_dict=False)[0],
            )
        finally:
            # Also when the decode is left at a cancel point (L72).
            if upcast:
                vae.to(dtype=torch.float16)
        if pipe.watermark is not None:
            image = pipe.watermark.apply_watermark(image)
        images: torch.Tensor = pipe.image_processor.postprocess(image, output_type="pt")
        return images


class Unconditional(Family):
    """``DDPMPipeline`` / ``DDIMPipeline``: a UNet2DModel in pixel space, no prompt."""

    name = "unet"
    title = "an unconditional UNet"
    pipelines = ("DDPMPipeline", "DDIMPipeline")
    denoisers = ("unet",)
    block_lists = _UNET_BLOCKS
    block_specs = MappingProxyType({})
    fps = None
    guidance_parameter = None
    context_parallel = False
    wrong_splits = MappingProxyType({})
    takes_adapters = False
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
        latents = randn(shape, generator, self.device, unet.dtype)
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
