"""Generate a short video with Wan, step by step, and write it as an MP4.

A video request is an image request with ``num_frames``: here 9 frames (Wan takes
4k + 1) of 32 x 32 px in 3 steps, on tiny random weights (noise-like frames, real
machinery). Its output's ``video`` is ``[N, F, C, H, W]``; ``images`` its first
frames. Writes video.mp4 (needs PyAV: ``pip install 'omni_trio[video]'``).

Usage: .venv/bin/python examples/video.py   (seconds on a CPU)
"""

import anyio

import omni_trio as ot
from omni_trio.runners import DiffusersRunner, tiny_pipeline


async def main() -> None:
    runner = DiffusersRunner(tiny_pipeline("wan"))
    print(f"{runner.family}: num_frames % {runner.capabilities.frames}")
    request = ot.GenerationRequest(
        prompt="a boat crossing a bay", num_steps=3, height=32, width=32, num_frames=9, seed=1
    )
    async with ot.open_engine(runner) as engine:
        async with engine.submit(request) as handle:
            async for event in handle:
                print(f"step {event.step}/{event.total}")
            output = await handle.result()
    assert output.video is not None
    print(f"video {tuple(output.video.shape)}")
    output.save_video("video.mp4", fps=8)
    print("wrote video.mp4")


if __name__ == "__main__":
    anyio.run(main, backend="trio")
