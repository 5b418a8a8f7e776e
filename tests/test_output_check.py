"""The output contract: a runner's bad images or previews fail the request, never reach it.

An image batch is a float tensor ``[N, C, H, W]``, ``N`` the request's
``num_images``, ``C`` 1, 3 or 4, ``H`` x ``W`` the request's size, in [0, 1], no
NaN; the engine hands out a plain CPU float32 tensor. Values within
``PIXEL_SLACK`` of [0, 1] are clamped; anything else that breaks the contract
fails the request with ``RequestFailedError`` whose cause is an
``InvalidOutputError`` naming what was wrong (L22).

Determinism: ``GatedRunner`` subclasses that spoil the output of the request "bad"
only; for previews the gate opens once the consumer reads (previews are made only
for a reader, L18); the unit tests call ``checked_images`` directly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio
import numpy as np
import pytest
import torch

import omni_trio as ot
from omni_trio._imagecheck import PIXEL_SLACK, checked_images
from omni_trio.testing import FakeRunner, FakeState, GatedRunner, assert_engine_idle, wait_until
from tests.support.core import BUDGET, read_gated, req, solo_images

Spoil = Callable[[torch.Tensor], Any]

TWO = {"num_images": 2, "height": 16, "width": 16}


def nan_at_one_pixel(images: torch.Tensor) -> torch.Tensor:
    images = images.clone()
    images[1, 2, 1, 1] = float("nan")
    return images


def at_one_pixel(value: float) -> Spoil:
    def spoil(images: torch.Tensor) -> torch.Tensor:
        images = images.clone()
        images[0, 0, 0, 0] = value
        return images

    return spoil


# What the runner's decode returns instead of the [2, 3, 16, 16] images, and the
# message (after "the runner's decode returned ") that says what was wrong.
BAD_IMAGES: dict[str, tuple[Spoil, str]] = {
    "smaller": (
        lambda images: torch.rand(1, 3, 8, 8),
        "images of shape (1, 3, 8, 8), expected (2, 3, 16, 16)",
    ),
    "fewer": (lambda images: images[:1], "images of shape (1, 3, 16, 16), expected (2, 3, 16, 16)"),
    "narrower": (
        lambda images: images[..., :8],
        "images of shape (2, 3, 16, 8), expected (2, 3, 16, 16)",
    ),
    "two_channels": (
        lambda images: images[:, :2],
        "images of shape (2, 2, 16, 16), expected (2, 3, 16, 16) (1, 3 or 4 channels)",
    ),
    "three_dims": (
        lambda images: images[0],
        "images of shape (3, 16, 16), expected (2, 3, 16, 16)",
    ),
    "uint8": (
        lambda images: (images * 255).to(torch.uint8),
        "images of dtype torch.uint8, expected a floating-point dtype",
    ),
    "int64": (
        lambda images: images.to(torch.int64),
        "images of dtype torch.int64, expected a floating-point dtype",
    ),
    "bool": (
        lambda images: images > 0.5,
        "images of dtype torch.bool, expected a floating-point dtype",
    ),
    "complex": (
        lambda images: images.to(torch.complex64),
        "images of dtype torch.complex64, expected a floating-point dtype",
    ),
    "nan": (nan_at_one_pixel, "images with NaN values"),
    "inf": (at_one_pixel(float("inf")), "images with values from"),
    "minus_inf": (at_one_pixel(float("-inf")), "images with values from -inf"),
    "above_one": (at_one_pixel(1.5), "images with values from"),
    "below_zero": (at_one_pixel(-0.01), "images with values from -0.01 to"),
    "list": (lambda images: images.tolist(), "a list, expected a torch.Tensor"),
    "numpy": (lambda images: images.numpy(), "a ndarray, expected a torch.Tensor"),
    "none": (lambda images: None, "a NoneType, expected a torch.Tensor"),
    "sparse": (
        lambda images: images.to_sparse(),
        "images of layout torch.sparse_coo, expected dense ones",
    ),
}


class SpoilingRunner(GatedRunner):
    """Spoils the decode (or preview) output of the request "bad" with ``spoil``.

    The gate is open from the start, except for previews: see ``read_gated``.
    """

    def __init__(self, spoil: Spoil, *, call: str = "decode") -> None:
        super().__init__()
        self.spoil = spoil
        self.call = call
        if call != "preview":
            self.open_gate()

    def decode(self, state: FakeState) -> Any:
        images = super().decode(state)
        if self.call == "decode" and state.request_id == "bad":
            return self.spoil(images)
        return images

    def preview(self, state: FakeState) -> Any:
        preview = super().preview(state)
        if self.call == "preview" and state.request_id == "bad":
            return self.spoil(preview)
        return preview


async def fails_and_engine_serves_on(
    runner: SpoilingRunner, bad_request: ot.GenerationRequest, *, read: bool = False
) -> ot.RequestFailedError:
    """Run "bad" (reading its events if ``read``); return its error; check the engine after."""
    async with ot.open_engine(runner) as engine:
        async with engine.submit(bad_request, request_id="bad") as bad:
            if read:
                # The first step's preview is the bad one: no event is sent for it.
                assert await read_gated(bad, runner) == []
            with pytest.raises(ot.RequestFailedError) as info:
                await bad.result()
            assert bad.status is ot.RequestStatus.FAILED
        output = await engine.generate(req(**TWO))
        torch.testing.assert_close(output.images, solo_images(req(**TWO)))
        assert runner.live_states == 0
        assert_engine_idle(engine)
    return info.value


@pytest.mark.anyio
@pytest.mark.parametrize("case", sorted(BAD_IMAGES))
async def test_bad_images_fail_the_request_naming_the_violation(case: str) -> None:
    """L24: images that break the output contract are never delivered; the error says why."""
    spoil, said = BAD_IMAGES[case]
    with anyio.fail_after(BUDGET):
        failed = await fails_and_engine_serves_on(SpoilingRunner(spoil), req(**TWO))
    assert isinstance(failed.__cause__, ot.InvalidOutputError)
    assert str(failed).startswith(f"request 'bad' failed: the runner's decode returned {said}")
    assert str(failed.__cause__).startswith(f"the runner's decode returned {said}")


# A preview must be [N, C, h, w] (any h and w) in [0, 1] like an image.
BAD_PREVIEWS: dict[str, tuple[Spoil, str]] = {
    "nan": (nan_at_one_pixel, "images with NaN values"),
    "fewer": (
        lambda preview: preview[:1],
        "images of shape (1, 3, 2, 2), expected (2, 3, height, width)",
    ),
    "above_one": (lambda preview: preview + 1.0, "images with values from"),
    "not_a_tensor": (lambda preview: "a picture", "a str, expected a torch.Tensor"),
    "empty": (
        lambda preview: preview[..., :0],
        "images of shape (2, 3, 2, 0), expected (2, 3, height, width) (not empty)",
    ),
}


@pytest.mark.anyio
@pytest.mark.parametrize("case", sorted(BAD_PREVIEWS))
async def test_bad_previews_fail_the_request_naming_the_violation(case: str) -> None:
    """L18, L24: a preview that breaks the contract is never sent; the request fails."""
    spoil, said = BAD_PREVIEWS[case]
    runner = SpoilingRunner(spoil, call="preview")
    with anyio.fail_after(BUDGET):
        failed = await fails_and_engine_serves_on(runner, req(**TWO, preview_every=1), read=True)
    assert isinstance(failed.__cause__, ot.InvalidOutputError)
    assert str(failed).startswith(f"request 'bad' failed: the runner's preview returned {said}")


class PreviewlessRunner(FakeRunner):
    """Has previews, but none to show at any step."""

    def preview(self, state: FakeState) -> Any:
        return None


@pytest.mark.anyio
async def test_no_preview_at_a_step_is_allowed() -> None:
    """L18: a runner may return None for a preview; the events carry none, the request completes."""
    runner = PreviewlessRunner()
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner) as engine:
            async with engine.submit(req(preview_every=1), request_id="r") as handle:
                events = [event async for event in handle]
                assert [event.preview for event in events] == [None, None, None]
                await handle.result()


@pytest.mark.anyio
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
async def test_other_float_dtypes_are_delivered_as_float32(dtype: torch.dtype) -> None:
    """Any floating dtype is accepted; the consumer gets a plain CPU float32 tensor."""
    runner = SpoilingRunner(lambda images: images.to(dtype))
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner) as engine:
            output = await engine.generate(req(**TWO), request_id="bad")
    assert output.images.dtype is torch.float32
    expected = solo_images(req(**TWO)).to(dtype).float()
    assert torch.equal(output.images, expected)


class Marked(torch.Tensor):
    """A tensor subclass, as a runner might return."""


@pytest.mark.anyio
async def test_tensor_subclass_is_delivered_as_a_plain_tensor() -> None:
    """The engine hands out exactly ``torch.Tensor``, never a runner's subclass."""
    runner = SpoilingRunner(lambda images: images.as_subclass(Marked))
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner) as engine:
            output = await engine.generate(req(**TWO), request_id="bad")
    assert type(output.images) is torch.Tensor
    assert torch.equal(output.images, solo_images(req(**TWO)))


