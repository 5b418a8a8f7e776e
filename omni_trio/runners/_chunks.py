"""Decodes in chunks (L72): one image of a batch at a time, tiles, temporal chunks.

Every chunk is a call of the VAE's ``decoder``, before which ``DiffusersRunner``'s
cancel-point hook sits (see ``_cancel``), so an abort during a long decode lands
within one chunk. Three kinds of chunk:

- slices: a batch of N decodes one row at a time, by a loop of our own (what the
  VAE's ``enable_slicing()`` does, without changing the VAE);
- tiles: a frame larger than ``tile_above`` pixels decodes through the VAE's own
  tiled decode (``enable_tiling()``: overlapping tiles, blended), which changes the
  pixels a little (docs/runners.md gives the measured difference);
- temporal chunks: a video of more than ``framewise_above`` frames decodes through
  the VAE's framewise decoding (LTX-Video's ``use_framewise_decoding``: overlapping
  chunks of latent frames, blended), which changes the pixels too.

Tiling and framewise decoding are the VAE's flags. They are set for one decode
only, under the VAE's lock (which every encode and decode of the runners takes,
and every change of its dtype, so no other call sees them), and put back in a
``finally``: a decode left at a cancel point leaves the VAE as it found it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from ._locks import object_lock as vae_lock

__all__ = ["DecodeChunks", "vae_lock"]


@contextmanager
def _flags(vae: Any, names: list[str]) -> Iterator[None]:
    """Turn the VAE's boolean flags ``names`` on for the block; put them back after."""
    previous = {name: getattr(vae, name) for name in names}
    try:
        for name in names:
            setattr(vae, name, True)
        yield
    finally:
        for name, value in previous.items():
            setattr(vae, name, value)


@dataclass(frozen=True, slots=True, kw_only=True)
class DecodeChunks:
    """How a ``DiffusersRunner`` splits a decode into chunks (L72).

    Args:
        slices: decode a batch of N one row at a time (exactly the VAE's sliced decode).
        tile_above: decode a frame of more pixels (height x width) than this in tiles,
            where the VAE can (``use_tiling``); ``None``: never.
        framewise_above: decode a video of more frames than this in temporal chunks,
            where the VAE can (``use_framewise_decoding``, LTX-Video); ``None``: never.

    Raises:
        ValueError: a threshold below 1.
    """

    slices: bool = True
    tile_above: int | None = 1024 * 1024
    framewise_above: int | None = None

    def __post_init__(self) -> None:
        for name in ("tile_above", "framewise_above"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or value < 1):
                raise ValueError(f"{name}: must be None or a positive int, got {value!r}")

    def flags(self, vae: Any, *, pixels: int, frames: int | None) -> list[str]:
        """The VAE flags a decode of frames of ``pixels`` (and ``frames`` frames) turns on."""
        names: list[str] = []
        if self.tile_above is not None and pixels > self.tile_above and hasattr(vae, "use_tiling"):
            names.append("use_tiling")
        if (
            self.framewise_above is not None
            and frames is not None
            and frames > self.framewise_above
            and hasattr(vae, "use_framewise_decoding")
        ):
            names.append("use_framewise_decoding")
        return names

    def decode(
        self,
        vae: Any,
        decode: Callable[[slice], torch.Tensor],
        *,
        rows: int,
        pixels: int,
        frames: int | None = None,
    ) -> torch.Tensor:
        """``decode(rows)`` over the batch's ``rows``, in chunks; the VAE's raw output, joined.

        ``decode`` decodes the rows a slice selects (the latents' and any per-row input's).

        Raises:
            StopRun: from a cancel point between chunks; the VAE's flags are put back.
        """
        with vae_lock(vae), _flags(vae, self.flags(vae, pixels=pixels, frames=frames)):
            if not self.slices or rows == 1:
                return decode(slice(None))
            return torch.cat([decode(slice(row, row + 1)) for row in range(rows)])
