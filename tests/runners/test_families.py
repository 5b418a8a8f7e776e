"""The families' facts: a new family is one class (and its tiny pipeline).

Every fact about a family (the pipelines it drives, its denoisers and their blocks, its
clips' frames per second, its guidance parameter, sequence-parallel support, adapters)
is a class attribute of its ``Family``; the registry, the cancel points, the step cache,
the adapters, the server's defaults and the parallel layer read it there. These tests
hold every registered family to every fact and to its tiny pipeline, and the tables
that must stay torch-free (the server's built-in models, the demo's kinds) to the
families.

Determinism: no engine, no threads; tiny pipelines with seeded weights (no download),
built once per process, saved to a folder where the server's loader reads one.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import pytest
import torch

from omni_trio.cli._demo import KINDS as DEMO_KINDS
from omni_trio.runners import (
    TINY_KINDS,
    TINY_VIDEO_KINDS,
    DiffusersRunner,
    context_parallel_denoisers,
    tiny_pipeline,
)
from omni_trio.runners._family import Family
from omni_trio.runners._registry import FAMILIES, family_class, supported_pipelines
from omni_trio.runners._stepcache import BlockSpec
from omni_trio.serve._models import MODELS, VIDEO_MODELS, VIDEO_PIPELINES, load_model
from tests.support.runners import tiny, two_experts

#: The facts: ``Family``'s class attributes that it declares without a value.
FACTS = tuple(
    name
    for name, annotation in Family.__annotations__.items()
    if str(annotation).startswith("ClassVar")
)


def test_every_family_declares_every_fact() -> None:
    """The base declares each fact without a value, so a family that leaves one out
    fails here, not at the first pipeline that reads it; each is of its kind."""
    assert {"pipelines", "denoisers", "block_lists", "fps", "context_parallel"} <= set(FACTS)
    assert not [fact for fact in FACTS if hasattr(Family, fact)]
    for family in FAMILIES:
        missing = [fact for fact in FACTS if not hasattr(family, fact)]
        assert not missing, (family.__name__, missing)
        assert family.name and family.title, family
        for names in (family.pipelines, family.denoisers, family.block_lists):
            assert names and all(isinstance(name, str) for name in names), family
        assert all(isinstance(spec, BlockSpec) for spec in family.block_specs.values())
        assert family.fps is None or family.fps > 0, family
        assert family.guidance_parameter is None or isinstance(family.guidance_parameter, str)
        assert isinstance(family.context_parallel, bool), family
        assert set(family.wrong_splits) <= {"ulysses", "ring"}, family
        assert not family.wrong_splits or family.context_parallel, family
        assert isinstance(family.takes_adapters, bool), family


def test_a_pipeline_class_is_one_familys() -> None:
    """The registry is the families' pipelines: each driven by one family, each family
    named once."""
    pipelines = [pipeline for family in FAMILIES for pipeline in family.pipelines]
    assert supported_pipelines() == pipelines
    assert len(set(pipelines)) == len(pipelines)
    assert len({family.name for family in FAMILIES}) == len(FAMILIES)


def blocks_of(denoiser: torch.nn.Module) -> list[str]:
    """The children of ``denoiser`` that hold blocks (a list of them)."""
    return [
        name for name, child in denoiser.named_children() if isinstance(child, torch.nn.ModuleList)
    ]


@pytest.mark.parametrize("family", FAMILIES, ids=lambda family: family.name)
def test_each_familys_facts_are_its_tiny_pipelines(family: type[Family]) -> None:
    """``tiny_pipeline(name)`` builds a pipeline the family drives, and what the family
    declares is what that pipeline is: its denoisers and block lists are there (every
    list of blocks declared), its block classes take what the step cache's specs say,
    a video family has a frame rule and frames per second, its guidance parameter is a
    parameter of ``__call__``, its denoisers carry diffusers' context-parallel plan
    where it says so, and diffusers loads adapters where it takes them."""
    pipe: Any = tiny(family.name)
    assert family_class(pipe) is family
    models = [getattr(pipe, name) for name in family.denoisers]  # every one an attribute
    present = [model for model in models if isinstance(model, torch.nn.Module)]
    assert present and all(model is None for model in models if model not in present)
    for denoiser in present:
        assert all(hasattr(denoiser, name) for name in family.block_lists), family
        assert set(blocks_of(denoiser)) <= set(family.block_lists), blocks_of(denoiser)
        for name in family.block_lists if family.block_specs else ():
            for block in getattr(denoiser, name):
                spec = family.block_specs[type(block).__name__]
                assert tuple(inspect.signature(type(block).forward).parameters)[1:] == spec.params
    assert (family(pipe).frames is not None) == (family.fps is not None)
    parameters = inspect.signature(type(pipe).__call__).parameters
    if family.guidance_parameter is None:
        assert not {"guidance_scale", "true_cfg_scale"} & set(parameters)
    else:
        assert family.guidance_parameter in parameters
    planned = all(getattr(model, "_cp_plan", None) for model in present)
    assert family.context_parallel == planned
    assert family.takes_adapters == callable(getattr(pipe, "load_lora_weights", None))


def test_the_tables_that_load_no_torch_are_the_families() -> None:
    """The tiny kinds are the families' names (images, then text-to-video), and the
    tables ``import omni_trio.serve`` and the demo read without torch are theirs: the
    built-in models, the video models and pipelines, the demo's kinds."""
    images = [family.name for family in FAMILIES if family.fps is None]
    videos = [family for family in FAMILIES if family.fps is not None]
    assert list(TINY_KINDS) == images
    assert list(TINY_VIDEO_KINDS) == [f.name for f in videos if not f.image_to_video]
    assert (*(f"tiny-{kind}" for kind in (*TINY_KINDS, *TINY_VIDEO_KINDS)), "fake") == MODELS
    assert tuple(f"tiny-{kind}" for kind in TINY_VIDEO_KINDS) == VIDEO_MODELS
    assert frozenset(pipeline for f in videos for pipeline in f.pipelines) == VIDEO_PIPELINES
    assert (*TINY_KINDS, "fake") == DEMO_KINDS