@pytest.mark.anyio
async def test_tiny_excursions_are_clamped_and_delivered() -> None:
    """Values within PIXEL_SLACK of [0, 1] are clamped: the images are delivered in [0, 1]."""

    def stray(images: torch.Tensor) -> torch.Tensor:
        images = images.clone()
        images[0, 0, 0, 0] = 1.0000001
        images[1, 1, 1, 1] = -PIXEL_SLACK / 2
        return images

    runner = SpoilingRunner(stray)
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner) as engine:
            output = await engine.generate(req(**TWO), request_id="bad")
    images = output.images
    assert (images[0, 0, 0, 0].item(), images[1, 1, 1, 1].item()) == (1.0, 0.0)
    assert images.min().item() >= 0.0 and images.max().item() <= 1.0


def test_checked_images_takes_no_copy_of_good_images() -> None:
    """A CPU float32 tensor in [0, 1] of the right shape is handed on as it is."""
    images = torch.rand(2, 3, 16, 16)
    out = checked_images(images, call="decode", count=2, size=(16, 16))
    assert out.data_ptr() == images.data_ptr()
    assert torch.equal(out, images)


def test_own_returns_memory_the_runner_does_not_hold() -> None:
    """Previews are checked with ``own``: a view of the runner's latents is copied."""
    latents = torch.rand(2, 3, 4, 4)
    out = checked_images(latents[:, :3], call="preview", count=2, size=None, own=True)
    assert out.data_ptr() != latents.data_ptr()
    latents.zero_()
    assert out.max().item() > 0.0
    # A conversion already makes a copy: no second one.
    half = torch.rand(1, 3, 4, 4, dtype=torch.float16)
    converted = checked_images(half, call="preview", count=1, size=None, own=True)
    assert converted.dtype is torch.float32


