"""The flow-matching families of ``DiffusersRunner``: SD3, Flux and Qwen-Image.

Transformers over a flow-matching schedule shifted by the image's token count
(SD3's where its scheduler shifts dynamically): SD3 over latent patches with
classifier-free guidance, Flux and Qwen-Image over packed latent tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import MappingProxyType
from typing import Any

import numpy as np
import torch

from .._request import GenerationRequest
from ._family import (
    Family,
    RequestState,
    calculate_shift,
    joined,
    per_image,
    randn,
    retrieve_timesteps,
    wan_denormalized,
)
from ._prompts import Encoded
from ._stepcache import BlockSpec

__all__ = ["Flux", "QwenImage", "StableDiffusion3"]


def _unpacked_latents(pipe: Any, state: RequestState) -> torch.Tensor:
    """A packed-latent family's latents (Flux, Qwen-Image) unpacked by its pipeline."""
    assert state.latents is not None
    request = state.request
    unpacked: torch.Tensor = pipe._unpack_latents(
        state.latents, request.height, request.width, pipe.vae_scale_factor
    )
    return unpacked


def _vae_decode_shifted(family: Family, state: RequestState, latents: torch.Tensor) -> torch.Tensor:
    pipe = family.pipe
    vae = pipe.vae
    latents = (latents / vae.config.scaling_factor) + vae.config.shift_factor
    image = family._vae_decode(
        state, latents.shape[0], lambda rows: vae.decode(latents[rows], return_dict=False)[0]
    )
    images: torch.Tensor = pipe.image_processor.postprocess(image, output_type="pt")
    return images


#: Flux's two block classes: image rotary embeddings are [tokens, dim], shared by every row.
_FLUX_BLOCK = BlockSpec(
    (
        "hidden_states",
        "encoder_hidden_states",
        "temb",
        "image_rotary_emb",
        "joint_attention_kwargs",
    ),
    hidden_out=1,
    encoder_out=0,
    per_row=frozenset({"temb"}),
)


