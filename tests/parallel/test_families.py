"""Every family a layout serves, each over two gloo ranks, against the single-process
runner (L48). Slow: each case starts its own group (a model load per rank).

Determinism: seeded weights and seeds; the runners are driven directly, with no
engine (what is compared is the model's output, which no event loop touches);
images compared within ``ATOL``.
"""

from __future__ import annotations

import pytest

from tests.support.parallel import close, closed_images_of, group, guided_requests, images_of

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(
    ("kind", "layout"),
    [
        ("sdxl", "cfg"),
        ("sd3", "cfg"),
        ("qwen-image", "cfg"),
        ("ltx", "cfg"),
        ("wan", "ulysses"),
        ("qwen-image", "ulysses"),
        ("wan", "ring"),
    ],
)
def test_every_family_makes_the_single_process_output(kind: str, layout: str) -> None:
    """L48: SDXL, SD3, Qwen-Image (true CFG: a negative prompt) and LTX-Video split their
    guidance over two ranks, Wan (video) and Qwen-Image (its text padded, masked, to the
    ranks) run sequence parallel, and each makes the single-process runner's output.
    (LTX-Video is refused for sequence parallel: tests/parallel/test_faults.py.)"""
    [request] = guided_requests(kind)[:1]
    expected = closed_images_of(kind, request)
    with group(kind, layout) as runner:
        assert close([images_of(runner, request)], [expected])
