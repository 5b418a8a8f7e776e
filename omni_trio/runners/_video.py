"""Video families: Wan and LTX-Video, step by step, as their pipelines' ``__call__`` (L70).

A video request's latents hold every frame (``[N, C, F', H', W']`` for Wan, packed
tokens ``[N, F' * H' * W', C]`` for LTX-Video); a step is one model call over the
whole clip, so the frame count and the size are batch-wide (``num_frames`` is in
the batch key) and everything else (prompt, seed, steps, guidance) is per request,
per row, as for the image families. ``decode`` returns the videos
``[N, F, C, H, W]`` in [0, 1]; a preview is the first latent frame.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from types import MappingProxyType
from typing import Any, cast

import numpy as np
import torch

from .._request import GenerationRequest
from ._family import (
    Family,
    RequestState,
    calculate_shift,
    guidance_rows,
    joined,
    randn,
    retrieve_timesteps,
    unit_number,
    wan_denormalized,
)
from ._prompts import Encoded
from ._stepcache import BlockSpec, expert_rows

__all__ = ["LTXImageToVideo", "LTXVideo", "Wan", "WanImageToVideo"]


class _Video(Family):
    """What the video families share: a frame rule, the first frame as preview."""

    @property
    def frames(self) -> tuple[int, int]:
        """``num_frames % a == b``: the counts the VAE's temporal compression takes."""
        return (self._temporal, 1)

    @property
    def _temporal(self) -> int:
        raise NotImplementedError

    def _postprocess(self, video: torch.Tensor) -> torch.Tensor:
        frames: torch.Tensor = self.pipe.video_processor.postprocess_video(video, output_type="pt")
        return frames