class StableDiffusion3(Family):
    """``StableDiffusion3Pipeline``: an MMDiT with classifier-free guidance."""

    name = "sd3"
    title = "Stable Diffusion 3"
    pipelines = ("StableDiffusion3Pipeline",)
    denoisers = ("transformer",)
    block_lists = ("transformer_blocks",)
    block_specs = MappingProxyType(
        {
            # Its last block (context_pre_only) returns None for the encoder.
            "JointTransformerBlock": BlockSpec(
                ("hidden_states", "encoder_hidden_states", "temb", "joint_attention_kwargs"),
                hidden_out=1,
                encoder_out=0,
                per_row=frozenset({"temb"}),
            ),
        }
    )
    fps = None
    guidance_parameter = "guidance_scale"
    context_parallel = False
    wrong_splits = MappingProxyType({})
    takes_adapters = True
    samplers = frozenset({"sde"})

    @property
    def size_multiple(self) -> int:
        return int(self.pipe.vae_scale_factor * self.pipe.transformer.config.patch_size)

    def _text(self, text: str) -> Encoded:
        """One text's embeddings (CLIP and T5) and pooled embeddings for one image, as
        ``encode_prompt`` makes a prompt's and a negative prompt's (``""`` for none)."""
        embeds, _, pooled, _ = self.pipe.encode_prompt(
            prompt=text,
            prompt_2=None,
            prompt_3=None,
            device=self.device,
            num_images_per_prompt=1,
            do_classifier_free_guidance=False,
        )
        return {"embeds": embeds, "pooled": pooled}

    def _prepare(
        self,
        request: GenerationRequest,
        request_id: str,
        generator: torch.Generator,
        scheduler: Any,
    ) -> RequestState:
        pipe = self.pipe
        cfg = request.guidance_scale > 1
        names = {"embeds": "encoder_hidden_states", "pooled": "pooled_projections"}
        cond = self._text_cond(request, cfg, self._text, names)
        vae_factor = pipe.vae_scale_factor
        shape = (
            request.num_images,
            pipe.transformer.config.in_channels,
            request.height // vae_factor,
            request.width // vae_factor,
        )
        latents = randn(shape, generator, self.device, cond["encoder_hidden_states"].dtype)
        kwargs: dict[str, Any] = {}
        if scheduler.config.get("use_dynamic_shifting", None):
            patch = pipe.transformer.config.patch_size
            seq_len = (shape[2] // patch) * (shape[3] // patch)
            kwargs["mu"] = calculate_shift(scheduler.config, seq_len, 1.16)
        timesteps = retrieve_timesteps(scheduler, request.num_steps, self.device, **kwargs)
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
        return _vae_decode_shifted(self, state, state.latents)


def _flow_timesteps(
    scheduler: Any, steps: int, image_seq_len: int, device: Any, *, linear: bool = True
) -> torch.Tensor:
    """As Flux's and Qwen-Image's ``__call__``: sigmas shifted by the image's token count.

    ``linear``: pass the pipelines' linear sigmas (else the scheduler's own).
    """
    sigmas = np.linspace(1.0, 1 / steps, steps) if linear else None
    mu = calculate_shift(scheduler.config, image_seq_len, 1.15)
    timesteps = retrieve_timesteps(scheduler, steps, device, sigmas=sigmas, mu=mu)
    scheduler.set_begin_index(0)
    return timesteps


class Flux(Family):
    """``FluxPipeline``: a guidance-distilled transformer over packed latents."""

    name = "flux"
    title = "Flux"
    pipelines = ("FluxPipeline",)
    denoisers = ("transformer",)
    block_lists = ("transformer_blocks", "single_transformer_blocks")
    block_specs = MappingProxyType(
        {"FluxTransformerBlock": _FLUX_BLOCK, "FluxSingleTransformerBlock": _FLUX_BLOCK}
    )
    fps = None
    # It feeds the guidance embedding.
    guidance_parameter = "guidance_scale"
    context_parallel = True
    wrong_splits = MappingProxyType({})
    takes_adapters = True
    samplers = frozenset({"sde"})
    # Flux's negative prompt needs true CFG (a second model call per step and a
    # scale the request has no field for): refused rather than ignored.
    negative_prompt = False

    @property
    def size_multiple(self) -> int:
        return int(self.pipe.vae_scale_factor * 2)

    def _text(self, text: str) -> Encoded:
        """One text's T5 embeddings, CLIP pooled embeddings and text ids for one image,
        as ``encode_prompt`` makes them."""
        embeds, pooled, text_ids = self.pipe.encode_prompt(
            prompt=text, prompt_2=None, device=self.device, num_images_per_prompt=1
        )
        return {"embeds": embeds, "pooled": pooled, "text_ids": text_ids}

    def _prepare(
        self,
        request: GenerationRequest,
        request_id: str,
        generator: torch.Generator,
        scheduler: Any,
    ) -> RequestState:
        pipe = self.pipe
        text = self._encoded(request.prompt, self._text)
        positive = per_image(text["embeds"], request.num_images)
        pooled = per_image(text["pooled"], request.num_images)
        text_ids = text["text_ids"]
        latents, image_ids = pipe.prepare_latents(
            request.num_images,
            pipe.transformer.config.in_channels // 4,
            request.height,
            request.width,
            positive.dtype,
            self.device,
            generator,
        )
        timesteps = _flow_timesteps(
            scheduler,
            request.num_steps,
            latents.shape[1],
            self.device,
            linear=not getattr(scheduler.config, "use_flow_sigmas", False),
        )
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
        return _unpacked_latents(self.pipe, state)

    def decode(self, state: RequestState) -> torch.Tensor:
        return _vae_decode_shifted(self, state, self._unpacked(state))

    def preview_latents(self, state: RequestState) -> torch.Tensor:
        return self._unpacked(state)


def _padded(tensor: torch.Tensor, length: int) -> torch.Tensor:
    """``tensor`` ``[rows, seq, dim]`` with zero rows appended along ``seq`` up to ``length``."""
    missing = length - tensor.shape[1]
    if missing == 0:
        return tensor
    return torch.cat([tensor, tensor.new_zeros(tensor.shape[0], missing, tensor.shape[2])], dim=1)


class QwenImage(Family):
    """``QwenImagePipeline``: an MMDiT over packed latents, text from Qwen2.5-VL, true CFG.

    The request maps to ``__call__`` as ``true_cfg_scale=guidance_scale`` and
    ``negative_prompt=negative_prompt``; so, as there, guidance runs only when
    ``guidance_scale > 1`` *and* a negative prompt is given (``" "`` is one). Its
    combination is the pipeline's: the guided prediction rescaled to the norm of
    the conditional one, per token. Prompts encode to different token counts: a
    model call pads every row's text to the longest and masks the padding.
    """

    name = "qwen-image"
    title = "Qwen-Image"
    pipelines = ("QwenImagePipeline",)
    denoisers = ("transformer",)
    block_lists = ("transformer_blocks",)
    block_specs = MappingProxyType(
        {
            # The text mask is per row, the rotary embeddings shared; with ``zero_cond_t``
            # (modulate_index) temb has two rows per row: not covered.
            "QwenImageTransformerBlock": BlockSpec(
                (
                    "hidden_states",
                    "encoder_hidden_states",
                    "encoder_hidden_states_mask",
                    "temb",
                    "image_rotary_emb",
                    "joint_attention_kwargs",
                    "modulate_index",
                ),
                hidden_out=1,
                encoder_out=0,
                per_row=frozenset({"encoder_hidden_states_mask", "temb"}),
                unset=frozenset({"modulate_index"}),
            ),
        }
    )
    fps = None
    guidance_parameter = "true_cfg_scale"
    context_parallel = True
    wrong_splits = MappingProxyType({})
    takes_adapters = True
    samplers = frozenset({"sde"})
    #: ``__call__``'s ``max_sequence_length`` default: text tokens kept per prompt.
    max_sequence_length = 512

    @property
    def size_multiple(self) -> int:
        return int(self.pipe.vae_scale_factor * 2)

    def _text(self, text: str) -> Encoded:
        """One text's embeddings for one image (and its mask, where it has padding), as
        ``encode_prompt`` makes them."""
        embeds, mask = self.pipe.encode_prompt(
            prompt=text,
            device=self.device,
            num_images_per_prompt=1,
            max_sequence_length=self.max_sequence_length,
        )
        return {"embeds": embeds} if mask is None else {"embeds": embeds, "mask": mask}

    def _encode(self, prompt: str, num_images: int) -> tuple[torch.Tensor, list[int]]:
        text = self._encoded(prompt, self._text)
        embeds = per_image(text["embeds"], num_images)
        # A single prompt is never padded (encode_prompt then returns no mask).
        mask = text.get("mask")
        lengths = [embeds.shape[1]] if mask is None else mask.sum(1).tolist()
        return embeds, lengths * num_images

    def _prepare(
        self,
        request: GenerationRequest,
        request_id: str,
        generator: torch.Generator,
        scheduler: Any,
    ) -> RequestState:
        pipe = self.pipe
        cfg = request.guidance_scale > 1 and request.negative_prompt is not None
        positive, lengths = self._encode(request.prompt, request.num_images)
        embeds = positive
        if cfg:
            assert request.negative_prompt is not None
            negative, negative_lengths = self._encode(request.negative_prompt, request.num_images)
            longest = max(negative.shape[1], positive.shape[1])
            embeds = torch.cat([_padded(negative, longest), _padded(positive, longest)])
            lengths = negative_lengths + lengths
        latents = pipe.prepare_latents(
            request.num_images,
            pipe.transformer.config.in_channels // 4,
            request.height,
            request.width,
            positive.dtype,
            self.device,
            generator,
        )
        timesteps = _flow_timesteps(scheduler, request.num_steps, latents.shape[1], self.device)
        factor = self.size_multiple
        shared = {"img_shape": (1, request.height // factor, request.width // factor)}
        state = RequestState(
            request_id,
            request,
            generator,
            scheduler,
            timesteps,
            [],
            latents,
            cfg,
            {"encoder_hidden_states": embeds},
            shared,
        )
        state.text_lengths = lengths
        return state

    def join_cond(self, states: Sequence[RequestState]) -> dict[str, torch.Tensor]:
        embeds = [state.cond["encoder_hidden_states"] for state in states]
        longest = max(e.shape[1] for e in embeds)
        lengths = [n for state in states for n in state.text_lengths]
        cond = {"encoder_hidden_states": joined([_padded(e, longest) for e in embeds])}
        if any(n < longest for n in lengths):
            # Known on the host: no device sync to decide whether a mask is needed,
            # and none (the faster attention path) when no row is padded.
            positions = torch.arange(longest, device=embeds[0].device)
            limits = torch.tensor(lengths, device=embeds[0].device)
            cond["encoder_hidden_states_mask"] = positions[None, :] < limits[:, None]
        return cond

    def denoise(
        self, rows: torch.Tensor, t: torch.Tensor, cond: dict[str, torch.Tensor], shared: Any
    ) -> torch.Tensor:
        out: torch.Tensor = self.pipe.transformer(
            hidden_states=rows,
            timestep=t.to(rows.dtype) / 1000,
            guidance=None,
            encoder_hidden_states_mask=cond.get("encoder_hidden_states_mask"),
            encoder_hidden_states=cond["encoder_hidden_states"],
            img_shapes=[[shared["img_shape"]]] * rows.shape[0],
            attention_kwargs={},
            return_dict=False,
        )[0]
        return out

    def guide(self, state: RequestState, prediction: torch.Tensor) -> torch.Tensor:
        negative, positive = prediction.chunk(2)
        combined = negative + state.request.guidance_scale * (positive - negative)
        positive_norm = torch.norm(positive, dim=-1, keepdim=True)
        combined_norm = torch.norm(combined, dim=-1, keepdim=True)
        guided: torch.Tensor = combined * (positive_norm / combined_norm)
        return guided

    def _unpacked(self, state: RequestState) -> torch.Tensor:
        """The latents as the VAE takes them: ``[N, C, 1, h, w]`` (one video frame)."""
        return _unpacked_latents(self.pipe, state)

    def decode(self, state: RequestState) -> torch.Tensor:
        vae = self.pipe.vae
        latents = wan_denormalized(vae, self._unpacked(state))
        image = self._vae_decode(
            state, latents.shape[0], lambda rows: vae.decode(latents[rows], return_dict=False)[0]
        )[:, :, 0]
        images: torch.Tensor = self.pipe.image_processor.postprocess(image, output_type="pt")
        return images

    def preview_latents(self, state: RequestState) -> torch.Tensor:
        return self._unpacked(state)[:, :, 0]
