"""Tiny, randomly initialised diffusers pipelines for tests and benchmarks.

Nothing is downloaded: every model is built from a config with seeded random weights, and
the tokenizers are built in memory (a character-level CLIP BPE, a character-level T5
Unigram and a byte-level Qwen2 BPE). The pipelines are real diffusers pipelines with
their real ``__call__``; only the models are tiny, so a denoise step costs milliseconds
on a CPU.

Sizes (``vae_scale_factor`` is 8 for every kind with a VAE, as in the real models):

==========  ==========================  ==============  ==================  ============
kind        pipeline                    latent chans    pixel multiple      default size
==========  ==========================  ==============  ==================  ============
sd          StableDiffusionPipeline     4               8                   64
sdxl        StableDiffusionXLPipeline   4               8                   64
sd3         StableDiffusion3Pipeline    16              16 (8 x patch 2)    64
flux        FluxPipeline                16 (64 packed)  16 (8 x 2x2 pack)   1024
qwen-image  QwenImagePipeline           16 (64 packed)  16 (8 x 2x2 pack)   1024
unet        DDIMPipeline                3 (pixels)      fixed 32x32         32
wan         WanPipeline                 16              16 (8 x patch 2)    480x832
wan-i2v     WanImageToVideoPipeline     16 (+20 cond)   16 (8 x patch 2)    480x832
ltx         LTXPipeline                 8               32 (check_inputs)   512x704
ltx-i2v     LTXImageToVideoPipeline     8               32 (check_inputs)   512x704
==========  ==========================  ==============  ==================  ============

The video kinds (``TINY_VIDEO_KINDS``) make ``[N, F, C, H, W]`` frames
(``pipe(...).frames``): Wan 4k + 1 frames (a temporal compression of 4), LTX-Video
8k + 1 (8). Their ``__call__`` defaults are the real models' sizes (81 or 161
frames at 480x832 or 512x704): pass ``height``, ``width`` and ``num_frames``
(32 x 32 and 9 frames: a step in milliseconds). The image-to-video kinds (L69), called
with ``image=`` too: ``wan-i2v`` is Wan 2.1's image to video, Wan's parts with a
transformer that takes the image's latents and a tiny CLIP vision encoder's embedding;
``ltx-i2v`` is ``ltx``'s parts in an ``LTXImageToVideoPipeline``.

FluxPipeline's and QwenImagePipeline's default size is hard-wired to 1024 px (128
latent rows, 4096 tokens): always pass ``height`` and ``width``. A step at 64 px costs a
few milliseconds on one CPU thread for every kind.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ._quiet import quiet_notices
from ._tinytext import (
    QWEN_VOCAB_SIZE,
    clip_config,
    clip_tokenizer,
    qwen_tokenizer,
    t5_config,
    t5_tokenizer,
)

if TYPE_CHECKING:
    # Not ``from diffusers import DiffusionPipeline``: mypy resolves that name to the
    # dummy placeholder class of diffusers' optional-dependency fallbacks.
    from diffusers.pipelines.pipeline_utils import DiffusionPipeline

__all__ = ["TINY_KINDS", "TINY_VIDEO_KINDS", "tiny_pipeline"]

TINY_KINDS: tuple[str, ...] = ("sd", "sdxl", "sd3", "flux", "qwen-image", "unet")
"""The image kinds :func:`tiny_pipeline` builds."""

TINY_VIDEO_KINDS: tuple[str, ...] = ("wan", "ltx")
"""The video kinds :func:`tiny_pipeline` builds (L70)."""

_TINY_I2V_KINDS: tuple[str, ...] = ("wan-i2v", "ltx-i2v")
"""The image-to-video kinds (L69): their call needs ``image=``, so they are apart."""


def tiny_pipeline(kind: str, *, seed: int = 0) -> DiffusionPipeline:
    """Build a tiny diffusers pipeline of one kind, with seeded random weights.

    Every model is created right after ``torch.manual_seed(seed)`` inside
    ``torch.random.fork_rng``, so the same seed gives bit-identical weights and the
    caller's global RNG state is left untouched. Every module is float32, on CPU, in eval
    mode; the progress bar is disabled. The transformers notice that diffusers'
    imports trigger without torchvision is dropped while it builds.

    Args:
        kind: ``"sd"`` (StableDiffusionPipeline, DDIM scheduler), ``"sdxl"``
            (StableDiffusionXLPipeline, two CLIPs, DDIM, no watermark), ``"sd3"``
            (StableDiffusion3Pipeline without T5, flow-matching Euler), ``"flux"``
            (FluxPipeline with guidance embedding, flow-matching Euler with dynamic
            shifting), ``"qwen-image"`` (QwenImagePipeline: a Qwen2.5-VL text encoder,
            the Qwen-Image VAE, flow-matching Euler with exponential dynamic shifting)
            or ``"unet"`` (unconditional DDIMPipeline, 32x32 pixels); video:
            ``"wan"`` (WanPipeline: a UMT5 text encoder, the Wan VAE, flow-matching
            Euler) or ``"ltx"`` (LTXPipeline: T5, the LTX-Video VAE with timestep
            conditioning, flow-matching Euler with dynamic shifting); image to video
            (L69): ``"wan-i2v"`` (WanImageToVideoPipeline: Wan's parts, a 36-channel
            transformer with image context, a tiny CLIP vision encoder) and ``"ltx-i2v"``
            (LTXImageToVideoPipeline: ``ltx``'s parts).
        seed: Seed of the random weights.

    Returns:
        The pipeline. ``sd``/``sdxl``/``sd3``/``flux``/``qwen-image`` take
        ``pipe(prompt, height=, width=, ...)`` with sizes a multiple of 8/8/16/16/16
        pixels; ``unet`` takes
        ``pipe(batch_size=, num_inference_steps=, generator=, output_type="np")``;
        ``wan``/``ltx`` take ``pipe(prompt, height=, width=, num_frames=, ...)`` with
        sizes a multiple of 16/32 and 4k + 1/8k + 1 frames; ``wan-i2v``/``ltx-i2v`` take
        ``image=`` too, 32 x 32 frames best (its CLIP sees 32 x 32 px).

    Raises:
        ValueError: ``kind`` is not one of ``TINY_KINDS`` or ``TINY_VIDEO_KINDS``.
    """
    builders: dict[str, Callable[[int], Any]] = {
        "sd": _build_sd,
        "sdxl": _build_sdxl,
        "sd3": _build_sd3,
        "flux": _build_flux,
        "qwen-image": _build_qwen_image,
        "unet": _build_unet,
        "wan": _build_wan,
        "wan-i2v": _build_wan_i2v,
        "ltx": _build_ltx,
        "ltx-i2v": _build_ltx_i2v,
    }
    try:
        build = builders[kind]
    except KeyError:
        kinds = ", ".join((*TINY_KINDS, *TINY_VIDEO_KINDS, *_TINY_I2V_KINDS))
        raise ValueError(f"unknown tiny pipeline kind {kind!r}; supported kinds: {kinds}") from None
    # Building imports diffusers' pipeline modules, which trigger transformers' notice
    # about torchvision (see ``quiet_notices``).
    with quiet_notices(), torch.random.fork_rng(devices=[]):
        built = build(seed)
    for component in built.components.values():
        if isinstance(component, torch.nn.Module):
            # Built on CPU; cast only if the caller changed torch's default dtype (diffusers
            # logs a notice on every dtype cast of its models).
            if any(p.dtype != torch.float32 for p in component.parameters()):
                component.to(dtype=torch.float32)
            component.eval()
    built.set_progress_bar_config(disable=True)
    pipe: DiffusionPipeline = built
    return pipe


def _diffusers() -> Any:
    """The diffusers module, imported on first use (it takes seconds) and typed ``Any``.

    diffusers' constructors are unannotated, which ``mypy --strict`` rejects in typed code.
    """
    import diffusers

    return diffusers


def _transformers() -> Any:
    """The transformers module, imported on first use and typed ``Any``."""
    import transformers

    return transformers


def _seeded(seed: int, factory: Callable[[], Any]) -> Any:
    """Call ``factory`` right after seeding torch's global CPU generator."""
    torch.manual_seed(seed)
    return factory()


def _vae(seed: int, *, latent_channels: int, **extra: Any) -> Any:
    """An AutoencoderKL with four blocks: ``vae_scale_factor`` 8, like the real ones."""
    diffusers = _diffusers()
    return _seeded(
        seed,
        lambda: diffusers.AutoencoderKL(
            in_channels=3,
            out_channels=3,
            down_block_types=("DownEncoderBlock2D",) * 4,
            up_block_types=("UpDecoderBlock2D",) * 4,
            block_out_channels=(8, 8, 8, 8),
            layers_per_block=1,
            latent_channels=latent_channels,
            norm_num_groups=2,
            sample_size=64,
            **extra,
        ),
    )


# ------------------------------------------------------------------------------ builders


def _sd_ddim(**options: Any) -> Any:
    """DDIM with Stable Diffusion's betas (SD 1.x/2.x and SDXL share them)."""
    return _diffusers().DDIMScheduler(
        num_train_timesteps=1000,
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        prediction_type="epsilon",
        clip_sample=False,
        set_alpha_to_one=False,
        steps_offset=1,  # StableDiffusionPipeline warns (FutureWarning) on any other value
        **options,
    )


def _build_sd(seed: int) -> Any:
    """StableDiffusionPipeline: 2-block UNet (8x8 latents at 64 px), one CLIP, DDIM."""
    diffusers = _diffusers()
    transformers = _transformers()

    unet = _seeded(
        seed,
        lambda: diffusers.UNet2DConditionModel(
            sample_size=8,  # latent pixels: default size 8 * 8 = 64 px
            in_channels=4,
            out_channels=4,
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
            block_out_channels=(16, 32),
            layers_per_block=1,
            norm_num_groups=8,
            cross_attention_dim=32,
            attention_head_dim=8,
        ),
    )
    vae = _vae(seed, latent_channels=4, scaling_factor=0.18215)
    text_encoder = _seeded(seed, lambda: transformers.CLIPTextModel(clip_config()))
    # Stable Diffusion 2.1-base's scheduler config. Not Euler: its set_timesteps calls
    # np.array on a torch tensor, a DeprecationWarning with numpy 2.4 (as do DPM-Solver
    # and UniPC); PNDM runs num_inference_steps + 1 UNet evaluations.
    scheduler = _sd_ddim()
    return diffusers.StableDiffusionPipeline(
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=clip_tokenizer(),
        unet=unet,
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )


def _build_sdxl(seed: int) -> Any:
    """StableDiffusionXLPipeline: 2-block UNet with text-time embedding, two CLIPs, DDIM."""
    diffusers = _diffusers()
    transformers = _transformers()

    # Cross-attention takes both CLIPs' hidden states concatenated (32 + 32); the added
    # embedding the second CLIP's pooled projection (32) and six size ids of 8 each.
    unet = _seeded(
        seed,
        lambda: diffusers.UNet2DConditionModel(
            sample_size=8,  # latent pixels: default size 8 * 8 = 64 px
            in_channels=4,
            out_channels=4,
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
            block_out_channels=(16, 32),
            layers_per_block=1,
            norm_num_groups=8,
            cross_attention_dim=64,
            attention_head_dim=(2, 4),
            use_linear_projection=True,
            addition_embed_type="text_time",
            addition_time_embed_dim=8,
            projection_class_embeddings_input_dim=6 * 8 + 32,
        ),
    )
    vae = _vae(seed, latent_channels=4, scaling_factor=0.13025)
    text_encoder = _seeded(seed, lambda: transformers.CLIPTextModel(clip_config()))
    text_encoder_2 = _seeded(
        seed + 1, lambda: transformers.CLIPTextModelWithProjection(clip_config())
    )
    # SDXL 1.0's scheduler is Euler, whose set_timesteps warns with numpy 2.4 (see
    # _build_sd); DDIM with SDXL's betas and "leading" spacing instead.
    scheduler = _sd_ddim(timestep_spacing="leading")
    return diffusers.StableDiffusionXLPipeline(
        vae=vae,
        text_encoder=text_encoder,
        text_encoder_2=text_encoder_2,
        tokenizer=clip_tokenizer(),
        tokenizer_2=clip_tokenizer(),
        unet=unet,
        scheduler=scheduler,
        add_watermarker=False,
    )


def _build_sd3(seed: int) -> Any:
    """StableDiffusion3Pipeline: 2-layer MMDiT, patch 2, two CLIPs and no T5."""
    diffusers = _diffusers()
    transformers = _transformers()

    # Text: two CLIPs (hidden 32 each, concatenated to 64 = joint_attention_dim; pooled 32
    # each, concatenated to 64 = pooled_projection_dim). No T5: the pipeline then uses zeros.
    transformer = _seeded(
        seed,
        lambda: diffusers.SD3Transformer2DModel(
            sample_size=8,  # latent pixels: default size 8 * 8 = 64 px
            patch_size=2,
            in_channels=16,
            out_channels=16,
            num_layers=2,
            attention_head_dim=8,
            num_attention_heads=4,
            joint_attention_dim=64,
            caption_projection_dim=32,
            pooled_projection_dim=64,
            pos_embed_max_size=32,
        ),
    )
    vae = _vae(
        seed,
        latent_channels=16,
        use_quant_conv=False,
        use_post_quant_conv=False,
        scaling_factor=1.5305,
        shift_factor=0.0609,
    )
    text_encoder = _seeded(seed, lambda: transformers.CLIPTextModelWithProjection(clip_config()))
    text_encoder_2 = _seeded(
        seed + 1, lambda: transformers.CLIPTextModelWithProjection(clip_config())
    )
    return diffusers.StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=clip_tokenizer(),
        text_encoder_2=text_encoder_2,
        tokenizer_2=clip_tokenizer(),
        text_encoder_3=None,
        tokenizer_3=None,
    )