class Wan(_Video):
    """``WanPipeline``: a video DiT over ``[N, C, F', H', W']`` latents, UMT5 text, CFG.

    ``guidance_scale`` and ``negative_prompt`` as in ``__call__`` (guidance when
    ``guidance_scale > 1``; without a negative prompt it guides against ``""``).
    ``__call__`` makes the conditional and the unconditional model calls apart; here
    they are rows of one call (the model attends within a row only), which changes
    the sums' order, not the maths. Wan 2.2's two-expert pipelines
    (``boundary_ratio``: ``transformer`` above the boundary timestep,
    ``transformer_2`` below, each row by its own timestep) and per-token timesteps
    (``expand_timesteps``) are followed as ``__call__`` does; ``guidance_scale_2``
    is ``__call__``'s default, ``guidance_scale``.
    """

    name = "wan"
    title = "Wan"
    pipelines = ("WanPipeline",)
    denoisers = ("transformer", "transformer_2")
    block_lists = ("blocks",)
    block_specs = MappingProxyType(
        {
            # Called positionally; the text is an input of every block; rotary [1, ...].
            "WanTransformerBlock": BlockSpec(
                ("hidden_states", "encoder_hidden_states", "temb", "rotary_emb"),
                hidden_out=None,
                encoder_out=None,
                per_row=frozenset({"encoder_hidden_states", "temb"}),
            ),
        }
    )
    fps = 16.0
    guidance_parameter = "guidance_scale"
    context_parallel = True
    wrong_splits = MappingProxyType({})
    takes_adapters = True
    samplers = frozenset({"sde"})
    #: ``__call__``'s ``max_sequence_length`` default: text tokens per prompt.
    max_sequence_length = 512

    def __init__(self, pipe: Any) -> None:
        super().__init__(pipe)
        if pipe.transformer is None:
            raise TypeError("DiffusersRunner drives a WanPipeline with a transformer")
        ratio = pipe.config.boundary_ratio
        self._boundary = (
            None if ratio is None else ratio * pipe.scheduler.config.num_train_timesteps
        )
        if self._boundary is not None and pipe.transformer_2 is None:
            raise TypeError("a WanPipeline with a boundary_ratio needs its transformer_2")
        # The model calls' input dtype, as __call__ has it (the first transformer's, for
        # both experts). Read at every prepare, never in a step: diffusers' ``.dtype``
        # walks every parameter (about 9 ms on a 105-block transformer on this CPU,
        # paid before the first block and so before the first cancel point, L71).
        self._dtype: torch.dtype = pipe.transformer.dtype

    @property
    def size_multiple(self) -> int:
        patch = self.pipe.transformer.config.patch_size
        spatial = int(self.pipe.vae_scale_factor_spatial)
        return math.lcm(spatial * int(patch[1]), spatial * int(patch[2]))

    @property
    def _temporal(self) -> int:
        return int(self.pipe.vae_scale_factor_temporal)

    def _prepare(
        self,
        request: GenerationRequest,
        request_id: str,
        generator: torch.Generator,
        scheduler: Any,
    ) -> RequestState:
        pipe = self.pipe
        assert request.num_frames is not None  # a video runner's rule (L70)
        cfg = request.guidance_scale > 1
        rows = self._text_rows(request, cfg)
        scheduler.set_timesteps(request.num_steps, device=self.device)
        latents = pipe.prepare_latents(
            request.num_images,
            pipe.transformer.config.in_channels,
            request.height,
            request.width,
            request.num_frames,
            torch.float32,
            self.device,
            generator,
        )
        scheduler.set_begin_index(0)
        return RequestState(
            request_id,
            request,
            generator,
            scheduler,
            scheduler.timesteps,
            [],
            latents,
            cfg,
            {"encoder_hidden_states": rows},
        )

    def _text(self, text: str) -> Encoded:
        """One text's embeddings for one video, as ``encode_prompt`` makes a prompt's and
        a negative prompt's (``""`` for none)."""
        embeds, _ = self.pipe.encode_prompt(
            prompt=text,
            do_classifier_free_guidance=False,
            num_videos_per_prompt=1,
            max_sequence_length=self.max_sequence_length,
            device=self.device,
        )
        return {"embeds": embeds}

    def _text_rows(self, request: GenerationRequest, cfg: bool) -> torch.Tensor:
        """The prompt's rows (the negative prompt's first, with guidance), as ``__call__``
        encodes them, in the transformer's dtype (read here: ``_dtype``)."""
        rows = self._text_cond(request, cfg, self._text, {"embeds": "rows"})["rows"]
        self._dtype = self.pipe.transformer.dtype
        return rows.to(self._dtype)

    def _call(
        self,
        model: Any,
        rows: torch.Tensor,
        t: torch.Tensor,
        text: torch.Tensor,
        image: torch.Tensor | None = None,
    ) -> torch.Tensor:
        rows = rows.to(self._dtype)
        timestep = t
        if self.pipe.config.expand_timesteps:
            # As __call__: one timestep per token, every 2x2 patch of every latent frame.
            frames, height, width = rows.shape[2:]
            tokens = frames * math.ceil(height / 2) * math.ceil(width / 2)
            timestep = t[:, None].expand(-1, tokens)
        out: torch.Tensor = model(
            hidden_states=rows,
            timestep=timestep,
            encoder_hidden_states=text,
            encoder_hidden_states_image=image,
            attention_kwargs=None,
            return_dict=False,
        )[0]
        return out

    def denoise(
        self, rows: torch.Tensor, t: torch.Tensor, cond: dict[str, torch.Tensor], shared: Any
    ) -> torch.Tensor:
        text = cond["encoder_hidden_states"]
        if self._boundary is None:
            return self._call(self.pipe.transformer, rows, t, text)
        # Each row to the expert of its own timestep; one call per expert in use.
        high = t >= self._boundary
        if bool(high.all()):
            return self._call(self.pipe.transformer, rows, t, text)
        if not bool(high.any()):
            return self._call(self.pipe.transformer_2, rows, t, text)
        low = ~high
        mask = high.tolist()  # known on the host already (the two syncs above)
        with expert_rows(mask):  # the step cache's rows of each expert's call
            first = self._call(self.pipe.transformer, rows[high], t[high], text[high])
        with expert_rows([not row for row in mask]):
            second = self._call(self.pipe.transformer_2, rows[low], t[low], text[low])
        out = first.new_empty((rows.shape[0], *first.shape[1:]))
        out[high] = first
        out[low] = second
        return out

    def decode(self, state: RequestState) -> torch.Tensor:
        assert state.latents is not None
        vae = self.pipe.vae
        latents = wan_denormalized(vae, state.latents)
        video = self._vae_decode(
            state, latents.shape[0], lambda rows: vae.decode(latents[rows], return_dict=False)[0]
        )
        return self._postprocess(video)

    def preview_latents(self, state: RequestState) -> torch.Tensor:
        assert state.latents is not None
        return state.latents[:, :, 0]


