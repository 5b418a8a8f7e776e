"""Live previews (L18): a latent-to-RGB projection, microseconds, never a VAE decode.

Shared by ``DiffusersRunner`` and ``PipelineCallRunner``.
"""

from __future__ import annotations

import torch

__all__ = ["latent_preview"]

# A fixed latent-to-RGB projection for four-channel (Stable Diffusion 1.x/2.x)
# latents, the kind ComfyUI and InvokeAI use for live previews.
_SD_RGB_FACTORS = (
    (0.3512, 0.2297, 0.3227),
    (0.3250, 0.4974, 0.2350),
    (-0.2829, 0.1762, 0.2721),
    (-0.2120, -0.2616, -0.7177),
)


def _rgb_factors(channels: int) -> torch.Tensor:
    if channels == 4:
        return torch.tensor(_SD_RGB_FACTORS)
    # Any other latent space: each RGB channel averages every third latent
    # channel. Not tuned to a model (no measurement behind it): a cue of
    # progress, not a faithful colour.
    factors = torch.zeros(channels, 3)
    for channel in range(channels):
        factors[channel, channel % 3] = 3.0 / channels
    return factors


def latent_preview(latents: torch.Tensor) -> torch.Tensor:
    """A cheap RGB preview ``[N, 3, h, w]`` in [0, 1] of latents ``[N, C, h, w]``, on the CPU."""
    latents = latents.detach().float().cpu()
    rgb = torch.einsum("nchw,cr->nrhw", latents, _rgb_factors(latents.shape[1]))
    return ((rgb + 1) / 2).clamp(0, 1)