def test_sequence_parallel_asks_the_family() -> None:
    """L48: the denoisers sequence parallel splits are the family's (Wan 2.2's two
    experts); a family without diffusers' plan is refused naming those with one, a
    family whose split is known wrong (LTX-Video) for either layout, saying why and
    naming cfg; a pipeline of no family as ``DiffusersRunner`` refuses it."""
    experts = two_experts()
    assert context_parallel_denoisers(experts, "ulysses") == [
        experts.transformer,
        experts.transformer_2,
    ]
    assert context_parallel_denoisers(tiny("ltx")) == [tiny("ltx").transformer]
    for layout in ("ulysses", "ring"):
        with pytest.raises(TypeError, match=r"LTX-Video is not supported \(diffusers"):
            context_parallel_denoisers(tiny("ltx-i2v"), layout)
    with pytest.raises(TypeError) as refused:
        context_parallel_denoisers(tiny("sd3"), "ring")
    assert str(refused.value) == (
        "sequence parallel needs a transformer with a context-parallel plan"
        " (Flux, Qwen-Image, Wan); StableDiffusion3Pipeline has none"
    )
    with pytest.raises(TypeError, match="DiffusersRunner drives"):
        context_parallel_denoisers(object(), "ring")


def test_adapters_and_the_step_cache_follow_the_familys_denoisers() -> None:
    """L85, L80: a pipeline with a second denoiser (Wan 2.2) takes no adapters, and the
    step cache wraps both experts' blocks; an unconditional UNet takes none either and
    caches nothing."""
    runner = DiffusersRunner(two_experts())
    try:
        assert runner.capabilities.max_adapters == 0
        assert runner.capabilities.step_cache
    finally:
        runner.close()
    runner = DiffusersRunner(tiny("unet"))
    try:
        assert runner.capabilities.max_adapters == 0
        assert not runner.capabilities.step_cache
    finally:
        runner.close()


@pytest.mark.parametrize(
    ("model", "guidance", "fps"),
    [("tiny-qwen-image", 4.0, None), ("tiny-unet", 7.5, None), ("tiny-ltx", 3.0, 25.0)],
)
def test_the_servers_defaults_are_the_familys(
    model: str, guidance: float, fps: float | None
) -> None:
    """The server's default guidance is the ``__call__`` default of the family's
    guidance parameter (Qwen-Image's ``true_cfg_scale``; none: the fallback), a video
    model's frames per second the family's."""
    loaded = load_model(model, step_seconds=0.0)
    assert (loaded.guidance_scale, loaded.fps) == (guidance, fps)


@pytest.mark.parametrize(("kind", "fps"), [("wan-i2v", 16.0), ("ltx-i2v", 25.0)])
def test_an_image_to_video_folder_is_served_at_its_familys_fps(
    kind: str, fps: float, tmp_path: Path
) -> None:
    """A Wan or LTX-Video image-to-video folder makes clips at its family's frames per
    second (Wan 16, LTX-Video 25, as docs/serving.md says), not another video model's 24:
    ``seconds`` become the frame count the model is made for."""
    tiny_pipeline(kind).save_pretrained(tmp_path / kind)
    model = load_model(str(tmp_path / kind), step_seconds=0.0)
    assert model.fps == fps
