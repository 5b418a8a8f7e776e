"""LoRA adapters on a parallel worker: loaded on every rank, mixed in one split batch.

Two ranks split tiny Stable Diffusion's guidance (``cfg=2``). Two random LoRAs are
loaded through the engine, which loads each on every rank (all or nothing); three
requests, with ``ink``, with ``ink`` and ``film``, and with none, share the batch,
and each rank runs its slice of the rows with those rows' own adapters. The images
are one process's with the same adapters.

Usage: .venv/bin/python examples/adapters_on_ranks.py   (seconds on a CPU; needs peft:
the ``adapters`` extra)
"""

import functools
import tempfile
from pathlib import Path
from typing import Any

import anyio
import torch

import omni_trio as ot
from omni_trio.parallel import ParallelRunner
from omni_trio.runners import DiffusersRunner, tiny_lora, tiny_pipeline

ASKS = [{"ink": 0.8}, {"ink": 0.4, "film": 0.6}, {}]


async def images(runner: Any, files: dict[str, Path]) -> list[torch.Tensor]:
    """The three requests' images from an engine over ``runner``, the files loaded."""
    async with ot.open_engine(runner, ot.EngineConfig(max_batch_size=4)) as engine:
        for name, path in files.items():
            await engine.load_adapter(name, path)
        print("loaded:", [(a.name, a.loaded) for a in engine.adapters()])
        handles = [
            engine.submit(
                ot.GenerationRequest(
                    prompt="a lighthouse", num_steps=4, height=64, width=64, seed=i, adapters=ask
                )
            )
            for i, ask in enumerate(ASKS)
        ]
        made = []
        for handle in handles:
            async with handle:
                made.append((await handle.result()).images)
    return made


async def main() -> None:
    with tempfile.TemporaryDirectory() as folder:
        pipe = tiny_pipeline("sd")
        files = {
            name: tiny_lora(pipe, folder, name, seed=s) for s, name in enumerate(["ink", "film"])
        }
        runner = ParallelRunner(functools.partial(tiny_pipeline, "sd"), cfg=2)
        split = await images(runner, files)  # the engine's close reaps rank 1
        alone = await images(DiffusersRunner(pipe), files)
    difference = max((a - b).abs().max().item() for a, b in zip(split, alone, strict=True))
    print(f"two ranks vs one process: max difference {difference:.1e}")
    assert all(torch.allclose(a, b, atol=1e-3) for a, b in zip(split, alone, strict=True))


if __name__ == "__main__":  # the ranks are spawned: they import this module
    anyio.run(main, backend="trio")