def _build_flux(seed: int) -> Any:
    """FluxPipeline: 1 double + 1 single block, guidance embedding, CLIP and T5."""
    diffusers = _diffusers()
    transformers = _transformers()

    # Latents are 16 channels, packed 2x2 into 64-channel tokens for the transformer.
    transformer = _seeded(
        seed,
        lambda: diffusers.FluxTransformer2DModel(
            patch_size=1,
            in_channels=64,
            num_layers=1,
            num_single_layers=1,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=32,  # T5 d_model
            pooled_projection_dim=32,  # CLIP hidden size
            guidance_embeds=True,
            axes_dims_rope=(4, 4, 8),  # sums to attention_head_dim
        ),
    )
    vae = _vae(
        seed,
        latent_channels=16,
        use_quant_conv=False,
        use_post_quant_conv=False,
        scaling_factor=0.3611,
        shift_factor=0.1159,
    )
    text_encoder = _seeded(seed, lambda: transformers.CLIPTextModel(clip_config()))
    text_encoder_2 = _seeded(seed, lambda: transformers.T5EncoderModel(t5_config()))
    # FLUX.1-dev's scheduler: resolution-dependent shift.
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000,
        shift=3.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
    )
    return diffusers.FluxPipeline(
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=clip_tokenizer(),
        text_encoder_2=text_encoder_2,
        tokenizer_2=t5_tokenizer(),
        transformer=transformer,
    )


