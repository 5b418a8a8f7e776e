"""What ``pyproject.toml`` asks for is what the runners need.

- the diffusers floor is at least the first release that has every pipeline
  ``DiffusersRunner`` drives and every API its families call (the table below,
  read off the published wheels: the release before each one lacks it);
- accelerate is a dependency: diffusers loads Wan's transformer only through it.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

from omni_trio.runners._registry import supported_pipelines

ROOT = Path(__file__).resolve().parents[2]

#: The first diffusers release with each pipeline ``DiffusersRunner`` drives, and with
#: each API a family needs.
FIRST_RELEASE = {
    "DDPMPipeline": "0.1.0",
    "DDIMPipeline": "0.1.0",
    "StableDiffusionPipeline": "0.2.0",
    "StableDiffusionXLPipeline": "0.18.0",
    "StableDiffusion3Pipeline": "0.29.0",
    "FluxPipeline": "0.30.0",
    "LTXPipeline": "0.32.0",
    "LTXImageToVideoPipeline": "0.32.0",
    "WanPipeline": "0.33.0",
    "WanImageToVideoPipeline": "0.33.0",
    "QwenImagePipeline": "0.35.0",
    # Wan 2.2's second expert (WanPipeline.transformer_2, boundary_ratio).
    "Wan 2.2 (transformer_2, boundary_ratio)": "0.35.0",
    # The Qwen-Image family calls the transformer without ``txt_seq_lens`` (the text
    # length comes from the embeddings and their mask); 0.35 and 0.36 require it.
    "QwenImageTransformer2DModel without txt_seq_lens": "0.37.0",
}


def requirements() -> dict[str, Requirement]:
    """pyproject's ``[project] dependencies``, by name."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    return {r.name: r for r in map(Requirement, project["dependencies"])}


def test_the_table_has_every_driven_pipeline() -> None:
    """A family that joins the registry joins the table."""
    assert set(supported_pipelines()) <= set(FIRST_RELEASE)


def test_the_diffusers_floor_has_every_family() -> None:
    """pyproject's diffusers floor is at least the newest release of the table."""
    specifier = requirements()["diffusers"].specifier
    floors = [Version(s.version) for s in specifier if s.operator == ">="]
    assert len(floors) == 1
    assert floors[0] >= max(map(Version, FIRST_RELEASE.values()))


def test_accelerate_is_a_dependency() -> None:
    """accelerate is asked for, with a floor."""
    assert any(s.operator == ">=" for s in requirements()["accelerate"].specifier)
