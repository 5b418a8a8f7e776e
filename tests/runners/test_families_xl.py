"""What is SDXL's and Qwen-Image's own: how they map guidance, SDXL's guidance rescale.

What every family does (equal its ``__call__``, join mid-flight, resume exactly,
previews) is the conformance suite's (test_conformance.py).

Determinism: tiny pipelines with seeded weights; torch uses one thread.

Request mapping: SDXL takes ``guidance_scale`` and ``negative_prompt`` as its
``__call__`` does, and ``extra["guidance_rescale"]``; Qwen-Image takes
``guidance_scale`` as ``true_cfg_scale``, so it guides only with a negative prompt.
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest
import torch

import omni_trio as ot
from omni_trio.runners import DiffusersRunner
from omni_trio.serve import ServeConfig, Service
from omni_trio.serve._models import MODELS, TINY_SIZE, TINY_STEPS, load_model
from tests.support.core import BUDGET
from tests.support.runners import SIZE, reference, request, tiny
from tests.support.serve import PATH, png_size, serving

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("one_torch_thread")]

# (kind, request fields, whether classifier-free guidance runs)
# The suite's case (a negative prompt, guidance on) is not repeated here.
CASES = [
    ("sdxl", {}, True),  # no negative prompt: SDXL's zeroed negative embeddings
    ("sdxl", {"guidance_scale": 1.0}, False),
    ("sdxl", {"extra": {"guidance_rescale": 0.7}, "width": 48}, True),
    ("qwen-image", {"negative_prompt": " ", "num_images": 2}, True),
    ("qwen-image", {}, False),  # true CFG needs a negative prompt
    ("qwen-image", {"negative_prompt": "blurry", "guidance_scale": 1.0}, False),
]


@pytest.mark.parametrize(("kind", "fields", "cfg"), CASES)
async def test_guidance_follows_the_pipeline_call(
    kind: str, fields: dict[str, Any], cfg: bool
) -> None:
    """The runner guides exactly when __call__ does (SDXL without a negative prompt, Qwen-Image
    only with one), and the image equals the pipeline's own __call__ (1e-4).
    """
    r = request(kind, **fields)
    runner = DiffusersRunner(tiny(kind))
    with anyio.fail_after(BUDGET):
        state = runner.prepare(r, "probe")
        assert state.cfg is cfg
        runner.discard(state)
        async with ot.open_engine(runner) as engine:
            output = await engine.generate(r)
    torch.testing.assert_close(output.images, reference(kind, r), atol=1e-4, rtol=0)
    assert output.images.shape == (r.num_images, 3, r.height, r.width)


async def test_guidance_rescale_changes_the_sdxl_image() -> None:
    """extra["guidance_rescale"] reaches the guidance: 0.7 gives another image than 0."""
    runner = DiffusersRunner(tiny("sdxl"))
    assert runner.capabilities.extra_keys == {"guidance_rescale"}
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner) as engine:
            plain = await engine.generate(request("sdxl"))
            rescaled = await engine.generate(request("sdxl", extra={"guidance_rescale": 0.7}))
    assert float((plain.images - rescaled.images).abs().max()) > 1e-3


async def test_a_bad_guidance_rescale_fails_the_request() -> None:
    """A guidance_rescale outside [0, 1] fails its request at prepare; the engine serves on."""
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(DiffusersRunner(tiny("sdxl"))) as engine:
            with pytest.raises(ot.RequestFailedError):
                await engine.generate(request("sdxl", extra={"guidance_rescale": 2.0}))
            await engine.generate(request("sdxl", num_steps=1))
            assert engine.statistics().failed == 1


@pytest.mark.parametrize(("name", "guidance"), [("tiny-sdxl", 5.0), ("tiny-qwen-image", 4.0)])
async def test_serve_model_names_load_and_serve_the_tiny_pipelines(
    name: str, guidance: float
) -> None:
    """L50: serve --model tiny-sdxl / tiny-qwen-image loads the tiny pipeline at 64 px, the
    tiny step count and the guidance default of the __call__ parameter the family maps
    to, and serves an image of its default size.
    """
    assert name in MODELS
    size = SIZE[name.removeprefix("tiny-")]
    model = load_model(name, step_seconds=0.0)
    assert isinstance(model.runners[0], DiffusersRunner)
    assert model.runners[0].family == name.removeprefix("tiny-")
    assert (model.size, model.steps, model.guidance_scale) == (TINY_SIZE, TINY_STEPS, guidance)
    config = ServeConfig(
        model_name=model.name,
        default_width=size,
        default_height=size,
        default_steps=2,
        default_guidance_scale=model.guidance_scale,
    )
    with anyio.fail_after(BUDGET):
        async with serving(Service(model.runners[0], config=config)) as client:
            response = await client.post(PATH, json={"prompt": "a cat"})
    assert response.status_code == 200, response.text
    assert png_size(response.json()["data"][0]["b64_json"]) == (size, size)