def _build_qwen_image(seed: int) -> Any:
    """QwenImagePipeline: 2-block MMDiT over 2x2-packed latents, 2-layer Qwen2.5-VL, its VAE."""
    diffusers = _diffusers()
    transformers = _transformers()

    transformer = _seeded(
        seed,
        lambda: diffusers.QwenImageTransformer2DModel(
            patch_size=2,
            in_channels=64,
            out_channels=16,
            num_layers=2,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=32,  # the text encoder's hidden size
            axes_dims_rope=(4, 6, 6),  # sums to attention_head_dim
        ),
    )
    # The causal 3D VAE, four levels: vae_scale_factor 2 ** len(temperal_downsample) = 8.
    vae = _seeded(
        seed,
        lambda: diffusers.AutoencoderKLQwenImage(
            base_dim=8,
            z_dim=16,
            dim_mult=[1, 1, 1, 1],
            num_res_blocks=1,
            temperal_downsample=[False, True, True],
        ),
    )
    # The text model is what the pipeline reads (its last hidden state); the vision
    # tower, never called for text, is one small block.
    config = transformers.Qwen2_5_VLConfig(
        text_config={
            "vocab_size": QWEN_VOCAB_SIZE,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 2048,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [1, 1, 2],  # sums to head_dim / 2
            },
            "bos_token_id": None,
            "eos_token_id": 258,  # <|im_end|>
            "pad_token_id": 256,  # <|endoftext|>
        },
        vision_config={
            "depth": 1,
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_heads": 2,
            "out_hidden_size": 32,
            "fullatt_block_indexes": [0],
        },
    )
    text_encoder = _seeded(seed, lambda: transformers.Qwen2_5_VLForConditionalGeneration(config))
    # Qwen-Image's own scheduler config.
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000,
        shift=1.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=0.9,
        base_image_seq_len=256,
        max_image_seq_len=8192,
        shift_terminal=0.02,
        time_shift_type="exponential",
    )
    return diffusers.QwenImagePipeline(
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=qwen_tokenizer(),
        transformer=transformer,
    )


