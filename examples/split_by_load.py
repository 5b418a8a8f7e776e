"""Two ranks that split one request's tokens while it is alone, and a batch's rows when not.

``by_load=True`` with Ulysses (or ring): a model call with fewer rows than ranks splits
its tokens over the ranks (the latency of a request alone); a call with a row per rank
or more gives each rank its own rows and exchanges no tokens (the throughput of a
deep queue). The way changes only where the batch does, at a step boundary, and the
images are one process's either way.
"""

import functools

import anyio
import torch

import omni_trio as ot
from omni_trio.parallel import ParallelRunner
from omni_trio.runners import DiffusersRunner, tiny_pipeline

ALONE = ot.GenerationRequest(prompt="a lighthouse", num_steps=4, height=64, width=64, seed=3)
PAIR = [
    ot.GenerationRequest(prompt="a red kite", num_steps=4, height=64, width=64, seed=4),
    ot.GenerationRequest(prompt="a blue boat", num_steps=4, height=64, width=64, seed=5),
]


async def images(engine: ot.Engine, requests: list[ot.GenerationRequest]) -> list[torch.Tensor]:
    """The requests' images, submitted together (they batch where they meet)."""
    results: dict[int, torch.Tensor] = {}

    async def one(index: int) -> None:
        results[index] = (await engine.generate(requests[index])).images

    async with anyio.create_task_group() as group:
        for index in range(len(requests)):
            group.start_soon(one, index)
    return [results[index] for index in range(len(requests))]


async def main() -> None:
    runner = ParallelRunner(functools.partial(tiny_pipeline, "flux"), ulysses=2, by_load=True)
    async with ot.open_engine(runner) as engine:  # its close reaps rank 1
        split = await images(engine, [ALONE])  # alone: its tokens split
        split += await images(engine, PAIR)  # together: a row per rank
        calls = runner.calls()  # rank 0's count, which every rank shares
    async with ot.open_engine(DiffusersRunner(tiny_pipeline("flux"))) as engine:
        alone = await images(engine, [ALONE, *PAIR])
    difference = max((a - b).abs().max().item() for a, b in zip(split, alone, strict=True))
    print(f"model calls each way: {calls}")
    print(f"two ranks vs one process: max difference {difference:.1e}")
    assert all(torch.allclose(a, b, atol=1e-3) for a, b in zip(split, alone, strict=True))


if __name__ == "__main__":  # the ranks are spawned: they import this module
    anyio.run(main, backend="trio")
