"""The families' facts: what each ``DiffusersRunner`` family declares, and who reads it.

Determinism: no engine, no threads; tiny pipelines with seeded weights (no download),
saved to a folder where the server's loader reads one.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from omni_trio.runners import tiny_pipeline
from omni_trio.serve._models import load_model


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