def _build_unet(seed: int) -> Any:
    """DDIMPipeline: unconditional 2-block UNet2DModel at 32x32 pixels."""
    diffusers = _diffusers()

    unet = _seeded(
        seed,
        lambda: diffusers.UNet2DModel(
            sample_size=32,
            in_channels=3,
            out_channels=3,
            down_block_types=("DownBlock2D", "AttnDownBlock2D"),
            up_block_types=("AttnUpBlock2D", "UpBlock2D"),
            block_out_channels=(16, 32),
            layers_per_block=1,
            norm_num_groups=8,
            attention_head_dim=8,
        ),
    )
    # DDIMPipeline turns any scheduler into DDIM; build one directly (DDPM's schedule).
    scheduler = diffusers.DDIMScheduler(
        num_train_timesteps=1000, beta_schedule="linear", prediction_type="epsilon"
    )
    return diffusers.DDIMPipeline(unet=unet, scheduler=scheduler)


def _build_wan(seed: int) -> Any:
    """WanPipeline: 2-layer video DiT (patch 1x2x2), a UMT5 encoder, the Wan VAE (8x, 4x)."""
    diffusers = _diffusers()
    transformers = _transformers()

    transformer = _seeded(
        seed,
        lambda: diffusers.WanTransformer3DModel(
            patch_size=(1, 2, 2),
            num_attention_heads=2,
            attention_head_dim=12,
            in_channels=16,
            out_channels=16,
            text_dim=32,  # the UMT5 d_model
            freq_dim=32,
            ffn_dim=32,
            num_layers=2,
            cross_attn_norm=True,
            qk_norm="rms_norm_across_heads",
            rope_max_seq_len=32,
        ),
    )
    # Three downsamplings (spatial 8x), two of them in time too (temporal 4x), as Wan 2.1's.
    vae = _seeded(
        seed,
        lambda: diffusers.AutoencoderKLWan(
            base_dim=8,
            z_dim=16,
            dim_mult=[1, 1, 1, 1],
            num_res_blocks=1,
            temperal_downsample=[False, True, True],
        ),
    )
    text_encoder = _seeded(seed, lambda: transformers.UMT5EncoderModel(t5_config("UMT5Config")))
    return diffusers.WanPipeline(
        tokenizer=t5_tokenizer(),
        text_encoder=text_encoder,
        vae=vae,
        # Wan 2.1 T2V's scheduler is UniPC (flow prediction, shift 5), whose
        # set_timesteps warns with numpy 2.4 (see _build_sd): flow-matching Euler.
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=5.0),
        transformer=transformer,
    )


