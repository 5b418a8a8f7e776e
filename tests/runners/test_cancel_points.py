"""Cancel points (L71, L72) in real models: every family's hooks, a decode left mid-way.

Tiny Wan, where a test hook holds one VAE decoder call in the materializer's thread
while the test aborts the request, so the abort lands at a known place without any
timing; then the next request must equal a fresh engine's, bitwise (one torch
thread). A step of every family left inside a block is the conformance suite's
(test_conformance.py). The engine's side, with fake runners, is tests/test_cancel_points.py.
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest
import torch

import omni_trio as ot
from omni_trio.runners import DiffusersRunner, tiny_pipeline
from omni_trio.runners._cancel import hooked
from tests.support.core import BUDGET, req
from tests.support.runners import abort_inside


@pytest.mark.anyio
@pytest.mark.usefixtures("one_torch_thread")
async def test_a_wan_decode_is_left_at_the_next_latent_frame() -> None:
    """L72: a tiny Wan video (3 latent frames) aborted while its VAE decodes latent frame
    2: the decode is left before frame 3, the VAE's feature cache is cleared, the request
    is released undecoded, and the next video is bitwise a fresh engine's.
    """
    with anyio.fail_after(BUDGET):
        gate, runner, handle, output, fresh = await abort_inside(lambda wan: wan.vae.decoder, at=2)
    assert gate.calls == 2
    assert runner.decodes == 2  # begun: the aborted one's (left) and the next one's
    assert handle.status is ot.RequestStatus.ABORTED
    assert handle.metrics is not None and handle.metrics.steps_done == 3
    assert output.video is not None and fresh.video is not None
    assert torch.equal(output.video, fresh.video)


EXPECTED_BLOCKS = {
    "sd": ("unet", ("down_blocks", "mid_block", "up_blocks")),
    "sdxl": ("unet", ("down_blocks", "mid_block", "up_blocks")),
    "unet": ("unet", ("down_blocks", "mid_block", "up_blocks")),
    "sd3": ("transformer", ("transformer_blocks",)),
    "flux": ("transformer", ("transformer_blocks", "single_transformer_blocks")),
    "qwen-image": ("transformer", ("transformer_blocks",)),
    "wan": ("transformer", ("blocks",)),
    "ltx": ("transformer", ("transformer_blocks",)),
}


@pytest.mark.parametrize("kind", list(EXPECTED_BLOCKS))
def test_every_family_hooks_its_blocks_and_decoder_once(kind: str) -> None:
    """L71, L72: a DiffusersRunner declares cancel_points and hooks every block of its
    denoiser and its VAE's decoder (if it has a VAE), once however many runners share
    the pipeline; the last runner's close removes the hooks.
    """
    pipeline = tiny_pipeline(kind)
    denoiser_name, attributes = EXPECTED_BLOCKS[kind]
    denoiser = getattr(pipeline, denoiser_name)
    blocks: list[torch.nn.Module] = []
    for attribute in attributes:
        value = getattr(denoiser, attribute)
        blocks += list(value) if isinstance(value, torch.nn.ModuleList) else [value]
    vae = getattr(pipeline, "vae", None)
    expected = blocks + ([vae.decoder] if vae is not None else [])
    first, second = DiffusersRunner(pipeline), DiffusersRunner(pipeline)
    assert first.capabilities.cancel_points
    assert first.cancel_point_count == len(expected)
    for module in expected:
        assert hooked(module) and len(module._forward_pre_hooks) == 1
    first.close()
    assert all(hooked(module) for module in expected)
    second.close()
    assert not any(hooked(module) or module._forward_pre_hooks for module in expected)


# UNet2DModel's own forward reads ``self.dtype`` (diffusers' code, not the family's).
@pytest.mark.parametrize("kind", [kind for kind in EXPECTED_BLOCKS if kind != "unet"])
def test_a_step_reads_no_models_dtype(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """L71: nothing in a step walks the model's parameters before the first cancel point.

    diffusers' ``ModelMixin.dtype`` walks every parameter (about 9 ms a call on a
    105-block Wan transformer on this CPU): read in a step, it ran before the first
    block, where no cancel point is. The families read it at prepare only. (The
    unconditional UNet2DModel's own forward reads it: not ours to change.)
    """
    from diffusers import ModelMixin

    pipeline = tiny_pipeline(kind)
    runner = DiffusersRunner(pipeline)
    fields: dict[str, Any] = {"num_frames": 5} if kind in ("wan", "ltx") else {}
    state = runner.prepare(req(height=64, width=64, num_steps=2, **fields), "r")
    reads = 0
    original = ModelMixin.dtype

    def counted(self: Any) -> torch.dtype:
        nonlocal reads
        reads += 1
        value: torch.dtype = original.fget(self)
        return value

    monkeypatch.setattr(ModelMixin, "dtype", property(counted))
    try:
        runner.step([state])
    finally:
        monkeypatch.undo()
        runner.discard(state)
        runner.close()
    assert reads == 0
