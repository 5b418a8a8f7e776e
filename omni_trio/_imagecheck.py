"""The output contract: what a runner's images must be before the engine hands them out.

A video request's decode is checked the same way as ``[N, F, C, H, W]``, ``F`` its
``num_frames`` (``checked_video``): every frame keeps the image contract.

Images (from ``decode``) and previews are float tensors ``[N, C, H, W]`` with ``N``
the request's ``num_images``, ``C`` 1 (grey), 3 (RGB) or 4 (RGBA), and values in
[0, 1], no NaN. For images, ``H`` and ``W`` are the request's ``height`` and
``width``; a preview may be any size. Any floating dtype, on any device: the engine
hands out a plain CPU ``float32`` tensor (a tensor subclass is not handed on).

``checked_images`` checks all of it in the engine's own threads, never on the event
loop, with one pass over the pixels (``torch.aminmax``, which also propagates
NaN). A violation raises ``InvalidOutputError`` naming what was wrong; the request
then fails with ``RequestFailedError`` and the output is never delivered.

Values at most ``PIXEL_SLACK`` outside [0, 1] (rounding in a runner's last
operations, as 1.0000001) are clamped, not refused: the slack is under half an
8-bit level, so clamping changes no pixel of an 8-bit image. Farther is a runner
bug (a missing clamp or denormalization) and is refused.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ._errors import InvalidOutputError

if TYPE_CHECKING:
    import torch

__all__ = ["CHANNELS", "PIXEL_SLACK", "OutputViolation", "checked_images", "checked_video"]

#: How far outside [0, 1] a value may be and still be clamped (under 1/510).
PIXEL_SLACK = 1 / 512
#: The channel counts an image may have: grey, RGB, RGBA.
CHANNELS = (1, 3, 4)


class OutputViolation(InvalidOutputError):
    """Raised by ``checked_images`` itself, so its message is the engine's own text.

    A runner may raise ``InvalidOutputError`` (or a subclass) too; only this class
    is trusted to format safely (see ``_failure.failure``).
    """


def checked_images(
    value: object, *, call: str, count: int, size: tuple[int, int] | None, own: bool = False
) -> torch.Tensor:
    """Return ``value`` as a plain CPU float32 tensor if it keeps the output contract.

    Args:
        value: what the runner's ``call`` returned.
        call: the runner call, named in the message (``"decode"``, ``"preview"``).
        count: the number of images expected (the request's ``num_images``).
        size: the expected ``(height, width)``; ``None`` for any non-empty size (previews).
        own: return memory the runner does not hold (a copy where no conversion made
            one): for previews, which a runner may make as a view of its live latents.

    Returns:
        The images, without a copy when they are a CPU float32 tensor already
        (a copy when values within ``PIXEL_SLACK`` had to be clamped).

    Raises:
        InvalidOutputError: not a tensor, not dense, not floating point, a wrong
            shape, NaN, or values outside [0, 1] beyond the slack.
    """
    said = f"the runner's {call} returned"
    images = _plain(value, said, "images")
    shape = tuple(images.shape)
    channels = shape[1] if len(shape) == 4 and shape[1] in CHANNELS else 3
    expected = (count, channels, *size) if size is not None else (count, channels)
    empty = len(shape) == 4 and 0 in shape[2:]
    if len(shape) != 4 or shape[1] not in CHANNELS or shape[: len(expected)] != expected or empty:
        wanted = str(expected) if size is not None else f"({count}, {channels}, height, width)"
        if len(shape) == 4 and shape[1] not in CHANNELS:
            wanted += " (1, 3 or 4 channels)"
        elif empty:
            wanted += " (not empty)"
        raise OutputViolation(f"{said} images of shape {shape}, expected {wanted}")
    return _in_range(images, said, own=own)


def checked_video(
    value: object, *, call: str, count: int, frames: int, size: tuple[int, int]
) -> torch.Tensor:
    """Return ``value`` as a plain CPU float32 tensor if it keeps the video contract (L70).

    A video is ``[count, frames, C, H, W]``: ``count`` videos of ``frames`` frames,
    each frame an image of the contract of ``checked_images``.

    Args:
        value: what the runner's ``call`` returned.
        call: the runner call, named in the message (``"decode"``).
        count: the number of videos expected (the request's ``num_images``).
        frames: the frames each has (the request's ``num_frames``).
        size: the expected ``(height, width)``.

    Returns:
        The videos, without a copy when they are a CPU float32 tensor already.

    Raises:
        InvalidOutputError: as ``checked_images``, for a video's shape.
    """
    said = f"the runner's {call} returned"
    videos = _plain(value, said, "videos")
    shape = tuple(videos.shape)
    channels = shape[2] if len(shape) == 5 and shape[2] in CHANNELS else 3
    expected = (count, frames, channels, *size)
    if shape != expected:
        wanted = str(expected)
        if len(shape) == 5 and shape[2] not in CHANNELS:
            wanted += " (1, 3 or 4 channels)"
        raise OutputViolation(f"{said} videos of shape {shape}, expected {wanted}")
    return _in_range(videos, said, own=False, what="videos")


def _plain(value: object, said: str, what: str) -> torch.Tensor:
    """``value`` as a plain, dense, floating-point tensor (an alias, no copy)."""
    import torch

    if not isinstance(value, torch.Tensor):
        raise OutputViolation(f"{said} a {type(value).__name__}, expected a torch.Tensor")
    tensor = value
    if type(tensor) is not torch.Tensor:
        # A plain tensor (an alias, no copy): a subclass's methods and its
        # __torch_function__ do not get to report on themselves.
        tensor = torch.Tensor.as_subclass(tensor, torch.Tensor)
    if tensor.layout is not torch.strided:
        raise OutputViolation(f"{said} {what} of layout {tensor.layout}, expected dense ones")
    if not tensor.is_floating_point():
        raise OutputViolation(
            f"{said} {what} of dtype {tensor.dtype}, expected a floating-point dtype"
        )
    return tensor


def _in_range(images: torch.Tensor, said: str, *, own: bool, what: str = "images") -> torch.Tensor:
    """``images`` on the CPU as float32, if finite and in [0, 1] (within ``PIXEL_SLACK``)."""
    import torch

    converted = images.detach().to(device="cpu", dtype=torch.float32)
    copied = converted.data_ptr() != images.data_ptr()
    images = converted
    low, high = (float(bound) for bound in torch.aminmax(images))
    if math.isnan(low) or math.isnan(high):
        raise OutputViolation(f"{said} {what} with NaN values")
    if low < 0.0 or high > 1.0:
        if low < -PIXEL_SLACK or high > 1.0 + PIXEL_SLACK:
            raise OutputViolation(
                f"{said} {what} with values from {low:.6g} to {high:.6g}, expected [0, 1]"
            )
        # Out of place: the tensor may still be the runner's own memory.
        return images.clamp(0.0, 1.0)
    return images.clone() if own and not copied else images