def _build_wan_i2v(seed: int) -> Any:
    """WanImageToVideoPipeline: Wan 2.1 I2V's shape, tiny: the image's latents beside the
    noise (16 + 4 mask + 16 channels in) and a CLIP vision embedding as extra context."""
    diffusers = _diffusers()
    transformers = _transformers()
    t2v = _build_wan(seed)
    transformer = _seeded(
        seed,
        lambda: diffusers.WanTransformer3DModel(
            patch_size=(1, 2, 2),
            num_attention_heads=2,
            attention_head_dim=12,
            in_channels=36,
            out_channels=16,
            text_dim=32,
            freq_dim=32,
            ffn_dim=32,
            num_layers=2,
            cross_attn_norm=True,
            qk_norm="rms_norm_across_heads",
            rope_max_seq_len=32,
            image_dim=16,  # the CLIP vision hidden size
            added_kv_proj_dim=24,  # the transformer's width: image tokens get their own K, V
        ),
    )
    vision = transformers.CLIPVisionConfig(
        hidden_size=16,
        projection_dim=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=32,
        intermediate_size=16,
        patch_size=8,
    )
    image_encoder = _seeded(seed, lambda: transformers.CLIPVisionModel(vision))
    # The PIL processor by name where transformers has it (its default needs torchvision).
    processor = getattr(transformers, "CLIPImageProcessorPil", transformers.CLIPImageProcessor)(
        crop_size=32, size=32
    )
    return diffusers.WanImageToVideoPipeline(
        tokenizer=t2v.tokenizer,
        text_encoder=t2v.text_encoder,
        vae=t2v.vae,
        scheduler=t2v.scheduler,
        image_processor=processor,
        image_encoder=image_encoder,
        transformer=transformer,
    )


