"""The tiny in-memory diffusers pipelines: real pipelines, seeded weights, eval mode.

Every test builds its pipelines from a seed (no download) and runs 2 denoise steps on CPU.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from omni_trio.runners._quiet import quiet_notices
from omni_trio.runners._tiny import TINY_KINDS, tiny_pipeline

PROMPTED = ("sd", "sd3", "flux")


def _generate(pipe: Any, kind: str, size: int, *, steps: int = 2) -> torch.Tensor:
    """Run a pipeline as the engine would, returning images as (batch, 3, H, W) in [0, 1]."""
    generator = torch.Generator().manual_seed(0)
    if kind == "unet":
        images = pipe(
            batch_size=1, num_inference_steps=steps, generator=generator, output_type="np"
        ).images
        assert isinstance(images, np.ndarray)
        return torch.from_numpy(images).permute(0, 3, 1, 2)
    extra: dict[str, Any] = {} if kind == "flux" else {"negative_prompt": "blurry"}
    images = pipe(
        "a prompt",
        num_inference_steps=steps,
        height=size,
        width=size,
        guidance_scale=5.0,
        generator=generator,
        output_type="pt",
        **extra,
    ).images
    assert isinstance(images, torch.Tensor)
    return images


def _modules(pipe: Any) -> dict[str, torch.nn.Module]:
    return {
        name: module
        for name, module in pipe.components.items()
        if isinstance(module, torch.nn.Module)
    }


def test_unknown_kind_lists_supported_kinds() -> None:
    """An unknown kind raises ValueError naming every supported kind."""
    with pytest.raises(ValueError, match="unknown tiny pipeline kind 'sd4'") as info:
        tiny_pipeline("sd4")
    assert all(kind in str(info.value) for kind in TINY_KINDS)


@pytest.mark.parametrize("kind", TINY_KINDS)
def test_every_module_eval_float32_cpu(kind: str) -> None:
    """Every module of the pipeline (and each submodule) is in eval mode, float32, on CPU."""
    pipe = tiny_pipeline(kind)
    modules = _modules(pipe)
    assert {"unet", "transformer"} & set(modules)
    for name, module in modules.items():
        assert not any(sub.training for sub in module.modules()), name
        for param in module.parameters():
            assert param.dtype == torch.float32, name
            assert param.device.type == "cpu", name


@pytest.mark.parametrize("size", [32, 64])
@pytest.mark.parametrize("kind", PROMPTED)
def test_prompted_kinds_generate(kind: str, size: int) -> None:
    """sd, sd3 and flux run their own __call__ at 32 and 64 px: right shape, in [0, 1]."""
    images = _generate(tiny_pipeline(kind), kind, size)
    assert images.shape == (1, 3, size, size)
    assert torch.isfinite(images).all()
    assert images.min() >= 0.0
    assert images.max() <= 1.0


def test_unet_generates_at_sample_size() -> None:
    """The unconditional kind generates images of the UNet's sample size, 32 px."""
    images = _generate(tiny_pipeline("unet"), "unet", 32)
    assert images.shape == (1, 3, 32, 32)
    assert images.min() >= 0.0
    assert images.max() <= 1.0


@pytest.mark.parametrize("kind", ["sd", "sd3"])
def test_default_size_is_64(kind: str) -> None:
    """Without height/width, sd and sd3 generate their default size, 64 px."""
    pipe: Any = tiny_pipeline(kind)
    images = pipe("a prompt", num_inference_steps=1, output_type="pt").images
    assert images.shape == (1, 3, 64, 64)


@pytest.mark.parametrize("kind", TINY_KINDS)
def test_same_seed_same_weights_and_images(kind: str) -> None:
    """Two builds with one seed have bit-identical weights and generate identical images."""
    first, second = tiny_pipeline(kind, seed=3), tiny_pipeline(kind, seed=3)
    for name, module in _modules(first).items():
        other = _modules(second)[name].state_dict()
        for key, value in module.state_dict().items():
            assert torch.equal(value, other[key]), f"{name}.{key}"
    assert torch.equal(_generate(first, kind, 32), _generate(second, kind, 32))


@pytest.mark.parametrize("kind", TINY_KINDS)
def test_different_seeds_different_weights(kind: str) -> None:
    """Different seeds give every model different weights."""
    first, second = tiny_pipeline(kind, seed=0), tiny_pipeline(kind, seed=1)
    for name, module in _modules(first).items():
        other = _modules(second)[name].state_dict()
        assert any(
            not torch.equal(value, other[key]) for key, value in module.state_dict().items()
        ), name


def test_global_rng_untouched() -> None:
    """Building seeds its own generator state: the caller's global RNG is left as it was."""
    torch.manual_seed(1234)
    expected = torch.rand(4)
    torch.manual_seed(1234)
    tiny_pipeline("flux", seed=7)
    assert torch.equal(torch.rand(4), expected)


NOTICE = (
    "`CLIPImageProcessor` requires torchvision (not installed); falling back to"
    " `CLIPImageProcessorPil` for backward compatibility."
)


class Collect(logging.Handler):
    """Keeps the messages it is handed."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_quiet_notices_drops_only_the_torchvision_notice_and_only_inside() -> None:
    """Inside quiet_notices (nested too) that one notice is dropped, nothing else; after, all."""
    logger = logging.getLogger("transformers.utils.import_utils")
    handler = Collect()
    filters, propagate = list(logger.filters), logger.propagate
    logger.addHandler(handler)
    logger.propagate = False
    try:
        with quiet_notices():
            with quiet_notices():
                logger.warning(NOTICE)
            logger.warning(NOTICE)
            logger.warning("another warning")
        assert logger.filters == filters
        logger.warning(NOTICE)
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate
    assert handler.messages == ["another warning", NOTICE]


def test_building_prints_nothing(tmp_path: Path) -> None:
    """A fresh process that builds every kind writes nothing on stderr (no notices, no bars)."""
    root = Path(__file__).resolve().parents[2]
    script = (
        "from omni_trio.runners import TINY_KINDS, tiny_pipeline\n"
        "for kind in TINY_KINDS:\n"
        "    tiny_pipeline(kind)\n"
    )
    result = subprocess.run(
        [sys.executable, "-W", "default", "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    assert (result.returncode, result.stderr) == (0, "")
