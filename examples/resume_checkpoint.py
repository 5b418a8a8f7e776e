"""Checkpoint a video request while it runs, then resume it in a fresh engine (L78).

The first engine runs 6 steps of tiny Wan and takes a checkpoint at every step
boundary (``every_s=0``; the server's default is 30 s); the sink is called in the
engine's materializer thread and keeps the bytes. A second engine, on a runner built
afresh (as after a crash), resumes from the checkpoint after step 3: it runs only
the last 3 steps, and its video equals the first one's. The durable job store of
``serve --jobs-dir`` does the same with files (docs/serving.md, "Durable jobs").

Usage: .venv/bin/python examples/resume_checkpoint.py   (seconds on a CPU)
"""

import anyio
import torch

import omni_trio as ot
from omni_trio.runners import DiffusersRunner, tiny_pipeline

REQUEST = ot.GenerationRequest(
    prompt="a boat crossing a bay", num_steps=6, height=32, width=32, num_frames=5, seed=1
)


async def run(checkpoints: list[ot.Checkpoint], resume_from: bytes | None) -> torch.Tensor:
    policy = ot.CheckpointPolicy(every_s=0, sink=checkpoints.append)
    async with ot.open_engine(DiffusersRunner(tiny_pipeline("wan"))) as engine:
        handle = engine.submit(REQUEST, checkpoint=policy, resume_from=resume_from)
        async with handle:
            steps = [event.step async for event in handle]
            output = await handle.result()
    print(f"ran steps {steps}")
    assert output.video is not None
    return output.video


async def main() -> None:
    taken: list[ot.Checkpoint] = []
    whole = await run(taken, None)
    print(f"checkpoints after steps {[c.step for c in taken]}, {len(taken[0].data)} bytes each")
    resumed = await run([], taken[2].data)
    print(
        f"resumed from step {taken[2].step}: equal to the whole run: {torch.equal(resumed, whole)}"
    )


if __name__ == "__main__":
    anyio.run(main, backend="trio")