def test_clamping_leaves_the_runner_tensor_alone() -> None:
    """The clamp is out of place: the runner's own tensor keeps its values."""
    images = torch.full((1, 1, 4, 4), 0.5)
    images[0, 0, 0, 0] = 1 + PIXEL_SLACK
    out = checked_images(images, call="decode", count=1, size=(4, 4))
    assert out[0, 0, 0, 0].item() == 1.0
    assert images[0, 0, 0, 0].item() == pytest.approx(1 + PIXEL_SLACK)


@pytest.mark.parametrize("value", [1 + 2 * PIXEL_SLACK, -2 * PIXEL_SLACK])
def test_excursions_beyond_the_slack_are_refused(value: float) -> None:
    """Farther than PIXEL_SLACK outside [0, 1] is a runner bug, refused."""
    images = torch.full((1, 1, 4, 4), 0.5)
    images[0, 0, 1, 1] = value
    with pytest.raises(ot.InvalidOutputError, match=r"expected \[0, 1\]"):
        checked_images(images, call="decode", count=1, size=(4, 4))


@pytest.mark.parametrize("channels", [1, 3, 4])
def test_grey_rgb_and_rgba_are_images(channels: int) -> None:
    """C may be 1, 3 or 4 (what the HTTP encoder and ``to_pil`` take)."""
    images = torch.rand(1, channels, 8, 8)
    out = checked_images(images, call="decode", count=1, size=(8, 8))
    assert out.shape == (1, channels, 8, 8)


def test_check_needs_no_event_loop_and_rejects_numpy() -> None:
    """The check is plain code the engine's threads run; arrays are not tensors."""
    with pytest.raises(ot.InvalidOutputError, match=r"a ndarray, expected a torch\.Tensor"):
        checked_images(np.zeros((1, 3, 8, 8)), call="decode", count=1, size=(8, 8))


@pytest.mark.anyio
async def test_failed_output_is_counted_failed_and_its_metrics_set() -> None:
    """L17, L19: a refused output counts as failed, with metrics, and its state is released."""
    runner = SpoilingRunner(nan_at_one_pixel)
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner) as engine:
            async with engine.submit(req(**TWO), request_id="bad") as bad:
                with pytest.raises(ot.RequestFailedError):
                    await bad.result()
                assert bad.metrics is not None
                assert bad.metrics.steps_done == 3
            await wait_until(lambda: engine.statistics().failed == 1)
            stats = engine.statistics()
            assert (stats.failed, stats.completed, stats.running) == (1, 0, 0)
            assert runner.decodes == 1
            assert runner.live_states == 0
