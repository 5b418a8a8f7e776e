"""Decodes in chunks (L72): slices of a batch, tiles of a large image, LTX-Video chunks.

Tiny real models, one torch thread. Each chunk is one call of the VAE's decoder,
counted (or held) by a forward pre-hook on it (``ModuleGate``), so where an abort
lands is exact, with no timing. Slicing is exact against the VAE's own sliced
decode; tiling and framewise decoding are the VAE's own, so the test holds them equal
to the VAE's decode with its flag set by hand (the difference from an unchunked decode
is measured and stated in docs/runners.md, not asserted here), and the flag is put
back after every decode, a left one included.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import anyio
import pytest
import torch

import omni_trio as ot
from omni_trio.runners import DiffusersRunner, tiny_pipeline
from omni_trio.runners._chunks import DecodeChunks
from tests.support.core import BUDGET
from tests.support.runners import ModuleGate, abort_inside, request, tiny

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@cache
def sd_pipe() -> Any:
    return tiny_pipeline("sd")


def image_request(**fields: Any) -> ot.GenerationRequest:
    values: dict[str, Any] = {
        "prompt": "a red flower",
        "num_steps": 2,
        "height": 64,
        "width": 64,
        "seed": 3,
    }
    values.update(fields)
    return ot.GenerationRequest(**values)


def decoded(pipe: Any, r: ot.GenerationRequest, **options: Any) -> tuple[torch.Tensor, int]:
    """``r`` run by a ``DiffusersRunner(pipe, **options)`` alone; its output and decoder calls."""
    runner = DiffusersRunner(pipe, **options)
    counter = ModuleGate(pipe.vae.decoder, at=0)
    try:
        state = runner.prepare(r, "r")
        for _ in range(r.num_steps):
            runner.step([state])
        output = runner.decode(state)
        runner.discard(state)
    finally:
        counter.remove()
        runner.close()
    return output, counter.calls


def with_vae_flag(pipe: Any, name: str, r: ot.GenerationRequest) -> torch.Tensor:
    """``r`` decoded in one batch with the VAE's own flag ``name`` set by hand."""
    setattr(pipe.vae, name, True)
    try:
        output, _ = decoded(pipe, r, decode_slices=False, tile_above=None)
    finally:
        setattr(pipe.vae, name, False)
    return output


def test_a_batch_decodes_one_image_at_a_time_exactly() -> None:
    """L72: a request for two images decodes them one at a time (two decoder calls),
    bitwise as the VAE's own sliced decode, and within float rounding of one batched call.
    """
    pipe = sd_pipe()
    r = image_request(num_images=2)
    sliced, calls = decoded(pipe, r)
    batched, batched_calls = decoded(pipe, r, decode_slices=False)
    assert (calls, batched_calls) == (2, 1)
    assert torch.equal(sliced, with_vae_flag(pipe, "use_slicing", r))
    torch.testing.assert_close(sliced, batched, rtol=0, atol=1e-5)
    assert not pipe.vae.use_slicing


def test_a_large_image_decodes_in_the_vaes_tiles_only_past_the_threshold() -> None:
    """L72: an image of more pixels than ``tile_above`` decodes in the VAE's own tiles (a
    3x3 grid for 128x128 with tiny SD's 64-pixel tiles: nine decoder calls), equal to the
    VAE's ``use_tiling`` decode, its flag off again after; at the threshold, one call,
    equal to the default runner's decode.
    """
    pipe = sd_pipe()
    r = image_request(height=128, width=128)
    tiled, calls = decoded(pipe, r, tile_above=64 * 64)
    assert calls == 9
    assert not pipe.vae.use_tiling
    assert torch.equal(tiled, with_vae_flag(pipe, "use_tiling", r))
    whole, whole_calls = decoded(pipe, r, tile_above=128 * 128)
    assert whole_calls == 1
    assert torch.equal(whole, decoded(pipe, r)[0])
    assert not torch.equal(whole, tiled)  # tiling blends: the documented difference


def test_a_long_ltx_video_decodes_in_temporal_chunks_only_past_the_threshold() -> None:
    """L72: an LTX-Video of more frames than ``framewise_above`` decodes in the VAE's own
    temporal chunks (33 frames, 5 latent frames: five decoder calls), equal to its
    ``use_framewise_decoding`` decode, the flag off again after; at the threshold, and by
    default, one call.
    """
    pipe = tiny("ltx")
    r = request("ltx", num_frames=33, num_steps=2)
    chunked, calls = decoded(pipe, r, framewise_above=16)
    assert calls == 5
    assert not pipe.vae.use_framewise_decoding
    assert torch.equal(chunked, with_vae_flag(pipe, "use_framewise_decoding", r))
    whole, whole_calls = decoded(pipe, r, framewise_above=33)
    default, default_calls = decoded(pipe, r)
    assert (whole_calls, default_calls) == (1, 1)
    assert torch.equal(whole, default)


@pytest.mark.anyio
async def test_an_abort_during_a_sliced_decode_lands_before_the_next_image() -> None:
    """L72: a request for two images aborted while its first image decodes: the decode is
    left before the second (one decoder call), the request released undecoded, and the
    next request's images are bitwise a fresh engine's.
    """
    pipe = sd_pipe()
    first = image_request(num_images=2, num_steps=3)
    after = image_request(num_images=2, prompt="after", seed=5)
    with anyio.fail_after(BUDGET):
        gate, runner, handle, output, fresh = await abort_inside(
            lambda sd: sd.vae.decoder, 1, pipe=pipe, first=first, after=after
        )
    assert gate.calls == 1
    assert handle.status is ot.RequestStatus.ABORTED
    assert handle.metrics is not None and handle.metrics.steps_done == 3
    assert runner.decodes == 2  # begun: the aborted one's (left) and the next one's
    assert torch.equal(output.images, fresh.images)


@pytest.mark.anyio
async def test_an_abort_during_a_chunked_ltx_decode_lands_before_the_next_chunk() -> None:
    """L72: a 33-frame LTX-Video decoded in temporal chunks, aborted while chunk 2 runs:
    the decode is left before chunk 3, the VAE's framewise flag is off again, and the next
    video is bitwise a fresh engine's.
    """
    pipe = tiny("ltx")
    first = request("ltx", num_frames=33, num_steps=2)
    after = request("ltx", num_frames=33, num_steps=2, prompt="after", seed=3)
    with anyio.fail_after(BUDGET):
        gate, runner, handle, output, fresh = await abort_inside(
            lambda ltx: ltx.vae.decoder, 2, pipe=pipe, first=first, after=after, framewise_above=16
        )
    assert gate.calls == 2
    assert runner.decodes == 2  # begun: the aborted one's (left) and the next one's
    assert not pipe.vae.use_framewise_decoding
    assert handle.status is ot.RequestStatus.ABORTED
    assert handle.metrics is not None and handle.metrics.steps_done == 2
    assert output.video is not None and fresh.video is not None
    assert torch.equal(output.video, fresh.video)


@pytest.mark.parametrize("field", ["tile_above", "framewise_above"])
@pytest.mark.parametrize("value", [0, -1, True])
def test_a_threshold_below_one_is_refused_by_name(field: str, value: int) -> None:
    """L72: the chunk thresholds are None or positive ints."""
    options: dict[str, Any] = {field: value}
    with pytest.raises(ValueError, match=field):
        DecodeChunks(**options)
    with pytest.raises(ValueError, match=field):
        DiffusersRunner(sd_pipe(), **options)
