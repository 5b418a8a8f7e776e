"""One request over two ranks: its classifier-free guidance split between two processes.

The engine's process is rank 0; the runner spawns rank 1, which builds the same tiny
pipeline from the factory: every model call, rank 0 runs its unconditional rows and
rank 1 its conditional ones. The image equals the one a single process makes.
"""

import functools

import anyio
import torch

import omni_trio as ot
from omni_trio.parallel import ParallelRunner
from omni_trio.runners import DiffusersRunner, tiny_pipeline

REQUEST = ot.GenerationRequest(prompt="a lighthouse", num_steps=8, height=64, width=64, seed=3)


async def main() -> None:
    runner = ParallelRunner(functools.partial(tiny_pipeline, "sd"), cfg=2)
    async with ot.open_engine(runner) as engine:  # its close reaps rank 1
        split = await engine.generate(REQUEST)
    async with ot.open_engine(DiffusersRunner(tiny_pipeline("sd"))) as engine:
        alone = await engine.generate(REQUEST)
    difference = (split.images - alone.images).abs().max().item()
    print(f"two ranks vs one process: max difference {difference:.1e}")
    assert torch.allclose(split.images, alone.images, atol=1e-3)


if __name__ == "__main__":  # the ranks are spawned: they import this module
    anyio.run(main, backend="trio")