def _build_ltx_i2v(seed: int) -> Any:
    """LTXImageToVideoPipeline: ``ltx``'s parts (the image is VAE-encoded, no other encoder)."""
    t2v = _build_ltx(seed)
    return _diffusers().LTXImageToVideoPipeline(**t2v.components)


def _build_ltx(seed: int) -> Any:
    """LTXPipeline: 1-layer video DiT over packed tokens, T5, the LTX-Video VAE (8x, 8x)."""
    diffusers = _diffusers()
    transformers = _transformers()

    transformer = _seeded(
        seed,
        lambda: diffusers.LTXVideoTransformer3DModel(
            in_channels=8,
            out_channels=8,
            patch_size=1,
            patch_size_t=1,
            num_attention_heads=4,
            attention_head_dim=8,
            cross_attention_dim=32,
            num_layers=1,
            caption_channels=32,  # the T5 d_model
        ),
    )
    # Three space-time downsamplings: 8x in space and in time, as the real VAE's 32x
    # and 8x are in time; timestep-conditioned, as LTX-Video 0.9.1 and later.
    vae = _seeded(
        seed,
        lambda: diffusers.AutoencoderKLLTXVideo(
            in_channels=3,
            out_channels=3,
            latent_channels=8,
            block_out_channels=(8, 8, 8, 8),
            decoder_block_out_channels=(8, 8, 8, 8),
            layers_per_block=(1, 1, 1, 1, 1),
            decoder_layers_per_block=(1, 1, 1, 1, 1),
            spatio_temporal_scaling=(True, True, True, False),
            decoder_spatio_temporal_scaling=(True, True, True, False),
            decoder_inject_noise=(False,) * 5,
            upsample_residual=(False,) * 4,
            upsample_factor=(1,) * 4,
            timestep_conditioning=True,
            patch_size=1,
            patch_size_t=1,
            encoder_causal=True,
            decoder_causal=False,
        ),
    )
    text_encoder = _seeded(seed, lambda: transformers.T5EncoderModel(t5_config()))
    # LTX-Video 0.9.x's scheduler config.
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000,
        shift=1.0,
        use_dynamic_shifting=True,
        base_shift=0.95,
        max_shift=2.05,
        base_image_seq_len=1024,
        max_image_seq_len=4096,
        shift_terminal=0.1,
    )
    return diffusers.LTXPipeline(
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=t5_tokenizer(),
        transformer=transformer,
    )
