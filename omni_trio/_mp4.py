"""The MP4 encoder: frames in [0, 1] to H.264 (``yuv420p``, what every player reads).

Used by ``GenerationOutput.save_video``; PyAV (the ``video`` extra) and torch are
imported only when a video is written, so the data module stays light.
"""

from __future__ import annotations

import math
import os
from fractions import Fraction
from typing import TYPE_CHECKING, BinaryIO

if TYPE_CHECKING:
    import torch

__all__ = ["write_mp4"]


def write_mp4(frames: torch.Tensor, target: str | os.PathLike[str] | BinaryIO, fps: float) -> None:
    """Write ``frames`` as an H.264 MP4: the same frames make the same bytes.

    Grey frames are written as RGB, an alpha channel is dropped.

    Args:
        frames: one video, a CPU float tensor ``[F, C, H, W]`` in [0, 1] (``C`` 1, 3
            or 4).
        target: the file to write (replaced if it exists), or a writable, seekable
            binary file object (``io.BytesIO``) to write the MP4 into.
        fps: frames per second, finite and > 0 (stored as an exact fraction, so
            24000/1001 can be given as ``Fraction(24000, 1001)``).

    Raises:
        ValueError: ``fps`` is out of range, or a side is odd (H.264's ``yuv420p``
            needs even sides).
        ImportError: PyAV is not installed.
    """
    if isinstance(fps, bool) or not math.isfinite(fps) or fps <= 0:
        raise ValueError(f"save_video: fps must be finite and > 0, got {fps!r}")
    height, width = frames.shape[-2:]
    if height % 2 or width % 2:
        raise ValueError(f"save_video: H.264 needs even sides, got {width}x{height}")
    try:
        import av
    except ImportError as exc:
        raise ImportError(
            "save_video needs PyAV: pip install 'omni_trio[video]' (or pip install av)"
        ) from exc
    import torch

    if frames.shape[1] == 1:
        frames = frames.expand(-1, 3, -1, -1)
    rgb = (frames[:, :3].clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1)
    rate = Fraction(fps).limit_denominator(1_000_000)
    path = os.fspath(target) if isinstance(target, str | os.PathLike) else target
    with av.open(path, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=rate)
        stream.width = int(width)
        stream.height = int(height)
        stream.pix_fmt = "yuv420p"
        # Without it x264 lets the CPU pick some of its algorithms, and the same frames
        # come out as different bytes now and then on a busy machine (measured: 5-7
        # variants in 15 encodes of one 480x832 video); with it, one.
        stream.options = {"x264-params": "cpu-independent=1"}
        for array in rgb.numpy():
            frame = av.VideoFrame.from_ndarray(array, format="rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))  # flush the encoder's delayed frames
