"""The MP4 encoder (L78): the same frames make the same bytes, however busy the machine.

A resumed video job is promised the uninterrupted run's MP4, so the encode must be a
function of the frames. x264 left to pick its algorithms by the CPU was not: encodes
of one video made different bytes while other threads kept the cores busy.

Determinism rules: the load is real (torch matrix products in a thread, releasing the
GIL, and three encoding threads), but nothing is timed: the test asserts that every
encode made one byte string.
"""

from __future__ import annotations

import io
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from omni_trio._mp4 import write_mp4

pytest.importorskip("av")

ENCODES = 12


def video(frames: int = 13, height: int = 480, width: int = 832) -> torch.Tensor:
    """A smooth video that dims frame by frame (what a model's output looks like to x264)."""
    generator = torch.Generator().manual_seed(0)
    coarse = torch.rand(1, 3, height // 16, width // 16, generator=generator)
    image = torch.nn.functional.interpolate(coarse, size=(height, width), mode="bilinear")[0]
    dim = 1 - torch.arange(frames) / (2 * frames)
    return image[None] * dim[:, None, None, None]


def mp4(frames: torch.Tensor) -> bytes:
    data = io.BytesIO()
    write_mp4(frames, data, fps=16.0)
    return data.getvalue()


def test_one_video_encoded_on_a_busy_machine_is_one_byte_string() -> None:
    """L78: twelve encodes of one video, three at a time beside a thread of matrix
    products, are one byte string."""
    frames = video()
    stop = threading.Event()

    def busy() -> None:
        a = torch.rand(256, 256)
        while not stop.is_set():
            a = torch.tanh(a @ a)

    load = threading.Thread(target=busy, name="busy")
    load.start()
    try:
        with ThreadPoolExecutor(3) as pool:
            made = set(pool.map(lambda _: mp4(frames), range(ENCODES)))
    finally:
        stop.set()
        load.join()
    assert len(made) == 1