def _to_pil(image: Any) -> Any:
    """A request's image (a ``[3, H, W]`` float tensor in [0, 1]) as the RGB PIL image it was.

    Exact for an image that came from a PIL image: its bytes over 255, rounded back.
    """
    import PIL.Image

    if isinstance(image, PIL.Image.Image):
        return image
    pixels = (image.clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).contiguous()
    return PIL.Image.fromarray(pixels.numpy(), mode="RGB")


class WanImageToVideo(Wan):
    """``WanImageToVideoPipeline`` (Wan 2.1's image to video, L69): Wan, conditioned on an image.

    ``request.image`` (a PIL image or a ``[C, H, W]`` tensor in [0, 1], as the
    pipeline's ``image``) becomes, as ``__call__`` makes them, the latents of a clip
    whose first frame is the image (VAE-encoded, with a mask of the frames given: 20
    channels beside the 16 of the noise, every step) and, where the transformer takes
    it (``image_dim``), a CLIP vision embedding as extra context. Both are per row, so
    requests with different images share a batch. The prompt is encoded by the
    pipeline's ``encode_prompt``, whose cleaning calls ``ftfy`` (a dependency of
    omni_trio). Wan 2.2's image to video (``expand_timesteps``, two experts) is not
    driven here.
    """

    name = "wan-i2v"
    pipelines = ("WanImageToVideoPipeline",)
    image_to_video = True
    # Not yet (L100): its image's latents beside the noise are not in a trajectory.
    samplers = frozenset()

    def __init__(self, pipe: Any) -> None:
        if pipe.config.expand_timesteps or pipe.config.boundary_ratio is not None:
            raise TypeError(
                "DiffusersRunner drives Wan 2.1's image to video (no expand_timesteps, one"
                " transformer)"
            )
        super().__init__(pipe)

    def _prepare(
        self,
        request: GenerationRequest,
        request_id: str,
        generator: torch.Generator,
        scheduler: Any,
    ) -> RequestState:
        pipe = self.pipe
        assert request.num_frames is not None and request.image is not None
        # The request holds its image as a float tensor in [0, 1]; the pipeline's image
        # processors read a PIL image (CLIP's would rescale a float tensor again).
        picture = _to_pil(request.image)
        cfg = request.guidance_scale > 1
        cond = {"encoder_hidden_states": self._text_rows(request, cfg)}
        if pipe.transformer.config.image_dim is not None:
            embeds = pipe.encode_image(picture, self.device).to(self._dtype)
            embeds = embeds.repeat(request.num_images, 1, 1)
            cond["encoder_hidden_states_image"] = guidance_rows(cfg, embeds, embeds)
        scheduler.set_timesteps(request.num_steps, device=self.device)
        image = pipe.video_processor.preprocess(
            picture, height=request.height, width=request.width
        ).to(self.device, dtype=torch.float32)
        latents, condition = pipe.prepare_latents(
            image,
            request.num_images,
            pipe.vae.config.z_dim,
            request.height,
            request.width,
            request.num_frames,
            torch.float32,
            self.device,
            generator,
        )
        cond["condition"] = guidance_rows(cfg, condition, condition)
        scheduler.set_begin_index(0)
        return RequestState(
            request_id,
            request,
            generator,
            scheduler,
            scheduler.timesteps,
            [],
            latents,
            cfg,
            cond,
        )

    def scale_input(self, state: RequestState, rows: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """The noise's rows with the image's condition beside them, as ``__call__`` feeds them."""
        return torch.cat([rows, state.cond["condition"]], dim=1)

    def join_cond(self, states: Sequence[RequestState]) -> dict[str, torch.Tensor]:
        """The text and image context of the call; the condition went in with the rows."""
        return {
            key: joined([state.cond[key] for state in states])
            for key in states[0].cond
            if key != "condition"
        }

    def denoise(
        self, rows: torch.Tensor, t: torch.Tensor, cond: dict[str, torch.Tensor], shared: Any
    ) -> torch.Tensor:
        return self._call(
            self.pipe.transformer,
            rows,
            t,
            cond["encoder_hidden_states"],
            cond.get("encoder_hidden_states_image"),
        )


class LTXVideo(_Video):
    """``LTXPipeline``: a video DiT over packed latent tokens, T5 text, CFG.

    ``guidance_scale`` and ``negative_prompt`` as in ``__call__``; negative and
    positive rows share one model call there too. ``__call__``'s ``frame_rate``
    (25, which scales the positional embedding) is kept. With a
    timestep-conditioned VAE (LTX-Video 0.9.1 and later), ``extra`` takes
    ``decode_timestep`` and ``decode_noise_scale`` (numbers in [0, 1]; defaults as
    ``__call__``: 0, and the timestep), and the decode noise is drawn from the
    request's generator after its last step, as ``__call__`` draws it.
    """

    name = "ltx"
    title = "LTX-Video"
    pipelines = ("LTXPipeline",)
    denoisers = ("transformer",)
    block_lists = ("transformer_blocks",)
    block_specs = MappingProxyType(
        {
            # Its rotary embeddings have a row per row ([rows, tokens, dim]).
            "LTXVideoTransformerBlock": BlockSpec(
                (
                    "hidden_states",
                    "encoder_hidden_states",
                    "temb",
                    "image_rotary_emb",
                    "encoder_attention_mask",
                ),
                hidden_out=None,
                encoder_out=None,
                per_row=frozenset(
                    {"encoder_hidden_states", "temb", "image_rotary_emb", "encoder_attention_mask"}
                ),
            ),
        }
    )
    #: ``__call__``'s ``frame_rate``, which scales the positional embedding too.
    fps = 25.0
    guidance_parameter = "guidance_scale"
    context_parallel = True
    # diffusers 0.42.1, two gloo ranks: its text mask is split with the text tokens,
    # which its cross-attention reads whole. Ulysses raises there (the mask keeps every
    # head, the ranks have half); ring runs and makes another video (0.06 off one
    # rank's on tiny LTX-Video).
    wrong_splits = MappingProxyType(
        dict.fromkeys(
            ("ulysses", "ring"),
            "diffusers splits its text mask with the text, and the split output is wrong",
        )
    )
    takes_adapters = True
    extra_keys = frozenset({"decode_timestep", "decode_noise_scale"})
    #: ``__call__``'s default: text tokens per prompt.
    max_sequence_length = 128

    @property
    def size_multiple(self) -> int:
        # LTXPipeline.check_inputs asks for multiples of 32 whatever the VAE.
        spatial = int(self.pipe.vae_spatial_compression_ratio)
        return math.lcm(32, spatial * int(self.pipe.transformer_spatial_patch_size))

    @property
    def _temporal(self) -> int:
        return int(self.pipe.vae_temporal_compression_ratio)

    def _text(self, text: str) -> Encoded:
        """One text's embeddings and attention mask for one video, as ``encode_prompt``
        makes a prompt's and a negative prompt's (``""`` for none)."""
        embeds, mask, _, _ = self.pipe.encode_prompt(
            prompt=text,
            do_classifier_free_guidance=False,
            num_videos_per_prompt=1,
            max_sequence_length=self.max_sequence_length,
            device=self.device,
        )
        return {"embeds": embeds, "mask": mask}

    def _grid(self, request: GenerationRequest) -> tuple[int, int, int]:
        """Latent frames, height and width."""
        assert request.num_frames is not None  # a video runner's rule (L70)
        pipe = self.pipe
        spatial = pipe.vae_spatial_compression_ratio
        frames = (request.num_frames - 1) // pipe.vae_temporal_compression_ratio + 1
        return frames, request.height // spatial, request.width // spatial

    def _prepare(
        self,
        request: GenerationRequest,
        request_id: str,
        generator: torch.Generator,
        scheduler: Any,
    ) -> RequestState:
        pipe = self.pipe
        assert request.num_frames is not None
        for key, default in (("decode_timestep", 0.0), ("decode_noise_scale", 0.0)):
            unit_number(request, key, default)  # refused before any model work
        cfg = request.guidance_scale > 1
        names = {"embeds": "encoder_hidden_states", "mask": "encoder_attention_mask"}
        cond = self._text_cond(request, cfg, self._text, names)
        latents = self._initial_latents(request, generator, cond)
        frames, height, width = self._grid(request)
        steps = request.num_steps
        timesteps = retrieve_timesteps(
            scheduler,
            steps,
            self.device,
            sigmas=np.linspace(1.0, 1 / steps, steps),
            mu=calculate_shift(scheduler.config, frames * height * width, 1.15),
        )
        spatial = pipe.vae_spatial_compression_ratio
        shared = {
            "grid": (frames, height, width),
            "rope_interpolation_scale": (
                pipe.vae_temporal_compression_ratio / self.fps,
                spatial,
                spatial,
            ),
        }
        return RequestState(
            request_id, request, generator, scheduler, timesteps, [], latents, cfg, cond, shared
        )

    def _initial_latents(
        self, request: GenerationRequest, generator: torch.Generator, cond: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """The request's first latents, as ``__call__``'s ``prepare_latents`` makes them."""
        assert request.num_frames is not None
        latents: torch.Tensor = self.pipe.prepare_latents(
            request.num_images,
            self.pipe.transformer.config.in_channels,
            request.height,
            request.width,
            request.num_frames,
            torch.float32,
            self.device,
            generator,
        )
        return latents

    def _timestep(self, t: torch.Tensor, cond: dict[str, torch.Tensor]) -> torch.Tensor:
        """The model call's timesteps: one per row."""
        return t

    def denoise(
        self, rows: torch.Tensor, t: torch.Tensor, cond: dict[str, torch.Tensor], shared: Any
    ) -> torch.Tensor:
        text = cond["encoder_hidden_states"]
        frames, height, width = shared["grid"]
        out: torch.Tensor = self.pipe.transformer(
            hidden_states=rows.to(text.dtype),
            encoder_hidden_states=text,
            timestep=self._timestep(t, cond),
            encoder_attention_mask=cond["encoder_attention_mask"],
            num_frames=frames,
            height=height,
            width=width,
            rope_interpolation_scale=shared["rope_interpolation_scale"],
            attention_kwargs=None,
            return_dict=False,
        )[0]
        return out.float()

    def _unpacked(self, state: RequestState) -> torch.Tensor:
        assert state.latents is not None
        pipe = self.pipe
        unpacked: torch.Tensor = pipe._unpack_latents(
            state.latents,
            *self._grid(state.request),
            pipe.transformer_spatial_patch_size,
            pipe.transformer_temporal_patch_size,
        )
        return unpacked

    def decode(self, state: RequestState) -> torch.Tensor:
        pipe = self.pipe
        vae = pipe.vae
        request = state.request
        latents = pipe._denormalize_latents(
            self._unpacked(state), vae.latents_mean, vae.latents_std, vae.config.scaling_factor
        )
        latents = latents.to(state.cond["encoder_hidden_states"].dtype)
        timestep = None
        if vae.config.timestep_conditioning:
            # As __call__: the noise is drawn whatever its scale. One timestep per
            # video: __call__ makes one per prompt, which its VAE refuses for
            # num_videos_per_prompt > 1 (diffusers 0.42).
            noise = randn(tuple(latents.shape), state.generator, self.device, latents.dtype)
            decode_timestep = unit_number(request, "decode_timestep", 0.0)
            scale = unit_number(request, "decode_noise_scale", decode_timestep)
            count = request.num_images
            timestep = torch.tensor(
                [decode_timestep] * count, device=self.device, dtype=latents.dtype
            )
            noise_scale = torch.tensor([scale] * count, device=self.device, dtype=latents.dtype)
            noise_scale = noise_scale[:, None, None, None, None]
            latents = (1 - noise_scale) * latents + noise_scale * noise
        latents = latents.to(vae.dtype)

        def decode(rows: slice) -> torch.Tensor:
            temb = None if timestep is None else timestep[rows]
            out: torch.Tensor = vae.decode(latents[rows], temb, return_dict=False)[0]
            return out

        return self._postprocess(self._vae_decode(state, latents.shape[0], decode))

    def preview_latents(self, state: RequestState) -> torch.Tensor:
        return self._unpacked(state)[:, :, 0]


class LTXImageToVideo(LTXVideo):
    """``LTXImageToVideoPipeline`` (L69): LTX-Video whose first latent frame is the image's.

    As ``__call__``: the image, VAE-encoded (a sample drawn from the request's
    generator, before the noise), is the first latent frame of every frame's start,
    noise the others; a conditioning mask (1 on the first frame's tokens) makes each
    token's timestep ``t x (1 - mask)`` and keeps the first frame out of the
    scheduler's step. The mask is per row, so requests of different images share a
    batch.
    """

    name = "ltx-i2v"
    pipelines = ("LTXImageToVideoPipeline",)
    image_to_video = True

    def _initial_latents(
        self, request: GenerationRequest, generator: torch.Generator, cond: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        pipe = self.pipe
        assert request.num_frames is not None and request.image is not None
        text = cond["encoder_hidden_states"]
        image = pipe.video_processor.preprocess(
            _to_pil(request.image), height=request.height, width=request.width
        ).to(device=self.device, dtype=text.dtype)
        latents, mask = pipe.prepare_latents(
            image,
            request.num_images,
            pipe.transformer.config.in_channels,
            request.height,
            request.width,
            request.num_frames,
            torch.float32,
            self.device,
            generator,
        )
        cfg = request.guidance_scale > 1
        cond["conditioning_mask"] = guidance_rows(cfg, mask, mask)
        return cast("torch.Tensor", latents)

    def _timestep(self, t: torch.Tensor, cond: dict[str, torch.Tensor]) -> torch.Tensor:
        """One timestep per token: the image's frame stays at 0 (``__call__``'s)."""
        return t[:, None] * (1 - cond["conditioning_mask"])

    def scheduler_step(
        self, state: RequestState, prediction: torch.Tensor, t: torch.Tensor
    ) -> torch.Tensor:
        """Step every latent frame but the image's, as ``__call__`` does."""
        pipe = self.pipe
        grid = self._grid(state.request)
        patches = (pipe.transformer_spatial_patch_size, pipe.transformer_temporal_patch_size)
        assert state.latents is not None
        predicted = pipe._unpack_latents(prediction, *grid, *patches)
        latents = pipe._unpack_latents(state.latents, *grid, *patches)
        stepped = state.scheduler.step(
            predicted[:, :, 1:], t, latents[:, :, 1:], **state.step_kwargs, return_dict=False
        )[0]
        packed: torch.Tensor = pipe._pack_latents(
            torch.cat([latents[:, :, :1], stepped], dim=2), *patches
        )
        return packed
