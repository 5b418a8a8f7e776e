"""A diffusers runner under a result cache (L95): it names its model, and a repeat of a
request is its earlier output without a model call.

Determinism: tiny pipelines with seeded random weights on the CPU; requests one after
another; whether a request ran is read from the runner's counters. A hang budget each.
"""

from __future__ import annotations

import anyio
import pytest
import torch

import omni_trio as ot
from omni_trio.runners import DiffusersRunner, tiny_pipeline
from omni_trio.runners._spec import set_attention_backend
from tests.support.core import BUDGET


def test_a_diffusers_runner_names_its_weights_dtypes_backends_and_decodes() -> None:
    """L95: the same weights give the same fingerprint; other weights, another dtype of
    one model, an attention backend set, or another decode tiling give another."""
    fingerprint = DiffusersRunner(tiny_pipeline("sd")).result_fingerprint()
    assert DiffusersRunner(tiny_pipeline("sd")).result_fingerprint() == fingerprint
    assert DiffusersRunner(tiny_pipeline("sd", seed=1)).result_fingerprint() != fingerprint
    assert DiffusersRunner(tiny_pipeline("sd"), tile_above=64).result_fingerprint() != fingerprint
    widened = tiny_pipeline("sd")
    widened.vae.to(torch.float64)
    assert DiffusersRunner(widened).result_fingerprint() != fingerprint
    flux = DiffusersRunner(tiny_pipeline("flux")).result_fingerprint()
    native = tiny_pipeline("flux")
    set_attention_backend(native, "native")
    assert DiffusersRunner(native).result_fingerprint() != flux


@pytest.mark.anyio
async def test_a_repeat_on_a_tiny_model_is_its_earlier_output_without_a_model_call() -> None:
    """L95: on tiny Stable Diffusion a seeded repeat equals the first output bytewise and
    the runner decodes nothing more."""
    runner = DiffusersRunner(tiny_pipeline("sd"))
    request = ot.GenerationRequest(prompt="a lighthouse", num_steps=2, height=32, width=32, seed=3)
    config = ot.EngineConfig(result_cache=ot.ResultCache(max_bytes=1 << 20))
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner, config) as engine:
            first = await engine.generate(request)
            again = await engine.generate(request)
    assert runner.decodes == 1 and again.metrics.result_cache_hit
    assert again.images.numpy().tobytes() == first.images.numpy().tobytes()
