"""Generate one image with a diffusers pipeline, driven step by step by the engine.

Usage: .venv/bin/python examples/generate.py [MODEL_DIR]   (default: a tiny random SD pipeline)
"""

import sys
from typing import Any

import anyio

import omni_trio as ot
from omni_trio.runners import runner_for, tiny_pipeline


def load_pipeline() -> Any:
    if len(sys.argv) > 1:  # a real model, already on this machine
        from diffusers import DiffusionPipeline

        loader: Any = DiffusionPipeline.from_pretrained
        return loader(sys.argv[1], local_files_only=True)
    return tiny_pipeline("sd")


async def main() -> None:
    runner = runner_for(load_pipeline())
    async with ot.open_engine(runner) as engine:
        request = ot.GenerationRequest(
            prompt="a lighthouse at dusk", num_steps=20, height=64, width=64, seed=3
        )
        output = await engine.generate(request)
    output.to_pil()[0].save("generate.png")
    print("wrote generate.png in", f"{output.metrics.total_s * 1e3:.0f} ms")


if __name__ == "__main__":
    anyio.run(main, backend="trio")
