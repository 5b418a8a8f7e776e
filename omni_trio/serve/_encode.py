"""Images to PNG/JPEG/WebP bytes, a trajectory to safetensors bytes, base64 text of them.

Encoding is tensor work: small images (the previews, test sizes) are encoded in
the event loop's thread, where it costs well under a millisecond; larger ones go
to a worker thread, which returns only ``bytes`` (a thread-cache worker that
returns a tensor can abort the interpreter at exit; see the design notes).
"""

from __future__ import annotations

import base64
import dataclasses
import io
from typing import TYPE_CHECKING

import anyio.lowlevel
import anyio.to_thread

if TYPE_CHECKING:
    import torch

    from .._sampling import Trajectory

__all__ = ["b64", "encode_images", "encode_images_sync", "encode_trajectory"]

#: Pixels (summed over the images) encoded in the loop's thread; above this a worker
#: thread encodes. Measured on the 2-core CI machine, PNG of RGB noise (the worst
#: case): 64x64 about 1 ms, 128x128 1.5 ms, 256x256 7 ms, 512x512 28 ms.
INLINE_PIXELS = 64 * 64

_PIL_FORMATS = {"png": "PNG", "jpeg": "JPEG", "webp": "WEBP"}


def encode_images_sync(images: torch.Tensor, fmt: str, quality: int | None) -> list[bytes]:
    """Encode ``[N, C, H, W]`` images in [0, 1] (C = 1, 3 or 4) as ``fmt`` files."""
    import torch
    from PIL import Image

    array = None
    try:
        array = (
            (images.detach().float().clamp(0, 1) * 255)
            .round()
            .to(torch.uint8)
            .permute(0, 2, 3, 1)
            .contiguous()
            .cpu()
            .numpy()
        )
        encoded: list[bytes] = []
        for pixels in array:
            channels = pixels.shape[-1]
            # A 2-D array becomes an "L" image, [H, W, 3] "RGB", [H, W, 4] "RGBA".
            if channels == 1:
                image = Image.fromarray(pixels[..., 0])
            elif channels == 4 and fmt != "jpeg":
                image = Image.fromarray(pixels)
            else:
                image = Image.fromarray(pixels[..., :3])
            out = io.BytesIO()
            options: dict[str, int] = (
                {} if quality is None or fmt == "png" else {"quality": quality}
            )
            image.save(out, format=_PIL_FORMATS[fmt], **options)
            encoded.append(out.getvalue())
        return encoded
    finally:
        # Nothing tensor-backed outlives the call in a worker thread's frame.
        del array


async def encode_images(images: torch.Tensor, fmt: str, quality: int | None) -> list[bytes]:
    """Encode images like ``encode_images_sync``, in a worker thread when they are large.

    Cancellation:
        A cancelled caller waits for a started worker thread to finish (it is
        never abandoned), then the cancellation propagates.
    """
    pixels = images.shape[0] * images.shape[-1] * images.shape[-2]
    if pixels <= INLINE_PIXELS:
        await anyio.lowlevel.checkpoint()
        return encode_images_sync(images, fmt, quality)
    return await anyio.to_thread.run_sync(encode_images_sync, images, fmt, quality)


def b64(data: bytes) -> str:
    """Base64 text of ``data``."""
    return base64.b64encode(data).decode("ascii")


def _trajectory_b64(trajectory: Trajectory, image: int | None) -> str:
    if image is not None:
        rows = slice(image, image + 1)
        trajectory = dataclasses.replace(
            trajectory,
            latents=trajectory.latents[rows],
            noise=trajectory.noise[rows],
            log_probs=trajectory.log_probs[rows],
        )
    return b64(trajectory.to_safetensors())


async def encode_trajectory(trajectory: Trajectory, image: int | None = None) -> str:
    """A trajectory (L100) as base64 text of its safetensors bytes
    (``Trajectory.to_safetensors``), in a worker thread: a real model's is megabytes
    per step.

    Args:
        trajectory: the request's trajectory.
        image: only this image's rows (its ``latents``, ``noise`` and ``log_probs``;
            the steps' tensors are the request's), for a stream's ``completed`` event;
            ``None``: every image's.

    Cancellation:
        As ``encode_images``: a started worker thread finishes first.
    """
    return await anyio.to_thread.run_sync(_trajectory_b64, trajectory, image)
